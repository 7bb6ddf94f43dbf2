"""The end of a run, the same for our trainer and an attached script: every rank hashes the files it wrote
(they may sit on another node's disk) and all-gathers its part, which is also the barrier; global rank 0
seals them all into COMPLETE (store/seal.py), written last: without it a run is incomplete."""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import orjson

from disttrace.store import seal
from disttrace.store.writers import mark_complete


def seal_and_complete(run_dir: Path, rank: int, recorder, dist, fields: dict) -> None:
    """`recorder`: the run's Recorder (None when nothing was recorded); `dist`: torch.distributed when the
    job has a process group, else None; `fields`: what COMPLETE says besides the seal (steps, world size...)."""
    mine = seal.rank_part(
        run_dir,
        rank,
        recorder.chain.last if recorder else None,
        recorder.chain.steps if recorder else 0,
    )
    parts = [mine.doc()]
    if dist is not None and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        gather_released(dist, parts, mine.doc())
    if rank == 0:
        mark_complete(run_dir, {**fields, "seal": seal.build_seal(run_dir, parts).doc()})


def object_device(dist):
    """Where torch.distributed's object collectives put their bytes (the default group's backend)."""
    import torch

    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        kind = _get_object_coll_device()
    except (
        ImportError,
        AttributeError,
        TypeError,
        ValueError,
        RuntimeError,
    ):  # private: best effort
        kind = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def gather_released(dist, out: list, obj, timeout_s: float = 5.0) -> None:
    """all_gather_object for a JSON document (the seal's parts: JSON, so nothing a peer sends is unpickled),
    whose tensors are seen released by the process group's threads before this returns.

    A collective's tensors are held by the backend's own thread (gloo's worker, NCCL's watchdog) a little
    after the caller has its result. A tensor the caller drops meanwhile keeps its Python object, and that
    thread frees it later, taking the GIL to do so. torch.distributed.all_gather_object creates and drops
    its tensors itself; as the last thing a user's script does before exiting, that free can land while the
    interpreter finalizes, when Python 3.11 ends any thread that takes the GIL with pthread_exit: its unwind
    through a noexcept destructor is std::terminate ("terminate called without an active exception",
    SIGABRT). It happens when the group outlives destroy_process_group(), which on torch 2.13 is the rule
    under DDP: its constructor first imports torch._dynamo, which imports torch.distributed.nn.functional,
    whose functions keep the world group as a default argument. Here the tensors are ours: each is watched
    by weak reference, and this waits (`timeout_s` at most) until the thread has let go of them, while the
    interpreter is whole."""
    import torch

    device = object_device(dist)
    world = dist.get_world_size()
    data = orjson.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(outs, mine)
    out[:] = [orjson.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, lengths)]
    held = [weakref.ref(t) for t in (size, *sizes, mine, *outs)]
    del size, sizes, mine, outs
    deadline = time.monotonic() + timeout_s
    while any(r() is not None for r in held) and time.monotonic() < deadline:
        time.sleep(0.001)  # lets the backend's thread take the GIL and free them
