"""A run store forged by its writer and resealed with disttrace's own code: no false EQUAL, no false PASS.

Every construction here is what a hostile candidate could hand the gate: each hash, step chain and seal is
recomputed with `disttrace.store.seal` itself, so `verify` calls the store intact (asserted: the forgery is
self-consistent). What must still show is what the gate can recompute: the bytes compared across the two
runs, the steps covered, the checkpoint evaluated against the trajectory judged, the tolerance of the
reference, the reference's data, and (slow tier) the steps re-executed by `gate --replay`. The oracles are
the planted fault's coordinates, the reference run itself and the file the forgery planted."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli

from disttrace.store import seal

FAULT = ("bitflip-grad", 3, 1)  # a fault at step 3 on rank 1, after the checkpoint of step 2


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


@pytest.fixture(scope="module")
def fault(runs) -> Path:
    return runs.fault(*FAULT)


def copy_run(run: Path, root: Path) -> Path:
    dst = root / run.parent.name / run.name
    shutil.copytree(run, dst, symlinks=True)
    return dst


def reseal(run: Path) -> None:
    """Rehash every step, rechain every index and rebuild COMPLETE's seal with disttrace's own code: what
    any writer of a store can do, so no hash in it is evidence against that writer."""
    parts = []
    for idx in sorted((run / "trajectory").glob("rank-*.steps.jsonl")):
        rank = int(idx.name[5:10])
        data = idx.with_name(f"rank-{rank:05d}.arrows").read_bytes()
        chain = seal.StepChain(rank)
        lines = []
        for raw in idx.read_bytes().splitlines():
            e = {k: v for k, v in orjson.loads(raw).items() if k not in ("sha256", "xxh3", "chain")}
            lines.append(
                orjson.dumps(chain.seal_entry(e, data[e["offset"] : e["offset"] + e["length"]]))
            )
        idx.write_bytes(b"\n".join(lines) + b"\n")
        parts.append(seal.rank_part(run, rank, chain.last, chain.steps))
    done = orjson.loads((run / "COMPLETE").read_bytes())
    done["seal"] = seal.build_seal(run, parts).doc()
    (run / "COMPLETE").write_bytes(orjson.dumps(done))


def index_lines(run: Path, rank: int) -> list[dict]:
    p = run / "trajectory" / f"rank-{rank:05d}.steps.jsonl"
    return [orjson.loads(x) for x in p.read_bytes().splitlines()]


def edit_lock(run: Path, fn) -> None:
    lock = orjson.loads((run / "manifest.lock.json").read_bytes())
    fn(lock)
    (run / "manifest.lock.json").write_bytes(orjson.dumps(lock))


def assert_intact(run: Path) -> None:
    proc = cli("verify", run, timeout=120)
    assert proc.returncode == 0, proc.stderr  # the forgery is self-consistent: verify cannot tell


def gate(run: Path, *args, timeout=300) -> tuple[int, dict]:
    proc = cli("gate", run, *args, "--json", timeout=timeout)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, orjson.loads(proc.stdout)


def by_name(verdict: dict) -> dict:
    return {c["name"]: c for c in verdict["checks"]}


def forged_digests(fault: Path, ref: Path, root: Path) -> Path:
    """The fault run with every step index line's digest of digests (and record count) set to the
    reference's: the records still hold the fault."""
    run = copy_run(fault, root)
    for rank in (0, 1):
        lines = index_lines(run, rank)
        for e, r in zip(lines, index_lines(ref, rank)):
            e["digest"], e["records"] = r["digest"], r["records"]
        p = run / "trajectory" / f"rank-{rank:05d}.steps.jsonl"
        p.write_bytes(b"\n".join(orjson.dumps(e) for e in lines) + b"\n")
    reseal(run)
    return run


def copied_trajectory(fault: Path, ref: Path, root: Path) -> Path:
    """The fault run's store holding the reference's trajectory (its own checkpoints kept), resealed."""
    run = copy_run(fault, root)
    shutil.rmtree(run / "trajectory")
    shutil.copytree(ref / "trajectory", run / "trajectory")
    reseal(run)
    return run


def test_a_forged_index_digest_does_not_skip_a_step_that_holds_the_fault(ref, fault, tmp_path):
    run = forged_digests(fault, ref, tmp_path)
    assert_intact(run)
    proc = cli("diff", ref, run, "--json")
    assert proc.returncode == 1, proc.stdout[-2000:]
    first = orjson.loads(proc.stdout)["first_divergence"]
    assert (first["step"], first["rank"]) == (FAULT[1], FAULT[2])  # where the fault was planted
    # the control: a byte-identical copy of the reference is still skipped step by step, unread
    same = orjson.loads(cli("diff", ref, copy_run(ref, tmp_path / "same"), "--json").stdout)
    assert same["equal"] and same["stats"]["steps_read"] == 0
    assert same["stats"]["steps_hash_checked"] == 2 * 2 * 4  # both sides, 2 ranks, 4 steps


def test_the_reference_trajectory_copied_into_a_fault_store_fails_the_gate(ref, fault, tmp_path):
    run = copied_trajectory(fault, ref, tmp_path)
    assert_intact(run)
    assert cli("diff", ref, run).returncode == 0  # the trajectory is the reference's, byte for byte
    code, verdict = gate(run, "--reference", ref)
    c = by_name(verdict)
    assert code == 1 and not verdict["pass"]
    assert c["eval_metric"]["passed"] is False and verdict["eval"] is None  # nothing was scored
    # the checkpoint of step 4 is the fault's own, not the one the copied trajectory records
    assert "step-000004/__" in c["eval_metric"]["reason"]
    assert "not the ones the trajectory" in c["eval_metric"]["reason"]


def test_a_trajectory_cut_to_its_first_step_fails_the_gate(ref, tmp_path):
    run = copy_run(ref, tmp_path)
    for rank in (0, 1):
        first = index_lines(run, rank)[0]
        (run / "trajectory" / f"rank-{rank:05d}.steps.jsonl").write_bytes(
            orjson.dumps(first) + b"\n"
        )
        traj = run / "trajectory" / f"rank-{rank:05d}.arrows"
        traj.write_bytes(traj.read_bytes()[: first["offset"] + first["length"]])
    reseal(run)
    assert_intact(run)
    diff = orjson.loads(cli("diff", ref, run, "--json").stdout)
    assert diff["equal"] and diff["compared_steps"]["count"] == 1  # diff alone: EQUAL over 1..1
    code, verdict = gate(run, "--reference", ref)
    reason = by_name(verdict)["gradient_equivalence"]["reason"]
    assert code == 1 and by_name(verdict)["gradient_equivalence"]["passed"] is False
    assert "step(s) 2..4 of the reference's 4 were not compared" in reason, reason


def claimed(ref: Path, root: Path, **training) -> Path:
    """The reference's own store whose lock states another layout (micro-batch 8 x 1 instead of 4 x 2: the
    same global batch) and the given training fields, resealed. Its records show the reference's layout, so
    diff compares the two bit for bit unless asked for the numeric mode (analysis/diff/layout.py)."""

    def edit(lock):
        lock["manifest"]["training"].update(micro_batch_size=8, grad_accum_steps=1, **training)

    run = copy_run(ref, root)
    edit_lock(run, edit)
    reseal(run)
    return run


def test_a_candidate_claiming_bfloat16_cannot_loosen_its_bound(ref, tmp_path):
    from disttrace.gate.verdict import gradient_equivalence
    from disttrace.store.rundir import Run

    loose = claimed(ref, tmp_path / "bf16", compute_dtype="bfloat16")
    diff = orjson.loads(cli("diff", ref, loose, "--json", "--mode", "numeric").stdout)
    # diff does not take its word: its records are float32, and the claim is named
    assert diff["mode"] == "numeric" and diff["tolerance"]["u"] == 2.0**-24
    (said,) = [w for w in diff["warnings"] if "contradict" in w]
    assert said.startswith("B's manifest states training.compute_dtype = 'bfloat16'"), said
    assert "micro-batch 8 x accumulation 1" in said and "float32 at most" in said, said
    c = gradient_equivalence(Run(loose), Run(ref))
    assert c.passed is False, c
    assert "training.compute_dtype = 'bfloat16'" in c.reason and "not trusted" in c.reason
    # the control: the same layout claim without a coarser precision is judged, and equal
    honest = claimed(ref, tmp_path / "fp32", compute_dtype="float32")
    c = gradient_equivalence(Run(honest), Run(ref))
    # its records show the reference's layout: held to it bit for bit, and equal (they are its bytes)
    assert c.passed is True and c.reason.startswith("bitwise equal over steps 1..4"), c


@pytest.mark.slow
def test_the_gate_fails_a_resealed_bfloat16_claim(ref, tmp_path):
    loose = claimed(ref, tmp_path, compute_dtype="bfloat16")
    assert_intact(loose)
    code, verdict = gate(loose, "--reference", ref)
    assert code == 1 and by_name(verdict)["gradient_equivalence"]["passed"] is False


def planted_data(ref: Path, root: Path) -> tuple[Path, Path]:
    """The reference's store whose lock names another corpus (every other document of the real one: another
    held-out split, were it read), resealed."""
    corpus = Path(orjson.loads((ref / "manifest.lock.json").read_bytes())["resolved"]["data_path"])
    planted = root / "planted.jsonl"
    planted.write_bytes(b"".join(corpus.read_bytes().splitlines(keepends=True)[::2]))
    run = copy_run(ref, root / "store")
    edit_lock(run, lambda lock: lock["resolved"].update(data_path=str(planted)))
    reseal(run)
    return run, planted


def test_the_evaluation_reads_the_reference_data_never_the_candidate_path(ref, tmp_path):
    run, planted = planted_data(ref, tmp_path)
    code, verdict = gate(run, "--reference", ref)
    assert verdict["eval"]["data_from"] == str(ref)
    assert verdict["eval"]["split"] == verdict["reference_eval"]["split"]
    assert by_name(verdict)["eval_metric"]["passed"] is True


@pytest.mark.slow
def test_without_a_reference_the_run_data_is_checked_against_its_own_manifest(ref, tmp_path):
    run, planted = planted_data(ref, tmp_path)
    code, verdict = gate(run)
    c = by_name(verdict)["eval_metric"]
    assert code == 1 and c["passed"] is False
    assert str(planted) in c["reason"] and "sha256" in c["reason"], c


def test_a_planted_temporary_link_does_not_make_the_gate_write_outside(ref, tmp_path):
    """The gate writes verdict.json (and eval.json) through a temporary name; a store may plant the names
    it would pick (`.NAME.tmp-<pid>`, pid: this process, the gate run in it, and the next ones) as links
    to a file elsewhere."""
    import os

    from disttrace.gate.verdict import gate as run_gate

    run = copy_run(ref, tmp_path / "store")
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    for pid in range(os.getpid(), os.getpid() + 1000):
        for name in ("verdict.json", "eval.json"):
            (run / f".{name}.tmp-{pid}").symlink_to(victim)
    (run / "verdict.json").unlink(missing_ok=True)
    verdict = run_gate(run, ref).line()
    # verify sees the planted links as damage; what matters here is where the gate wrote
    assert not verdict["pass"] and ".tmp-" in by_name(verdict)["store_integrity"]["reason"]
    assert victim.read_text() == "untouched\n"
    assert (run / "verdict.json").is_file() and not (run / "verdict.json").is_symlink()
    assert orjson.loads((run / "verdict.json").read_bytes())["checks"] == verdict["checks"]
    leftovers = {p.name for p in run.iterdir() if ".tmp-" in p.name and not p.is_symlink()}
    assert not leftovers, leftovers


@pytest.mark.parametrize("kind", ["directory", "fifo", "link"])
def test_trace_replaces_only_a_regular_file_and_leaves_no_temporary(ref, tmp_path, kind):
    import os
    import stat

    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    target = tmp_path / "out" / "trace.json"
    target.parent.mkdir()
    {
        "directory": target.mkdir,
        "fifo": lambda: os.mkfifo(target),
        "link": lambda: target.symlink_to(victim),
    }[kind]()
    before = os.lstat(target).st_mode
    proc = cli("trace", ref, "-o", target, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert str(target) in line and "not a regular file" in line, line
    assert stat.S_IFMT(os.lstat(target).st_mode) == stat.S_IFMT(before)  # left as it was
    assert victim.read_text() == "untouched\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["trace.json"]  # no .trace.json.tmp-*
    # and a regular file (or none) is written as before
    target2 = tmp_path / "out" / "ok.json"
    assert cli("trace", ref, "-o", target2, timeout=60).returncode == 0
    assert orjson.loads(target2.read_bytes())["traceEvents"]


# ---------------------------------------------------------------- re-execution (slow: a job each)


@pytest.mark.slow
def test_the_forged_fault_store_fails_gate_replay(ref, fault, tmp_path):
    run = copied_trajectory(fault, ref, tmp_path)
    code, verdict = gate(run, "--reference", ref, "--replay", "2", timeout=900)
    c = by_name(verdict)["replay"]
    assert code == 1 and c["passed"] is False, c
    assert verdict["replay"]["steps"] == [3, 4] and isinstance(verdict["replay"]["seed"], int)
    # re-executed from the clean checkpoint of step 2, the run does not save its stored checkpoint 4
    assert "step 4 re-executed from the run's checkpoint step-000002" in c["reason"], c
    assert any("re-executed" in x for x in verdict["trust"]["recomputed"])


@pytest.mark.slow
def test_gate_replay_reproduces_an_honest_run_bit_for_bit(ref, tmp_path):
    run = copy_run(ref, tmp_path)
    code, verdict = gate(
        run, "--reference", ref, "--replay", "1", "--replay-seed", "5", timeout=900
    )
    c = by_name(verdict)["replay"]
    assert code == 0 and c["passed"] is True, c
    import random

    assert verdict["replay"]["seed"] == 5
    assert verdict["replay"]["steps"] == sorted(
        random.Random(5).sample([3, 4], 1)
    )  # the seed's draw
    assert verdict["trust"]["on_trust"][0].startswith("that the stored records are what")


def test_replay_option_is_validated():
    proc = cli("gate", ROOT / "nowhere", "--replay", "-1")
    assert proc.returncode == 2 and "--replay" in proc.stderr


def test_a_claim_does_not_widen_diffs_bound(runs, ref, tmp_path):
    """A run trained with 1.2x the learning rate whose lock claims the reference's learning rate, bfloat16
    and micro-batch 8 x accumulation 1 (the same global batch: another layout, so a numeric diff) is held
    to what both stores' records show (float32; 2 micro-batches of 4 a rank): divergent, the claim named;
    believed, it widened the bound 2^16 x and the pair was equal (exit 0). Control: the honest run with the
    same claims is still equal."""
    fast = runs.reference("--set", "training.lr=0.0036")

    def forge(run: Path, root: Path) -> Path:
        copy = copy_run(run, root)
        edit_lock(
            copy,
            lambda lock: lock["manifest"]["training"].update(
                lr=0.003, compute_dtype="bfloat16", micro_batch_size=8, grad_accum_steps=1
            ),
        )
        reseal(copy)
        return copy

    liar = forge(fast, tmp_path / "liar")
    proc = cli("diff", ref, liar, "--json", "--mode", "numeric")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 1 and doc["equal"] is False, doc["first_divergence"]
    assert doc["tolerance"]["u"] == 2.0**-24 and doc["tolerance"]["T"] == 16 * 64
    (said,) = [w for w in doc["warnings"] if "contradict" in w]
    assert "training.compute_dtype = 'bfloat16'" in said and "float32 at most" in said, said
    assert "micro-batch 8 x accumulation 1" in said and "2 micro-batch(es) of 4" in said, said
    honest = forge(ref, tmp_path / "honest")
    proc = cli("diff", ref, honest, "--json", "--mode", "numeric")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 0 and doc["equal"] is True, doc["first_divergence"]
    assert any("contradict" in w for w in doc["warnings"])


def test_a_claimed_layout_does_not_choose_the_numeric_mode(runs, ref, tmp_path):
    """A run with one low mantissa bit of a gradient flipped (bit 10: below the numeric bound's noise floor,
    docs/tolerance.md section 5) whose lock claims another layout (ZeRO-1; the records are DDP's, the
    reference's layout): believed, diff compared numerically and called the pair EQUAL. The records show
    one layout, so diff compares bit for bit, says why, and names the flip at its coordinates (the oracle:
    the fault's own step, rank and phase). Control: a pair whose records show two layouts (the reference
    and a real ZeRO-1 run) is still compared numerically, and equal."""
    flipped = runs.fault("bitflip-grad", 3, 1, "--param", "bit=10")
    run = copy_run(flipped, tmp_path / "claim")
    edit_lock(run, lambda lock: lock["manifest"]["parallelism"].update(zero_stage=1))
    reseal(run)
    assert_intact(run)
    proc = cli("diff", ref, run, "--json")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 1 and doc["mode"] == "bitwise"
    f = doc["first_divergence"]
    assert (f["step"], f["rank"], f["phase"]) == (3, 1, "backward"), f
    (said,) = [w for w in doc["warnings"] if "records show the same one" in w]
    assert "parallelism.zero_stage 0 vs 1" in said and "--mode numeric" in said, said
    numeric = orjson.loads(cli("diff", ref, run, "--json", "--mode", "numeric").stdout)
    assert numeric["equal"] is True  # what the claim bought: the flip is below the numeric bound
    zero1 = runs.reference("--set", "parallelism.zero_stage=1")
    proc = cli("diff", ref, zero1, "--json")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 0 and doc["mode"] == "numeric", doc["first_divergence"]
    assert not [w for w in doc["warnings"] if "records show the same one" in w]
