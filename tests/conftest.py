"""Shared fixtures. Multi-process runs are slow to start (torch import per rank), so each distinct run is
made once per session and shared; tests only read the run store."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the gate's evaluation cache (disttrace/gate/evalcache.py): one per test session, not the user's, made
# only when none is given and removed with the session, so test runs leave nothing behind in the temp dir
if "DISTTRACE_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.TemporaryDirectory(prefix="disttrace-test-cache-")
    os.environ["DISTTRACE_CACHE_DIR"] = _CACHE.name
DEFAULT = ROOT / "manifests" / "default.toml"
# four steps, checkpoints at 2 and 4: enough for a fault at 3 and a recovery from 2
SHORT = ["--set", "training.steps=4", "--set", "checkpoint.interval=2"]
# Flight Recorder entries: fewer than a SHORT run with 0.1 MB buckets issues (44), more than its first two
# steps with set-up (24)
SMALL_RING = 32


def cli(*args, timeout=180, env=None, check=None) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        cwd=ROOT,
    )
    if check is not None and proc.returncode != check:
        raise AssertionError(
            f"exit {proc.returncode} != {check}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def last_line(proc) -> Path:
    return Path(proc.stdout.strip().splitlines()[-1])


class Runs:
    """Session cache: one run per distinct command line (and environment)."""

    def __init__(self, root: Path, done: Path):
        self.root = root
        self.done = done  # each finished command's exit code and output, outside the runs root
        self._cache: dict[tuple, subprocess.CompletedProcess] = {}

    def job(self, *args, expect=0, env=None, timeout=180) -> subprocess.CompletedProcess:
        """The finished command (its stdout and stderr too), run once per session; `timeout` is the first
        caller's. Asserts its exit code is `expect` (None: any)."""
        key = (tuple(map(str, args)), tuple(sorted((env or {}).items())))
        if key not in self._cache:
            self._cache[key] = self._once(key, args, env, timeout)
        proc = self._cache[key]
        if expect is not None and proc.returncode != expect:
            raise AssertionError(
                f"exit {proc.returncode} != {expect}\nstdout:\n{proc.stdout}\n"
                f"stderr:\n{proc.stderr[-4000:]}"
            )
        return proc

    def _once(self, key, args, env, timeout) -> subprocess.CompletedProcess:
        """Under pytest-xdist the workers share one runs root: the first to ask runs the command while the
        others wait on its lock, then read what it left, so no run is made twice in a session."""
        self.done.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        with open(self.done / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            stored = self.done / f"{name}.json"
            if stored.exists():
                p = json.loads(stored.read_text())
                return subprocess.CompletedProcess(
                    p["args"], p["returncode"], p["stdout"], p["stderr"]
                )
            proc = cli(*args, "--out", self.root, env=env, timeout=timeout)
            p = {k: getattr(proc, k) for k in ("returncode", "stdout", "stderr")}
            stored.write_text(json.dumps({"args": list(map(str, proc.args)), **p}))
            return proc

    def get(self, *args, expect=0, env=None) -> Path:
        return last_line(self.job(*args, expect=expect, env=env))

    def reference(self, *sets, env=None) -> Path:
        return self.get("run", DEFAULT, *SHORT, *sets, env=env)

    def fault(self, name, step, rank, *extra, expect=0) -> Path:
        return self.get(
            "inject",
            DEFAULT,
            *SHORT,
            "--fault",
            name,
            "--step",
            step,
            "--rank",
            rank,
            *extra,
            expect=expect,
        )

    def small_ring(self) -> Path:
        """DDP in several buckets (0.1 MB cap) and a Flight Recorder ring of 32 entries, fewer than the run
        issues: read by test_flight_recorder.py and test_evidence.py, and a foreign checkpoint in test_faults.py."""
        return self.reference(
            "--set", "debug.ddp_bucket_cap_mb=0.1", env={"TORCH_FR_BUFFER_SIZE": str(SMALL_RING)}
        )

    def collective_mismatch(self) -> subprocess.CompletedProcess:
        """Rank 1 issues an all-reduce of another size at step 2: gloo aborts it, the job ends with exit 3
        (read by test_faults.py and test_flight_recorder.py). The 10 s collective timeout bounds a hang."""
        return self.job(
            "inject",
            DEFAULT,
            *SHORT,
            "--set",
            "debug.collective_timeout_s=10",
            "--fault",
            "collective-mismatch",
            "--step",
            2,
            "--rank",
            1,
            expect=3,
            timeout=10 + 110,
        )


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base temps share this parent
        shared = tmp_path_factory.getbasetemp().parent
        return Runs(shared / "runs", shared / "runs-done")
    return Runs(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("runs-done"))


@dataclass
class Watched:
    run_dir: Path
    writer: subprocess.CompletedProcess  # `disttrace run ... --quiet --json`
    watch: (
        subprocess.CompletedProcess
    )  # `disttrace watch RUN_DIR`, started once the run directory existed


@pytest.fixture(scope="session")
def watched(tmp_path_factory) -> Watched:
    """A second reference run (runs.reference()'s command line, with --quiet --json), written by one process
    while `disttrace watch` follows it from another: test_progress.py reads what watch printed, and
    test_foundation.py holds its trajectory bit-identical to the session's reference."""
    out = tmp_path_factory.mktemp("watched")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    args = ["run", DEFAULT, *SHORT, "--out", out, "--quiet", "--json"]
    writer = subprocess.Popen(
        [sys.executable, "-m", "disttrace", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        end = (
            time.monotonic() + 120
        )  # a bound on a writer that never makes its directory, not a timing assert
        while not (found := sorted(out.glob("*/*/run.json"))):
            assert writer.poll() is None and time.monotonic() < end, writer.communicate()
            time.sleep(0.1)
        run_dir = found[0].parent
        watch = cli(
            "watch", run_dir, env={"DISTTRACE_PROGRESS_EVERY": "0"}, timeout=300
        )  # a line per step
        stdout, stderr = writer.communicate(timeout=300)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    return Watched(
        run_dir, subprocess.CompletedProcess(args, writer.returncode, stdout, stderr), watch
    )


# ---------------------------------------------------------------- the trajectory, read without disttrace
# An oracle for tests: each rank's Arrow stream read by pyarrow's own stream reader (not disttrace's
# per-step decoder) and put in the recorder's record shape.


def traj_file(run: Path, rank: int) -> Path:
    return Path(run) / "trajectory" / f"rank-{rank:05d}.arrows"


def raw_records(run: Path, rank: int) -> list[dict]:
    import pyarrow.ipc as ipc

    out = []
    for r in ipc.open_stream(traj_file(run, rank).read_bytes()).read_all().to_pylist():
        rec = {
            k: r[k]
            for k in ("step", "micro_batch", "phase", "rank", "index", "tensor", "dtype", "shape")
        }
        rec["numel"] = (
            r["numel"] if "numel" in r else math.prod(r["shape"])
        )  # v2 stores none: the shape's product
        rec.update({k: r[k] for k in ("sum", "norm", "nonfinite")})
        rec["digest"] = ("dev:" if r["device_digest"] else "") + r["digest"].hex()
        if r["sketch"] is not None or r["sketch64"] is not None:
            rec["sketch"] = r["sketch"] if r["sketch"] is not None else r["sketch64"]
        for k in ("samples", "tokens"):
            if r[k] is not None:
                rec[k] = r[k]
        if r.get("shard_offset") is not None:
            rec["shard"] = {"offset": r["shard_offset"], "logical_shape": r["shard_shape"]}
        elif r.get("shard") is not None:  # v2: the offset, then the logical shape, in one list
            k = len(r["shard"]) // 2
            rec["shard"] = {"offset": r["shard"][:k], "logical_shape": r["shard"][k:]}
        out.append(rec)
    return out


def tear_trajectory(run: Path, rank: int) -> None:
    """Append half of a record batch, as a crash in the middle of a step's write leaves it."""
    import orjson

    last = orjson.loads(
        (Path(run) / "trajectory" / f"rank-{rank:05d}.steps.jsonl").read_bytes().splitlines()[-1]
    )
    path = traj_file(run, rank)
    data = path.read_bytes()
    step = data[last["offset"] : last["offset"] + last["length"]]
    path.write_bytes(data[: last["offset"] + last["length"]] + step[: len(step) // 2])


def rewrite_trajectory(run: Path, rank: int, records: list[dict]) -> None:
    """What another writer of a run store could put there: these records as the rank's Arrow stream, one batch
    per step, and no step index (readers then rebuild one from the stream)."""
    from disttrace.store.trajectory_write import TrajectoryWriter

    path = traj_file(run, rank)
    path.unlink()
    (Path(run) / "trajectory" / f"rank-{rank:05d}.steps.jsonl").unlink(missing_ok=True)
    w = TrajectoryWriter(path)
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    for step in by_step:
        w.write_step(by_step[step])
    w.close()


def run_snippet(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """A user's few lines of Python (e.g. a script that attaches), in a fresh interpreter, one thread."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# End-to-end cases that repeat what a cheaper case in the CI tier already shows (another layout, another
# fault of the same family, a second CLI path): they run in the slow tier, so `make test` stays well under
# 15 minutes on 2 cores. Matched against each test's node id, parameters included.
SLOW_TIER = (
    "test_sensitivity.py::test_the_sensitivity_is_in_the_json_and_the_summary",
    "test_sensitivity.py::test_a_change_below_the_sensitivity_is_equal_and_one_above_it_is_found",
    "test_sensitivity.py::test_the_gate_requires_a_sensitivity",
    "test_sensitivity.py::test_a_calibration_per_tensor_class_gives_each_class_its_figure",
    "test_devdigest.py::test_a_run_on_the_batched_device_path_repeats_bit_for_bit_and_finds_a_fault",
    "test_devdigest.py::test_an_attached_script_that_raises_keeps_its_last_finished_step",
    "test_strategies.py::test_strategy_matches_ddp_numerically_and_is_consistent[dp2xpp2]",
    "test_strategies.py::test_sharded_checkpoint_resumes_bit_identically[dp2xpp2]",
    "test_strategies.py::test_bitflip_param_is_located_under_every_sharding[zero3]",
    "test_strategies.py::test_sharded_checkpoint_resumes_bit_identically[zero3]",
    "test_oracles.py::test_check_names_exactly_the_planted_rank_among_four_replicas",
    "test_gate_lab.py::test_gate_fails_a_checkpoint_saved_without_optimizer_state",
    "test_gate_lab.py::test_straggler_passes_on_numerics_and_is_flagged",
    "test_progress.py::test_inject_plain_progress_names_the_slow_rank_before_the_job_ends",
    "test_progress.py::test_watch_a_failing_run_exits_3_and_a_non_run_exits_2",
    "test_record_section.py::test_unrecorded_run_keeps_step_times_and_nothing_else",
    "test_faults.py::test_slow_rank_keeps_numerics_and_is_flagged",
    "test_faults.py::test_fault_is_located_at_its_coordinates[data-swap]",
    "test_faults.py::test_fault_is_located_at_its_coordinates[late-microbatch]",
    "test_fault_proof.py::test_bitflip_grad_logs_the_element_it_flipped_when_the_index_wraps",
    "test_fault_proof.py::test_parameter_server_faults_change_what_the_workers_receive",
    "test_failure_events.py::test_a_job_started_again_in_its_run_directory_is_refused",
    "test_manifest_typed.py::test_a_ddp_attached_run_writes_a_manifest_of_the_attached_shape",
    "test_sketch.py::test_zero3_shards_compare_with_dp1_through_their_sketches",
    "test_replay.py::test_skip_allreduce_is_persistent",
    "test_zoom.py::test_zoom_names_the_module_a_forward_corruption_was_planted_in",
    "test_attach_magnitudes.py::test_a_cancelling_attached_pair_gets_the_sound_bound",
    "test_faults.py::test_fault_is_located_at_its_coordinates[bitflip-param]",
    "test_attach_cli.py::test_a_fault_needing_a_point_the_script_lacks_is_refused",
    "test_strategies.py::test_strategy_matches_ddp_numerically_and_is_consistent[tp2]",
    "test_gate_lab.py::test_gate_fails_a_corrupt_checkpoint_naming_the_file",
    "test_faults.py::test_collective_mismatch_names_rank_sequence_and_shapes",
    "test_attach_exit.py::test_the_seal_gather_leaves_no_tensor_to_the_backend_thread",
    "test_experiment_identity.py::test_an_attached_pair_of_different_global_batches_is_refused",
    "test_attach_loader.py::test_a_second_forward_of_one_batch_does_not_take_the_next_batchs_ids",
    "test_faults.py::test_check_finds_replica_faults_without_a_reference[late-microbatch]",
    "test_faults.py::test_check_finds_replica_faults_without_a_reference[data-swap]",
    "test_architecture.py::test_readers_run_with_torch_unimportable",
    "test_strategies.py::test_fault_on_a_tensor_parallel_shard_names_rank_and_logical_tensor",
    "test_forged_store.py::test_the_evaluation_reads_the_reference_data_never_the_candidate_path",
    "test_faults.py::test_corrupt_checkpoint_is_reported_and_refused",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.endswith(s) or s + "[" in item.nodeid for s in SLOW_TIER):
            item.add_marker(pytest.mark.slow)
