"""Every strategy runs on its real engine, computes the same training as DDP within the derived bound
(diff in numeric mode, aligned by logical tensor: shards are combined), passes `check`, holds the
model-state bytes the ZeRO formulas predict, and resumes bit-identically from its sharded checkpoint."""

from __future__ import annotations

import orjson
import pytest
from conftest import cli

from disttrace.analysis.diff import diff_runs
from disttrace.store.jsonlines import iter_jsonl
from disttrace.store.records import clip_param_index
from disttrace.store.rundir import Run

STRATEGIES = {
    "zero1": ["--set", "parallelism.zero_stage=1"],
    "zero2": ["--set", "parallelism.zero_stage=2"],
    "zero3": ["--set", "parallelism.zero_stage=3"],
    "tp2": [
        "--set",
        "parallelism.dp=1",
        "--set",
        "parallelism.tp=2",
        "--set",
        "training.grad_accum_steps=4",
    ],
    "pp2-gpipe": [
        "--set",
        "parallelism.dp=1",
        "--set",
        "parallelism.pp=2",
        "--set",
        "training.grad_accum_steps=4",
    ],
    "pp2-1f1b": [
        "--set",
        "parallelism.dp=1",
        "--set",
        "parallelism.pp=2",
        "--set",
        'parallelism.pp_schedule="1f1b"',
        "--set",
        "training.grad_accum_steps=4",
    ],
    # hybrid, four ranks: FSDP2 over dp composed with TP, and with pipeline stages
    "dp2xtp2": ["--set", "parallelism.tp=2"],
    "dp2xpp2": ["--set", "parallelism.pp=2"],
}


# CI's tier: ZeRO-1 and -3 and a 1F1B pipeline; ZeRO-2, GPipe and dp x tp here, TP and dp x pp in tests/conftest.py's
# SLOW_TIER, run by `make test-all`
SLOW_IN_CI = {"zero2", "pp2-gpipe", "dp2xtp2"}


def _tier(names):
    return [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_IN_CI else []) for n in names]


@pytest.mark.parametrize("name", _tier(STRATEGIES))
def test_strategy_matches_ddp_numerically_and_is_consistent(runs, name):
    ddp = runs.reference()
    other = runs.reference(*STRATEGIES[name])
    assert Run(other).complete
    d = diff_runs(ddp, other)
    assert d.mode == "numeric"
    assert d.equal, d.first_divergence
    assert {"reduce", "optimizer"} <= set(d.compared_phases) and d.stats.tensors_compared > 100
    # sharded records were really combined: the strategy stored shards, not full tensors
    recs = [r for r in Run(other).records(0) if r["step"] == 1 and r["phase"] == "optimizer"]
    if name in ("zero2", "zero3", "tp2", "dp2xtp2", "dp2xpp2"):
        assert any("shard" in r for r in recs)
    check = cli("check", other, "--json")
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize("name,stage_total", [("zero1", "1"), ("zero3", "3")])
def test_memory_ledger_matches_the_zero_formula(runs, name, stage_total):
    run = Run(runs.reference(*STRATEGIES[name]))
    rows = list(iter_jsonl(run.rank_path("memory", 0)))
    last = rows[-1]
    plan = orjson.loads(
        cli("plan", "manifests/default.toml", *STRATEGIES[name], "--json", check=0).stdout
    )
    assert last["predicted"]["total"] == plan["model_state_bytes_per_device"][stage_total]
    # measured / predicted: the only gap is Adam's scalar step counters (4 bytes per parameter tensor)
    assert 0.98 <= last["ratio_model_state"] <= 1.02, last
    baseline = list(iter_jsonl(Run(runs.reference()).rank_path("memory", 0)))[-1]
    assert last["model_state"] < baseline["model_state"]


def test_fault_on_a_tensor_parallel_shard_names_rank_and_logical_tensor(runs):
    tp = STRATEGIES["tp2"]
    ref = runs.reference(*tp)
    fault = runs.fault(
        "bitflip-grad", 3, 1, *tp, "--param", "tensor=layers.1.feed_forward.w1.weight"
    )
    f = diff_runs(ref, fault).first_divergence
    assert (f.step, f.phase, f.rank, f.tensor) == (
        3,
        "backward",
        1,
        "layers.1.feed_forward.w1.weight",
    )


@pytest.mark.slow  # ZeroStage1 is DataParallel's DDP and comm hook (run/parallel/zero.py); CI: test_faults.py's
# test_fault_is_located_at_its_coordinates[skip-allreduce] locates the same hook's fault under DDP
def test_skip_allreduce_under_zero1_is_located(runs):
    z1 = STRATEGIES["zero1"]
    f = diff_runs(runs.reference(*z1), runs.fault("skip-allreduce", 3, 0, *z1)).first_divergence
    assert (f.step, f.phase, f.rank) == (3, "reduce", 0)


def test_faults_without_their_hook_point_are_refused(tmp_path):
    proc = cli(
        "inject",
        "manifests/default.toml",
        *STRATEGIES["zero3"],
        "--fault",
        "skip-allreduce",
        "--step",
        2,
        "--rank",
        0,
        "--out",
        tmp_path,
    )
    assert proc.returncode == 2 and "collective_hook" in proc.stderr and "FSDP2" in proc.stderr


# dp2xpp2: each rank of a stage holds its own FSDP2 shard of the stage's optimizer state (its resume
# diverged at the optimizer phase while the stage's ranks shared one checkpoint key)
@pytest.mark.parametrize(
    "name", [pytest.param("zero1", marks=pytest.mark.slow), "zero3", "dp2xpp2"]
)
def test_sharded_checkpoint_resumes_bit_identically(runs, name):
    ref = runs.reference(*STRATEGIES[name])
    rec = runs.get("recover", ref, "--from-step", 2)
    d = diff_runs(ref, rec)
    assert d.mode == "bitwise" and d.equal, d.first_divergence
    assert d.compared_steps.first == 3


PS = ["--set", 'parallelism.architecture="parameter-server"']


@pytest.mark.slow
def test_parameter_server_staleness_0_equals_allreduce_and_staleness_1_is_another_algorithm(runs):
    ddp = runs.reference()
    sync = diff_runs(ddp, runs.reference(*PS))
    assert sync.equal, sync.first_divergence
    stale = diff_runs(ddp, runs.reference(*PS, "--set", "parallelism.staleness=1"))
    assert not stale.equal
    assert any("different algorithms" in w and "staleness" in w for w in stale.warnings)


@pytest.mark.slow
def test_parameter_server_fault_on_a_worker_is_located(runs):
    ref = runs.reference(*PS)
    f = diff_runs(ref, runs.fault("bitflip-grad", 3, 1, *PS)).first_divergence
    assert (f.step, f.phase, f.rank) == (3, "backward", 1)
    rec = runs.get("recover", ref, "--from-step", 2)
    assert diff_runs(ref, rec).equal


@pytest.mark.slow
def test_pipeline_fault_on_the_last_stage_and_resume(runs):
    pp = STRATEGIES["pp2-1f1b"]
    ref = runs.reference(*pp)
    f = diff_runs(ref, runs.fault("drop-microbatch", 3, 1, *pp, "--param", "micro_batch=2"))
    f = f.first_divergence
    assert (f.step, f.micro_batch, f.phase, f.rank) == (3, 2, "loss", 1)
    rec = runs.get("recover", ref, "--from-step", 2)
    assert diff_runs(ref, rec).equal
    trace = orjson.loads(
        cli("trace", ref, "-o", ref / "trace.json", check=0) and (ref / "trace.json").read_bytes()
    )
    p2p = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] in ("send", "recv_")]
    assert (
        len(p2p) >= 2 * 4 * 4
    )  # per step: 4 micro-batches' activations forward and gradients back
    spans = {
        pid: [
            e
            for e in trace["traceEvents"]
            if e.get("ph") == "X"
            and e["pid"] == pid
            and e["tid"] == 0
            and e["name"].startswith("step 2 ")
        ]
        for pid in (0, 1)
    }
    for pid in (0, 1):  # every micro-batch's forward and backward on every stage
        assert sorted(e["name"] for e in spans[pid]) == sorted(
            [f"step 2 forward mb {i}" for i in range(4)]
            + [f"step 2 backward mb {i}" for i in range(4)]
        )
    first = {pid: min(spans[pid], key=lambda e: e["ts"]) for pid in (0, 1)}
    # the pipeline fills: stage 1 idles (the bubble) until stage 0's first forward is done
    assert first[1]["ts"] >= first[0]["ts"] + first[0]["dur"]


CLIP = ["--set", "training.max_grad_norm=0.05"]  # small: clipping is active every step


@pytest.mark.slow
def test_clipping_across_meshes_keeps_replicas_consistent(runs):
    """dp x tp: norm weights live on the dp mesh, matmuls on dp x tp; the global norm combines both."""
    run = runs.reference(*STRATEGIES["dp2xtp2"], *CLIP)
    assert cli("check", run).returncode == 0
    assert diff_runs(runs.reference(*CLIP), run).equal


@pytest.mark.slow
def test_clipping_is_recorded_and_clip_faults_are_found_by_check_alone(runs):
    z3 = [*STRATEGIES["zero3"], *CLIP]
    clean = runs.reference(*z3)
    recs = [r for r in Run(clean).records(0) if r["step"] == 2 and r["phase"] == "clip"]
    scalars = {r["tensor"]: r for r in recs if r["tensor"] in ("grad_norm", "clip_coef", "lr")}
    assert set(scalars) == {"grad_norm", "clip_coef", "lr"} and scalars["clip_coef"]["sum"] < 1.0
    assert cli("check", clean).returncode == 0
    for name, sets, rank in (
        ("clip-local-norm", z3, 1),
        ("clip-skip-replicated", [*STRATEGIES["tp2"], *CLIP], 0),
    ):
        proc = cli("check", runs.fault(name, 3, rank, *sets), "--json")
        assert proc.returncode == 1, (name, proc.stdout)
        first = orjson.loads(proc.stdout)["first"]
        assert (first["step"], first["phase"]) == (3, "clip") and rank in first["minority"], (
            name,
            first,
        )


@pytest.mark.slow
def test_a_local_clip_norm_is_named_at_the_norm_not_at_a_clipped_gradient(runs):
    """tp2: the norm weights are held whole by both tp ranks, so a rank that clips by its own shards' norm
    scales them differently too; inside the clip phase the norm is computed first, then the gradients it
    scales, and both `check` and `diff` name the norm. The control: the same layout clipping by the global
    norm is consistent, and its clip records come in that order with each gradient's parameter index."""
    tp2 = [*STRATEGIES["tp2"], *CLIP]
    clean = runs.reference(*tp2)
    assert cli("check", clean).returncode == 0
    recs = [r for r in Run(clean).records(0) if r["step"] == 3 and r["phase"] == "clip"]
    names = [r["tensor"] for r in recs]
    assert names[:3] == ["grad_norm", "clip_coef", "lr"] and len(names) > 3, names
    reduced = {
        r["tensor"]: r["index"]
        for r in Run(clean).records(0)
        if r["step"] == 3 and r["phase"] == "reduce"
    }
    assert {r["tensor"]: clip_param_index(r["index"]) for r in recs[3:]} == reduced
    fault = runs.fault("clip-local-norm", 3, 1, *tp2)
    proc = cli("check", fault, "--json")
    assert proc.returncode == 1, proc.stdout
    first = orjson.loads(proc.stdout)["first"]
    assert (first["step"], first["phase"], first["tensor"]) == (3, "clip", "grad_norm"), first
    f = diff_runs(clean, fault).first_divergence
    assert (f.step, f.phase, f.rank, f.tensor) == (3, "clip", 1, "grad_norm"), f


# tp2 in make test-all: CI's test_fault_on_a_tensor_parallel_shard_names_rank_and_logical_tensor names a tp2
# shard's fault by rank and logical tensor
@pytest.mark.parametrize(
    "name",
    [
        "zero3",
        pytest.param("tp2", marks=pytest.mark.slow),
        pytest.param("pp2-1f1b", marks=pytest.mark.slow),
    ],
)
def test_bitflip_param_is_located_under_every_sharding(runs, name):
    """The flipped shard is found at its rank, under the logical tensor's name (for pp: the stage that
    owns the tensor, so the flip targets a parameter of the last stage)."""
    sets = STRATEGIES[name]
    tensor = "layers.1.feed_forward.w2.weight"  # lives on the last pipeline stage, sharded under zero3/tp
    f = diff_runs(
        runs.reference(*sets),
        runs.fault("bitflip-param", 3, 1, *sets, "--param", f"tensor={tensor}"),
    )
    f = f.first_divergence
    assert (f.step, f.phase, f.rank, f.tensor) == (3, "optimizer", 1, tensor), f


@pytest.mark.slow  # ZeRO-2 and GPipe are the slow tier's
@pytest.mark.parametrize("a,b", [("zero2", "zero3"), ("pp2-gpipe", "pp2-1f1b")])
def test_layouts_that_record_alike_compute_alike(runs, a, b):
    """The harness's strategies whose records show one layout compute it bit for bit (diff/layout.py: why
    such a pair is compared bit for bit whatever its locks state): the stated layouts differ, the records
    do not, and not one bit does."""
    d = diff_runs(runs.reference(*STRATEGIES[a]), runs.reference(*STRATEGIES[b]))
    assert d.mode == "bitwise" and d.equal, (d.mode, d.first_divergence)
    assert any("show the same one" in w for w in d.warnings)
