"""One rank of a disttrace job. Started by `disttrace run` through torch's elastic launcher, or by hand:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT -m disttrace.worker --run-dir DIR

It builds data -> model -> strategy -> loop, attaches the recorder and the (at most one) fault to the hook
bus, and writes its rank's part of the run store. Rank 0 writes COMPLETE after every rank has flushed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from disttrace.config.freezing import parse_lock, validate
from disttrace.config.manifest import Manifest
from disttrace.errors import EXIT_INTERRUPTED, BadInput, DisttraceError
from disttrace.run.job.complete import seal_and_complete
from disttrace.run.job.hooks import process_exit
from disttrace.store.documents import Replicas, ResumeSpec, RunInfo
from disttrace.store.events import BadInputNote, CheckpointSaved, EngineFacts, RankFailed, Resumed
from disttrace.store.paths import resume_checkpoint
from disttrace.store.rundir import COMPLETE, LOCK, rank_file, read_run_info
from disttrace.store.writers import disk_full, event, write_json_atomic


@dataclass
class Context:
    """What the loop and the faults may see of the worker."""

    run_dir: Path
    manifest: Manifest
    manifest_id: str
    rank: int
    world: int
    dp_rank: int
    device: Any
    strategy: Any  # a run/parallel Strategy
    data: Any  # the rank's token windows (data/windows.py's TokenData)
    bus: Any  # the HookBus
    tracer: Any  # the collective tracer (run/record/flightrec.py or run/record/collectives.py)
    start_step: int = 0  # the step a resumed run starts after
    stop_after: int | None = None  # `gate --replay`: the last step to run

    def save_checkpoint(self, step: int) -> None:
        from disttrace.run.job import checkpoint

        path = checkpoint.save(
            self.strategy,
            self.run_dir,
            step,
            self.manifest_id,
            self.world,
            self.rank,
            self.bus,
            extra={"data_position": step * self.data.global_batch},
        )
        if self.rank == 0:
            event(
                self.run_dir,
                CheckpointSaved(step=step, path=str(path.relative_to(self.run_dir))),
            )


def setup_torch(manifest: Manifest):
    import torch

    torch.set_num_threads(
        1
    )  # several ranks share the host's cores; more threads per rank is slower
    if manifest.debug.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    return torch


def pick_backend(manifest: Manifest, torch) -> tuple:
    want = manifest.parallelism.backend
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if want == "auto" else want
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return backend, torch.device("cuda", local)
    return backend, torch.device("cpu")


def run(run_dir: Path) -> None:
    lock = parse_lock(run_dir / LOCK)  # its shape: the launcher checked its data (read_lock)
    info = read_run_info(run_dir)
    if info.resume:  # refused before any process group exists (run.json may come from elsewhere)
        resume_checkpoint(run_dir, info.resume)
    # validated once, here: the job reads the typed model (a misspelt field is an AttributeError, not a
    # silent default); a lock edited into a shape the model refuses is bad input naming file and field
    manifest = validate(lock.manifest, run_dir / LOCK)
    torch = setup_torch(manifest)
    import torch.distributed as dist

    from disttrace.data.windows import TokenData
    from disttrace.model.llama import build_model
    from disttrace.run.job.hooks import HookBus
    from disttrace.run.job.loop import emit_module_outputs, train
    from disttrace.run.job.stepclock import StepClock
    from disttrace.run.parallel import build_strategy
    from disttrace.run.record import flightrec
    from disttrace.run.record.recorder import Recorder

    backend, device = pick_backend(manifest, torch)
    record = manifest.record
    trace_kind = flightrec.trace_mode(manifest, backend)
    flightrec.prepare_env(
        trace_kind
    )  # the Flight Recorder's ring size is read when the first group is made
    timeout = timedelta(seconds=manifest.debug.collective_timeout_s)
    take_permuted_rank(info)
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != manifest.world_size:
        raise RuntimeError(
            f"the job has {world} ranks but the manifest's dp*cp*tp*pp is {manifest.world_size}"
        )
    refuse_a_second_attempt(run_dir, rank)
    tracer = flightrec.build_trace(trace_kind, run_dir, rank)
    bus = None
    try:
        with tracer:
            mesh, topo = lay_out(run_dir, manifest, rank, world, device, backend)
            dp_rank = topo.ranks[rank].coords["dp"]  # coordinates: mesh dimension -> index

            bus = HookBus(rank)
            tracer.attach(bus)
            clock = StepClock(run_dir, rank).attach(bus)  # step wall times, recorded or not
            recorder = (
                Recorder(
                    run_dir,
                    rank,
                    every=record.every,
                    forward=record.forward,
                    updates=record.updates,
                ).attach(bus)
                if record.enabled
                else None
            )
            data = TokenData(manifest, lock.data_path, lock.tokenizer_path)
            dtype = getattr(torch, manifest.training.dtype)
            model = build_model(manifest.model, dtype, manifest.experiment.seed)
            model.to(device)
            emit_module_outputs(model, bus)
            magnitudes = attach_model_observers(
                run_dir, rank, manifest, model, bus, recorder is not None, dp_rank
            )
            strategy = build_strategy(manifest, model, mesh, bus)
            groups = {**topo.groups, "world": [list(range(world))], **strategy.groups()}
            ledger = attach_observers(
                run_dir, rank, manifest, strategy, recorder, bus, groups, device
            )
            ctx = Context(
                run_dir=run_dir,
                manifest=manifest,
                manifest_id=lock.manifest_id,
                rank=rank,
                world=world,
                dp_rank=dp_rank,
                device=device,
                strategy=strategy,
                data=data,
                bus=bus,
                tracer=tracer,
            )
            attach_perturbation(bus, ctx, info)
            # a fixed global RNG state: checkpoints save it, and the `checkpoint` phase digests their bytes,
            # which must then be the same in two runs of one manifest (a resume restores it from the file)
            torch.manual_seed(manifest.experiment.seed * 1_000_003 + rank)
            start_point(ctx, info)
            train(ctx)
            strategy.close()
            for observer in (recorder, magnitudes, ledger, clock):
                if observer is not None:
                    observer.close()
        tracer.close()
        dist.barrier()
        seal_and_complete(
            run_dir, rank, recorder, dist, {"steps": manifest.training.steps, "world_size": world}
        )
    except BaseException as e:
        if bus is not None:
            process_exit(bus, e)
        raise
    finally:
        tracer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def lay_out(run_dir: Path, manifest: Manifest, rank: int, world: int, device, backend: str):
    """The device mesh, and the topology every rank agrees on (rank 0 writes it, and env.json)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from disttrace.run.job import topology

    shape, dims = topology.mesh_shape(manifest)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
    views: list = [None] * world
    dist.all_gather_object(views, topology.local_view(manifest, rank).model_dump())
    views = [topology.RankView.model_validate(v) for v in views]
    topo = topology.merge(views)
    if rank == 0:
        write_json_atomic(run_dir / "topology.json", topo.doc())
        write_json_atomic(
            run_dir / "env.json", environment(torch, backend, [v.host for v in views])
        )
    return mesh, topo


def attach_model_observers(
    run_dir: Path, rank: int, manifest: Manifest, model, bus, recorded: bool, dp_rank: int
):
    """What watches the plain model's modules: the magnitudes the numeric bound scales gradients by (with
    the recorder), and the one step recorded at depth (docs/zoom.md; unset, no hooks at all). Returns the
    magnitudes (to close)."""
    magnitudes = None
    if recorded:
        from disttrace.run.record.scales import Magnitudes

        magnitudes = Magnitudes(run_dir, rank, model, every=manifest.record.every).attach(bus)
    depth = manifest.record.depth
    if depth is not None:
        from disttrace.run.record.depth import DepthRecorder

        DepthRecorder(
            run_dir,
            rank,
            model,
            depth.step,
            depth.level,
            dp=manifest.parallelism.dp,
            dp_rank=dp_rank,
            micro_batch_size=manifest.training.micro_batch_size,
            global_batch=manifest.global_batch,
        ).attach(bus)
    return magnitudes


def attach_perturbation(bus, ctx: Context, info: RunInfo) -> None:
    """run.json's fault (at most one), and `disttrace calibrate`'s perturbed reference."""
    from disttrace.run import faults

    fault = faults.build(info.fault.doc() if info.fault else None)
    if fault is not None:
        fault.attach(bus, ctx)
    if info.perturb:
        from disttrace.run.faults import perturb

        perturb.attach(bus, ctx, info.perturb)


def start_point(ctx: Context, info: RunInfo) -> None:
    """Where the run starts (a resume loads its checkpoint) and, for `gate --replay`, where it stops."""
    if info.resume:
        ctx.start_step = resume(ctx, info.resume)
    if info.stop_after is not None and info.stop_after > 0:  # a replay: steps up to this one only
        ctx.stop_after = info.stop_after


def take_permuted_rank(info: RunInfo) -> None:
    """`disttrace replay --permute-ranks`: run.json's `replay.rank_shift` k moves logical rank r to launch
    slot (r + k) % world. The launcher hands each process its slot as RANK (node-major, then LOCAL_RANK);
    this process takes logical rank (slot - k) % world instead, before the process group reads RANK.
    LOCAL_RANK, and the CUDA device chosen from it, stay the slot's: what is bound to the hardware (a
    faulty device) stays where it was, what is bound to the rank (its data shard, its code path) moves."""
    shift = info.replay.rank_shift if info.replay else None
    if not shift:
        return
    world, slot = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    os.environ["RANK"] = str((slot - shift) % world)


def refuse_a_second_attempt(run_dir: Path, rank: int) -> None:
    """A run directory holds one attempt: a job restarted into it (torchrun --max-restarts, or the worker
    started again by hand) would append a second step chain to the first's records, and the run would read as
    edited. Recovery is a new run from a checkpoint (`disttrace recover`)."""
    index = run_dir / rank_file("trajectory", rank, ".steps.jsonl")
    if index.exists() and index.stat().st_size:
        raise BadInput(
            index,
            "this run directory already holds an attempt's steps (a job restarted into it?): "
            "a run directory records one attempt; resume from a checkpoint into a new run with "
            "`disttrace recover`",
        )


def attach_observers(run_dir, rank, manifest: Manifest, strategy, recorder, bus, groups, device):
    """Everything that watches the job besides the recorder: the memory ledger, the replica map (and the
    live check of it, if asked), and what the engine reports of itself. Returns the ledger (to close)."""
    from disttrace.run.record.memory import MemoryLedger

    if rank == 0:
        doc = Replicas(
            groups=groups, rules=strategy.replicas(), strategy=strategy.name, engine=strategy.engine
        )
        write_json_atomic(run_dir / "replicas.json", doc.doc())
    if manifest.debug.live_check:
        from disttrace.run.record.livecheck import LiveCheck

        LiveCheck(run_dir, recorder, strategy.replicas(), groups, rank, device).attach(bus)
    if rank == 0:
        seen: dict = {}

        def log_engine_facts(
            b, p
        ):  # logged when it changes (DDP rebuilds its buckets after step 1)
            facts = strategy.engine_facts()
            if facts != seen:
                seen.clear()
                seen.update(facts)
                event(run_dir, EngineFacts(step=b.step, **facts))

        bus.on("step_end", log_engine_facts, order=95)
    if (
        recorder is None
    ):  # record.enabled = false: the unrecorded baseline has no ledger (its saved-tensor hooks cost)
        return None
    return MemoryLedger(run_dir, rank, manifest, strategy).attach(bus)


def resume(ctx, spec: ResumeSpec) -> int:
    """Load the checkpoint named in run.json (relative to the runs/<id12>/ directory) and return its step."""
    from disttrace.run.job import checkpoint

    path = resume_checkpoint(ctx.run_dir, spec)  # inside the runs root, or BadInput
    identity = ctx.manifest_id
    if ctx.manifest.record.depth is not None:  # a replay recording at depth
        from disttrace.config.freezing import checkpoint_identity

        identity = checkpoint_identity(ctx.manifest)
    progress = checkpoint.load(ctx.strategy, path, ctx.rank, identity)
    if ctx.rank == 0:
        event(
            ctx.run_dir,
            Resumed(
                step=progress.step,
                checkpoint=spec.checkpoint,
                with_optimizer=progress.with_optimizer,
            ),
        )
    return progress.step


def environment(torch, backend: str, hosts: list[str]) -> dict:
    """env.json: the software, the devices and the hosts the job ran on."""
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    def ver(p):
        try:
            return version(p)
        except PackageNotFoundError:
            return None

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "backend": backend,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else ["cpu"],
        "hosts": sorted(set(hosts)),
        "git_commit": commit,
        "packages": {
            p: ver(p) for p in ("disttrace", "torch", "numpy", "tokenizers", "xxhash", "orjson")
        },
        "env": {
            k: os.environ.get(k)
            for k in ("OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME")
        },
    }


def die_with_parent() -> None:
    """If the launcher is killed (SIGKILL leaves no chance to clean up), its ranks must not live on as
    orphans and finish a run nobody watches: ask Linux to kill this process when its parent dies."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


# Under disttrace's own launcher each rank's stdout and stderr go to a log file of the run, so a failing
# rank's traceback is kept there and never reaches the terminal (where the launcher prints one line). The
# launcher sets this; a worker started by hand (torchrun) keeps its terminal.
LOG_ENV = "DISTTRACE_WORKER_LOG"
# bytes set aside in the log file when it is opened (fallocate, past its end), so the traceback of a rank
# that failed because the disk is full can still be written; given back when the rank exits
LOG_RESERVE = 256 << 10
# the last line a failing rank writes to its log: the launcher reads it for the one line it prints
FAILURE_NOTE = "disttrace-rank-failed: "


def log_path(run_dir: Path, slot: int) -> Path:
    """A rank's log, by its launch slot (the rank the launcher knows it by). Not `rank-N.*`: the seal
    hashes those, and a log is written until the process exits, after the seal."""
    return Path(run_dir) / "logs" / f"stderr-{slot:05d}.log"


def _fallocate(fd: int, mode: int, offset: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        return libc.fallocate(fd, mode, offset, length) == 0
    except (OSError, AttributeError):
        return False


def reserve_space(fd: int, length: int = LOG_RESERVE) -> bool:
    """Allocate `length` bytes past the end of the file without changing its size (FALLOC_FL_KEEP_SIZE):
    appends then land in blocks the file already holds, even once the disk is full. Best effort (a file
    system without fallocate: nothing reserved)."""
    return _fallocate(fd, 0x01, os.fstat(fd).st_size, length)


def release_space(fd: int) -> None:
    """Give back what reserve_space set aside past the current end: a truncation to the file's own size
    frees the blocks past it (a hole punched past the end is ignored by ext4)."""
    try:
        os.ftruncate(fd, os.fstat(fd).st_size)
    except OSError:
        pass


_log_fd: int | None = None


def log_to_run(run_dir: Path) -> Path | None:
    """Send this process's stdout and stderr (Python's and C++'s: both file descriptors) to its log file in
    the run, with space set aside; None when not under disttrace's launcher or when the log cannot be made
    (the rank then writes where it was started)."""
    global _log_fd
    if os.environ.get(LOG_ENV) != "1":
        return None
    path = log_path(run_dir, int(os.environ.get("RANK", 0)))
    try:
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    reserve_space(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _log_fd = fd
    return path


def close_log() -> None:
    """Flush what the process wrote and give back the space set aside (the last thing a rank does)."""
    if _log_fd is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    release_space(_log_fd)


def _path_in_frames(exc: BaseException) -> str | None:
    """The file a writer was writing when `exc` (an OSError without a file name: a write() or fsync())
    was raised: the innermost frame's `path` (a writer's own or its local one)."""
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        local = frame.f_locals
        for value in (local.get("path"), getattr(local.get("self"), "path", None)):
            if isinstance(value, (str, Path)) and str(value):
                return str(value)
    return None


def failure_note(e: BaseException, run_dir: Path, slot: int) -> dict:
    """What a failed rank says about itself in one JSON line: its error and, when the disk was full, the
    file being written (never None: the run directory if nothing better is known)."""
    full = disk_full(e)
    note = {"slot": slot, "error": " ".join(f"{type(e).__name__}: {e}".split())[:500]}
    if full is not None:
        note["disk_full"] = full.strerror or os.strerror(full.errno)
        note["path"] = str(full.filename or _path_in_frames(full) or run_dir)
    return note


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m disttrace.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help="a run directory prepared by `disttrace run --prepare-only`",
    )
    args = ap.parse_args(argv)
    run_dir = args.run_dir.resolve()
    die_with_parent()
    slot = int(os.environ.get("RANK", -1))  # before a permuted replay takes another rank
    log_to_run(run_dir)
    try:
        run(run_dir)
    except (
        BaseException
    ) as e:  # record why this rank stopped, then let the launcher see the failure
        if isinstance(e, SystemExit):
            close_log()
            raise
        if not (run_dir / COMPLETE).exists():
            rank = int(os.environ.get("RANK", -1))
            # bad input (a checkpoint item refused unread): the launcher reports it as exit 2, naming the file
            bad = (
                BadInputNote(where=e.where, field=e.field, reason=e.reason)
                if isinstance(e, BadInput)
                else None
            )
            event(
                run_dir,
                RankFailed(
                    rank=rank,
                    error=f"{type(e).__name__}: {e}"[:2000],
                    where=traceback.format_exc(limit=3)[-1500:],
                    **({"bad_input": bad} if bad else {}),
                    **({"disk_full": True} if disk_full(e) is not None else {}),
                ),
            )
        import json

        try:  # a disk without the reserved space (no fallocate) may refuse these too: the exit code stays
            if isinstance(
                e, DisttraceError
            ):  # bad input (e.g. a crafted run.json): one line, its exit code
                print(f"error: {e}", file=sys.stderr)
            else:  # the traceback: into the rank's log under our launcher, else where it was started
                traceback.print_exc()
            print(FAILURE_NOTE + json.dumps(failure_note(e, run_dir, slot)), file=sys.stderr)
        except OSError:
            pass
        close_log()
        if isinstance(e, DisttraceError):
            return e.exit_code
        return EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else 1
    close_log()
    return 0


if __name__ == "__main__":
    sys.exit(main())
