"""The collective trace read from torch's Flight Recorder (the default, `record.collectives = "metadata"`).

Every process group already records each collective it issues in one C++ ring buffer per process (op, group,
sequence number, sizes, dtypes, issue time; start/end times on NCCL): keeping the trace costs nothing per op.
We copy the ring into `collectives/rank-N.frames`, one compressed frame of JSON lines a copy
(store/collframes.py), in the record format the dispatch-mode tracer writes as JSON lines (`run/record/collectives.py`,
kept for `record.collectives = "values"`), so the readers do not care which wrote it.

When the ring is copied, and why:
* Not every step: a dump serialises the whole ring (~50 us per entry here, so ~0.1 s for torch's default
  2,000 entries), whether or not its entries are new. Instead, at each step's end we count the collectives
  issued since the last dump from the process groups' own sequence numbers (~1 us a group) and dump only
  when the next step could otherwise overwrite an entry not yet copied (pending + 2 x the largest step seen
  reaches the capacity less an eighth). The cost is then about one entry's dump per collective, and the
  ring never wraps past an uncopied entry unless one step issues more than that; if it does, the lost
  record ids are written as a `{"lost": n}` line and reported by the readers.
* At the end of the run, on a Python exception, and on SIGTERM / SIGABRT: a rank that dies that way (gloo
  aborts the process that receives a mismatched collective; the launcher then terminates the others)
  copies its ring from the signal handler, so the op it died in is in the trace and the cross-rank check
  names the desync. Only SIGKILL (and a hung dump, cut by a 3 s alarm) loses the entries since the last dump.

Known gaps of the recorder on gloo (torch 2.13): point-to-point ops are not recorded (pipeline and
parameter-server runs on gloo therefore use the dispatch-mode tracer, without payload digests), there are no
start/end times (an entry's `start` is its issue time; `done` comes from the group's last completed
sequence number), and reduce-scatter is recorded as the all-reduce gloo runs for it.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import pickle
import signal
import threading
import time
from pathlib import Path

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import HookBus
from disttrace.store import collframes
from disttrace.store.documents import CollectiveLine, RingLost
from disttrace.store.rundir import rank_file

DEFAULT_CAPACITY = 2000  # torch's own default ring size; TORCH_FR_BUFFER_SIZE overrides it
CAPACITY_ENV = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
)  # torch reads them in this order

# Flight Recorder names ("gloo:all_reduce") -> the c10d op names the dispatch-mode tracer writes, so a trace
# reads the same whichever recorded it
OPS = {
    "all_reduce": "allreduce_",
    "allreduce": "allreduce_",
    "allreduce_coalesced": "allreduce_coalesced_",
    "broadcast": "broadcast_",
    "reduce": "reduce_",
    "all_gather": "allgather_",
    "allgather": "allgather_",
    "_allgather_base": "_allgather_base_",
    "allgather_coalesced": "allgather_coalesced_",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced_",
    "reduce_scatter": "reduce_scatter_",
    "_reduce_scatter_base": "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced_",
    "all_to_all": "alltoall_",
    "alltoall": "alltoall_",
    "alltoall_base": "alltoall_base_",
    "gather": "gather_",
    "scatter": "scatter_",
    "send": "send",
    "recv": "recv_",
    "recvAnySource": "recv_any_source_",
    "barrier": "barrier",
}
# ATen scalar type names as the recorder writes them -> (torch dtype name, bytes per element)
DTYPES = {
    "Float": ("float32", 4),
    "Double": ("float64", 8),
    "Half": ("float16", 2),
    "BFloat16": ("bfloat16", 2),
    "Long": ("int64", 8),
    "Int": ("int32", 4),
    "Short": ("int16", 2),
    "Char": ("int8", 1),
    "Byte": ("uint8", 1),
    "Bool": ("bool", 1),
    "ComplexFloat": ("complex64", 8),
    "ComplexDouble": ("complex128", 16),
    "Float8_e4m3fn": ("float8_e4m3fn", 1),
    "Float8_e5m2": ("float8_e5m2", 1),
    "UInt16": ("uint16", 2),
    "UInt32": ("uint32", 4),
    "UInt64": ("uint64", 8),
}


def capacity_from_env(env=os.environ) -> int:
    for name in CAPACITY_ENV:
        if env.get(name, "").strip():
            try:
                return int(env[name])
            except ValueError:
                break
    return DEFAULT_CAPACITY


def op_name(profiling_name: str) -> str:
    """'gloo:all_reduce' -> 'allreduce_'; 'nccl:send 0->1' -> 'send'; an unknown name keeps its own."""
    name = profiling_name.split(":", 1)[-1].split(" ", 1)[0]
    return OPS.get(name, name)


class Converter:
    """Turns successive Flight Recorder dumps into trace records, each entry once, in issue order. Keeps
    per-group sequence numbers like the tracer's: one counter per member-rank list."""

    def __init__(self):
        self.last_rid = -1
        self.seq: dict[str, int] = {}
        self.bounds: list[
            tuple[int, int]
        ] = []  # (step start ns, step): entries go to the step they follow

    def step_started(self, step: int, t_ns: int) -> None:
        self.bounds.append((t_ns, step))

    def step_of(self, t_ns: int) -> int:
        i = bisect.bisect_right(self.bounds, (t_ns, float("inf"))) - 1
        return (
            self.bounds[i][1] if i >= 0 else 0
        )  # before the first step: set-up (step 0, as the tracer)

    def records(self, dump: dict, groups: dict[str, str], settled_only: bool = False) -> list[dict]:
        """`groups`: process-group name -> comma-joined global ranks. `settled_only`: stop before the first
        collective not yet marked finished (the ring's state can trail the caller, who already has the
        result): it is copied by a later dump, so no finished collective is written as unfinished."""
        status = dump.get("pg_status") or {}
        entries = sorted(
            (e for e in dump.get("entries", []) if e["record_id"] > self.last_rid),
            key=lambda e: e["record_id"],
        )
        if settled_only:
            for i, e in enumerate(entries):
                if not _finished(e, status):
                    entries = entries[:i]
                    break
        out: list[dict] = []
        if (
            entries
            and entries[0]["record_id"] > self.last_rid + 1
            and (self.last_rid >= 0 or entries[0]["record_id"])
        ):
            lost = entries[0]["record_id"] - self.last_rid - 1
            line = RingLost(
                lost=lost,
                after_record=self.last_rid,
                step=self.step_of(entries[0]["time_created_ns"]),
            )
            out.append(line.line())
        for e in entries:
            pg = str(e["process_group"][0])
            group = groups.get(pg, "?")
            seq = self.seq.get(group, 0)
            self.seq[group] = seq + 1
            op = op_name(e["profiling_name"])
            # a scatter has inputs only on its source; every rank has an output of one shape (as the tracer)
            side = "output" if op == "scatter_" else "input"
            dtypes = [DTYPES.get(d, (d.lower(), 0)) for d in e.get(f"{side}_dtypes", [])]
            shapes = [list(s) for s in e.get(f"{side}_sizes", [])]
            nbytes = 0
            for shape, (_, size) in zip(shapes, dtypes):
                n = 1
                for d in shape:
                    n *= d
                nbytes += n * size
            fr_seq = e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"]
            completed = e.get("time_discovered_completed_ns")  # NCCL with timing enabled; not gloo
            rec = CollectiveLine(
                seq=seq,
                group=group,
                op=op,
                step=self.step_of(e["time_created_ns"]),
                shapes=shapes,
                dtype=dtypes[0][0] if dtypes else None,
                bytes=nbytes,
                start=e["time_created_ns"] / 1e9,
                pg=pg,
                fr_seq=fr_seq,
                done=_finished(e, status),
                **({"end": completed / 1e9} if completed else {}),
            )
            out.append(rec.line())
        if entries:
            self.last_rid = entries[-1]["record_id"]
        return out


def _group_names() -> dict[str, str]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            out[str(name)] = ",".join(map(str, dist.get_process_group_ranks(pg)))
        except Exception:  # a group this rank is not in, or one being destroyed
            continue
    return out


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


class FlightRecorderTrace:
    """Copies the Flight Recorder ring into the run store. Attach to the bus; `close()` copies the rest."""

    STEP_START, STEP_END = -999, 95  # first after the step clock; after the recorder at step end

    def __init__(self, run_dir: Path, rank: int, capacity: int | None = None):
        self.rank = rank
        self.path = Path(run_dir) / rank_file("collectives", rank, collframes.SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a raw append-only descriptor: a dump from a signal handler writes a whole frame with one os.write
        # and never lands in the middle of a half-flushed buffer
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.capacity = capacity_from_env() if capacity is None else capacity
        if (
            self.capacity <= 0 and rank == 0
        ):  # the user turned the recorder off: say why the trace is empty
            from disttrace.store.events import CollectiveTraceEmpty
            from disttrace.store.writers import event

            event(
                run_dir,
                CollectiveTraceEmpty(
                    reason="TORCH_FR_BUFFER_SIZE=0 turns torch's Flight Recorder "
                    'off; set record.collectives = "values" for a trace without it'
                ),
            )
        self.conv = Converter()
        self.step = 0  # the tracer's interface (the worker's context hands it to faults)
        self._issued_at_dump = 0
        self._issued_at_start = 0
        self._largest_step = 0
        self._counts_ok = True
        self._lock = threading.Lock()
        self._closed = False
        self._saved: dict[int, object] = {}
        self._callback = _HANDLER(self._on_signal)  # kept alive as long as the handler is installed
        self.dumps = 0

    # ---------------------------------------------------------------- the context manager the tracer is
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # ---------------------------------------------------------------- hooks
    def attach(self, bus: HookBus) -> FlightRecorderTrace:
        bus.on("step_start", self._step_start, self.STEP_START)
        bus.on("step_end", self._step_end, self.STEP_END)
        self._install_signal_handlers()
        return self

    def _issued(self) -> int:
        """Collectives issued so far over every process group of this process (their sequence numbers)."""
        if not self._counts_ok:
            return 0
        from torch.distributed import distributed_c10d as c10d

        total = 0
        try:
            for pg in list(c10d._world.pg_names):
                total += int(pg._get_sequence_number_for_group())
        except Exception:  # a backend without sequence numbers: dump every step instead
            self._counts_ok = False
            return 0
        return total

    def _step_start(self, bus, p):
        self.step = bus.step
        self.conv.step_started(bus.step, time.time_ns())
        self._issued_at_start = self._issued()

    def _step_end(self, bus, p):
        issued = self._issued()
        self._largest_step = max(self._largest_step, issued - self._issued_at_start)
        pending = issued - self._issued_at_dump
        if (
            not self._counts_ok
            or pending + 2 * self._largest_step >= self.capacity - self.capacity // 8
        ):
            self.dump(settled_only=True)  # mid-run: an unfinished tail waits for the next copy

    # ---------------------------------------------------------------- dumping
    def dump(self, settled_only: bool = False) -> int:
        """Copy the entries not yet copied (`settled_only`: up to the first unfinished one); returns how many
        records were written."""
        if self.capacity <= 0:
            return 0
        got = self._lock.acquire(
            timeout=1.0
        )  # a signal may arrive in the middle of a dump on this thread
        try:
            issued = self._issued()
            from torch._C._distributed_c10d import _dump_fr_trace

            dump = pickle.loads(
                _dump_fr_trace(True, False, False)
            )  # collectives, no stack traces, all states
            recs = self.conv.records(dump, _group_names(), settled_only)
            if recs:
                import orjson

                lines = b"".join(orjson.dumps(r) + b"\n" for r in recs)
                os.write(self.fd, collframes.encode(lines))
            self._issued_at_dump = issued
            self.dumps += 1
            return len(recs)
        finally:
            if got:
                self._lock.release()

    def _install_signal_handlers(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        install = libc["signal"]
        install.restype, install.argtypes = ctypes.c_void_p, [ctypes.c_int, _HANDLER]
        for sig in (signal.SIGTERM, signal.SIGABRT):
            self._saved[sig] = install(sig, self._callback)

    def _restore_signal_handlers(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        restore = libc["signal"]
        restore.restype, restore.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
        for sig, old in self._saved.items():
            restore(sig, old)
        self._saved.clear()

    def _on_signal(self, signum: int) -> None:
        """Runs in whichever thread got the signal (gloo's own for an abort). The process is dying: copy the
        ring, then die as the signal says. An alarm ends it if the dump hangs (a lock the dying thread held)."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.alarm(3)
        try:
            if not self._closed:
                self.dump()
        except BaseException:  # nothing may stop the process from dying as it should
            pass
        finally:
            self._restore_signal_handlers()
            reraise = libc["raise"]
            reraise.argtypes = [ctypes.c_int]
            reraise(
                signum
            )  # blocked until this handler returns, then the default action (SIGABRT: abort)

    def close(self, failed: bool = False) -> None:
        """Copy what is left (normal end, or an exception on the way out) and stop listening for signals."""
        if self._closed:
            return
        try:
            self.dump()
        finally:
            self._closed = True
            self._restore_signal_handlers()
            os.close(self.fd)


class NoTrace:
    """`record.collectives = "off"` or `record.enabled = false`: nothing written, nothing listened to."""

    step = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def attach(self, bus) -> NoTrace:
        return self

    def close(self, failed: bool = False) -> None:
        pass


def uses_point_to_point(manifest: Manifest) -> bool:
    par = manifest.parallelism
    return par.pp > 1 or par.architecture == "parameter-server"


def trace_mode(manifest: Manifest, backend: str) -> str:
    """metadata | values | dispatch (the tracer without payloads: point-to-point on gloo) | off."""
    mode = manifest.record.collectives if manifest.record.enabled else "off"
    if mode == "metadata" and backend == "gloo" and uses_point_to_point(manifest):
        return "dispatch"
    return mode


def prepare_env(mode: str) -> None:
    """Before init_process_group: the ring's size is read once, when the first process group is made."""
    if mode == "metadata" and not any(os.environ.get(n, "").strip() for n in CAPACITY_ENV):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(DEFAULT_CAPACITY)


def build_trace(mode: str, run_dir: Path, rank: int):
    if mode == "metadata":
        return FlightRecorderTrace(run_dir, rank)
    if mode in ("values", "dispatch"):
        from disttrace.run.record.collectives import CollectiveTracer

        return CollectiveTracer(run_dir, rank, values=mode == "values")
    return NoTrace()


def _finished(e: dict, status: dict) -> bool:
    """A ring entry's collective has finished: its own state says so, or its group's last completed
    collective is at or past it (gloo leaves entries' states behind)."""
    if e.get("state") == "completed":
        return True
    last_done = (status.get(str(e.get("pg_id"))) or {}).get("last_completed_collective", -1)
    fr_seq = e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"]
    return not e.get("is_p2p") and int(last_done) >= fr_seq
