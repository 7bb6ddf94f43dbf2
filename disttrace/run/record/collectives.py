"""The collective trace: every collective and point-to-point op a rank issues, including those the engines
issue from C++ (DDP's reducer, FSDP, DTensor redistributions, pipeline send/recv).

One interception point: a TorchDispatchMode sees every `c10d.*` and `_c10d_functional.*` op with its
tensors and process group (docs/design.md, "Facts"; the Flight Recorder has no timings on gloo). The
issue line is written and flushed *before* the op runs, so a rank that hangs or dies in a collective has
already said which one; the end time follows on its own line.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disttrace.run.record.recorder import tensor_leaves
from disttrace.store.documents import CollectiveLine
from disttrace.store.rundir import rank_file
from disttrace.store.writers import JsonlWriter

# position of the input tensor(s) among each op's arguments (bytes on the wire are the input's)
INPUT_ARG = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "reduce_": 0,
    "send": 0,
    "recv_": 0,
    "recv_any_source_": 0,
    "allgather_": 1,
    "_allgather_base_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_base_": 1,
    "alltoall_": 1,
    "gather_": 1,
    "scatter_": 0,  # scatter: only the source has inputs; every rank has an output of the same shape
    # functional collectives (DTensor, FSDP2 internals)
    "all_reduce": 0,
    "all_reduce_coalesced": 0,
    "all_gather_into_tensor": 0,
    "all_gather_into_tensor_coalesced": 0,
    "reduce_scatter_tensor": 0,
    "reduce_scatter_tensor_coalesced": 0,
    "all_to_all_single": 0,
    "broadcast": 0,
}
SKIP = {"wait_tensor"}  # completion of a functional op, not a new collective


def _group_ranks(args, kwargs) -> tuple[list[int] | None, str]:
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

    for a in list(args) + list(kwargs.values()):
        try:
            if isinstance(a, torch.ScriptObject):
                pg = ProcessGroup.unbox(a)
                return dist.get_process_group_ranks(pg), pg.group_name
            if isinstance(a, str) and a:
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(a)
                return dist.get_process_group_ranks(pg), a
        except Exception:  # not a process group argument
            continue
    return None, "?"


def _payload_digests(tensors) -> list[str]:
    """xxh3-64 of each input's raw bytes (what this rank put on the wire), outside this dispatch mode."""
    import xxhash
    from torch.utils._python_dispatch import _disable_current_modes

    from disttrace.run.record.digest import raw_bytes

    with _disable_current_modes():
        return [xxhash.xxh3_64_hexdigest(raw_bytes(t)) for t in tensors]


class CollectiveTracer(TorchDispatchMode):
    """The deep collective trace (`record.collectives = "values"`, and point-to-point runs on gloo, where the
    Flight Recorder sees no send/recv): every op as it is issued, with `values` the digest of each input.
    Its cost is a Python call per aten op of the step, not per collective: not the default."""

    # higher-order operators (flex attention, torch.cond, ...) reach __torch_dispatch__ whole: they hold no
    # collective of their own to trace, so each runs as it would without the mode
    supports_higher_order_operators = True

    def __init__(self, run_dir: Path, rank: int, values: bool = False):
        super().__init__()
        self.rank = rank
        self.values = values
        self.out = JsonlWriter(Path(run_dir) / rank_file("collectives", rank))
        self.seq: dict[str, int] = {}
        self.step = 0
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", None)  # a higher-order operator has none
        if not self.enabled or ns not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        op = func._opname
        if op in SKIP:
            return func(*args, **kwargs)
        ranks, _name = _group_ranks(args, kwargs)
        group = ",".join(map(str, ranks)) if ranks is not None else "?"
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        pos = INPUT_ARG.get(op.removesuffix(".default"))
        inputs = (
            [t for _, t in tensor_leaves(args[pos])] if pos is not None and pos < len(args) else []
        )
        shapes = [list(t.shape) for t in inputs]
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        rec = CollectiveLine(
            seq=seq,
            group=group,
            op=op,
            step=self.step,
            shapes=shapes,
            dtype=str(inputs[0].dtype).removeprefix("torch.") if inputs else None,
            bytes=nbytes,
            start=time.time(),
            **({"digests": _payload_digests(inputs)} if self.values else {}),
        )
        self.out.write(rec.line())
        self.out.flush()  # before the op runs: a hang or a death still leaves this line
        result = func(*args, **kwargs)
        self.out.write(CollectiveLine(seq=seq, group=group, end=time.time()).line())
        return result

    def attach(self, bus) -> CollectiveTracer:
        bus.on("step_start", lambda b, p: setattr(self, "step", b.step), order=0)
        return self

    def close(self, failed: bool = False):
        try:
            self.out.close()
        except (OSError, ValueError):
            pass
