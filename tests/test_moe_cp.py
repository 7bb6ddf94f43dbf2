"""Mixture of experts, expert parallel and context parallel.

The model's mixture against a per-token loop written here; the manifest ids of dense layouts unchanged; the
plan's parameter count against the built model's. Then real gloo jobs: MoE (4 experts, top-2) at dp=2 x ep=2
against dp=1 with the same global batch (accumulation doubled), and cp=2 against cp=1: `diff --mode numeric`
equal, `check` consistent, and each run's losses against the other's directly (the global batch's mean loss
per step, no tolerance machinery). Controls the other way: a token misrouted, an expert's output dropped, a
label shifted at the cp boundary are found at their step, and a skipped all-reduce breaks `check`'s rules.
Last, two public bug families in a user's script (tests/scripts/moe_cp_bugs.py, torch's own collectives,
attached): found at their step and phase, the fix equal to itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from conftest import DEFAULT, ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.sync import check_sync, load_traces
from disttrace.config.freezing import freeze
from disttrace.model.llama import MoE, build_model, load_balance
from disttrace.model.names import parameter_names
from disttrace.plan.layout import plan_from_manifest
from disttrace.store.rundir import LOCK, Run

MOE = ["--set", "model.n_experts=4", "--set", "model.top_k=2"]
SHORT = ["--set", "training.steps=4", "--set", "checkpoint.interval=0"]
EP = [*MOE, "--set", "parallelism.ep=2"]  # dp=2 x accumulation 2 (the default's)
EP_REF = [*MOE, "--set", "parallelism.dp=1", "--set", "training.grad_accum_steps=4"]
CP = ["--set", "parallelism.dp=1", "--set", "parallelism.cp=2"]
CP_REF = ["--set", "parallelism.dp=1"]


# ------------------------------------------------------------------ the plain model, no job


def test_the_mixture_is_the_per_token_sum_of_its_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden=24, n_experts=4, top_k=2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16, dtype=torch.float32)
    y = moe(x).reshape(-1, 16)
    flat = x.reshape(-1, 16)
    ex = moe.experts
    for t in range(flat.shape[0]):  # each token on its own, in float64
        xt = flat[t].double()
        probs = torch.softmax(xt @ moe.router.gate.weight.double().t(), -1)
        w, e = probs.topk(2)
        want = torch.zeros(16, dtype=torch.float64)
        for wi, ei in zip(w / w.sum(), e):
            h = torch.nn.functional.silu(xt @ ex.w1.weight[ei].double().t())
            h = h * (xt @ ex.w3.weight[ei].double().t())
            want += wi * (h @ ex.w2.weight[ei].double().t())
        torch.testing.assert_close(y[t].double(), want, rtol=1e-5, atol=1e-6)


def test_the_load_balancing_term_is_one_when_balanced_and_more_when_not():
    uniform = torch.full((8, 4), 0.25)
    assert float(load_balance(uniform, torch.tensor([4, 4, 4, 4]))) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert float(load_balance(skewed, torch.tensor([8, 0, 0, 0]))) == pytest.approx(4 * 0.7)


def test_dense_manifests_keep_their_ids_and_moe_keys_need_experts():
    plain = freeze(DEFAULT)
    assert "n_experts" not in plain.manifest["model"]
    assert not {"ep", "cp"} & set(plain.manifest["parallelism"])
    stated = freeze(
        DEFAULT, ["model.n_experts=0", "parallelism.ep=1", "parallelism.cp=1"]
    )  # defaults written out
    assert stated.manifest_id == plain.manifest_id
    moe = freeze(DEFAULT, ["model.n_experts=4"])
    assert moe.manifest_id != plain.manifest_id and moe.manifest["model"]["top_k"] == 2
    bad = cli("freeze", DEFAULT, "--set", "model.top_k=2")
    assert bad.returncode == 2 and "n_experts" in bad.stderr
    bad = cli("freeze", DEFAULT, *MOE, "--set", "parallelism.ep=3")
    assert bad.returncode == 2 and "ep" in bad.stderr


def test_names_and_plan_count_the_built_mixture():
    m = freeze(DEFAULT, ["model.n_experts=4", "parallelism.ep=2"]).model()
    model = build_model(m.model)
    assert [n for n, _ in model.named_parameters()] == parameter_names(m.model.model_dump())
    p = plan_from_manifest(m)
    numel = {n: t.numel() for n, t in model.named_parameters()}
    assert p.params == sum(numel.values())
    experts = sum(v for n, v in numel.items() if ".experts." in n)
    assert p.experts["expert_params"] == experts
    assert p.experts["params_per_device"] == sum(numel.values()) - experts // 2
    cp = plan_from_manifest(freeze(DEFAULT, ["parallelism.dp=1", "parallelism.cp=2"]).model())
    assert cp.inputs.world_size == 2 and cp.context["seq_per_device"] == 32


# ------------------------------------------------------------------ real jobs


def _run(runs, *sets):
    return runs.get("run", DEFAULT, *SHORT, *sets)


def _inject(runs, fault, step, rank, *sets):
    return runs.get(
        "inject", DEFAULT, *SHORT, *sets, "--fault", fault, "--step", step, "--rank", rank
    )


def _step_losses(run) -> dict[int, float]:
    """The global batch's mean loss per step, from the loss records of every rank and micro-batch (a cp
    group's ranks each hold the whole sequence's: counted once, by their dp coordinate)."""
    r = Run(run)
    topo = orjson.loads((run / "topology.json").read_bytes())
    firsts = {}
    for place in topo["ranks"]:
        firsts.setdefault(place["coords"]["dp"], place["rank"])
    sums: dict[int, list[float]] = {}
    for rank in firsts.values():
        for rec in r.records(rank):
            if rec["phase"] == "loss":
                sums.setdefault(rec["step"], []).append(rec["sum"])
    return {s: sum(v) / len(v) for s, v in sums.items()}


def _diff_first(a, b):
    d = diff_runs(a, b, mode="numeric")
    return d, d.first_divergence


def test_expert_parallel_equals_dp1_with_the_same_global_batch(runs):
    ref, ep = _run(runs, *EP_REF), _run(runs, *EP)
    # the experts were stored as shards of the logical tensor, where they live
    recs = [r for r in Run(ep).records(1) if r["step"] == 1 and r["phase"] == "optimizer"]
    shards = {r["tensor"]: r["shard"] for r in recs if "shard" in r}
    assert shards["layers.0.moe.experts.w1.weight"]["offset"] == [2, 0, 0]
    assert all(".experts." in n for n in shards)
    proc = cli("diff", ref, ep, "--mode", "numeric")
    assert proc.returncode == 0, proc.stderr[-3000:]
    d, _ = _diff_first(ref, ep)
    assert {"reduce", "optimizer"} <= set(d.compared_phases)
    for step, loss in _step_losses(ref).items():  # an oracle outside the bound
        assert _step_losses(ep)[step] == pytest.approx(loss, rel=1e-5)
    assert cli("check", ep).returncode == 0
    # the ranks' all-to-alls carry as many tokens as routing gave each: not a desync
    sync = check_sync(Run(ep))
    assert sync.ok, sync.first_mismatch
    traces, _ = load_traces(Run(ep))
    rows = {
        rank: [tuple(r.shapes[0]) for g in t.values() for r in g if "alltoall" in (r.op or "")]
        for rank, t in traces.items()
    }
    assert rows[0] and len(rows[0]) == len(rows[1]) and rows[0] != rows[1]  # uneven, as routed


def test_context_parallel_equals_cp1(runs):
    ref, cp = _run(runs, *CP_REF), _run(runs, *CP)
    topo = orjson.loads((cp / "topology.json").read_bytes())
    assert topo["mesh_shape"] == {"pp": 1, "dp": 1, "cp": 2, "tp": 1}
    proc = cli("diff", ref, cp, "--mode", "numeric")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _step_losses(cp)
    for step, loss in _step_losses(ref).items():
        assert losses[step] == pytest.approx(loss, rel=1e-5)
    # each cp rank holds the whole sequence's loss; its block outputs are slices placed in the sequence
    fwd = [r for r in Run(cp).records(1) if r["step"] == 1 and r["phase"] == "forward"]
    assert fwd and all(r["shard"]["offset"][1] == 32 for r in fwd)
    assert cli("check", cp).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,seen_on",
    # a misrouted token's output returns to the rank that sent it (1); an expert's output dropped on rank
    # 1 is every sender's loss, and rank 0 comes first in the order
    [("ep-misroute", 1), ("ep-drop-expert", 0)],
)
def test_a_dispatch_fault_is_found_at_its_step_and_rank(runs, fault, seen_on):
    ref, ep = _run(runs, *EP_REF), _run(runs, *EP)
    bad = _inject(runs, fault, 3, 1, *EP)
    d, first = _diff_first(ref, bad)
    assert not d.equal and (first.step, first.rank) == (3, seen_on), first
    assert first.phase in ("forward", "loss"), first
    # against the same layout, bitwise: the forward of the layer it acted in
    same = diff_runs(ep, bad).first_divergence
    assert (same.step, same.phase, same.rank, same.tensor) == (3, "forward", seen_on, "layers.0")


@pytest.mark.slow
def test_a_label_shifted_at_the_cp_boundary_is_found_at_its_step(runs):
    ref = _run(runs, *CP_REF)
    bad = _inject(runs, "cp-label-boundary", 3, 0, *CP)
    d, first = _diff_first(ref, bad)
    assert not d.equal and (first.step, first.phase) == (3, "loss"), first
    losses, want = _step_losses(bad), _step_losses(ref)
    assert losses[2] == pytest.approx(want[2], rel=1e-5)
    assert losses[3] != pytest.approx(want[3], rel=1e-5)  # the loss moved, a little
    assert abs(losses[3] / want[3] - 1) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,fault,phase",
    # dp = 1 under cp: a parameter flipped on one rank breaks the world's copies
    [("ep", "skip-allreduce", "reduce"), ("cp", "bitflip-param", "optimizer")],
)
def test_check_finds_a_broken_replica_in_the_replicated_part(runs, layout, fault, phase):
    bad = _inject(runs, fault, 3, 1, *(EP if layout == "ep" else CP))
    proc = cli("check", bad, "--json")
    assert proc.returncode == 1, proc.stderr
    first = orjson.loads(proc.stdout)["first"]
    assert (first["step"], first["phase"]) == (3, phase), first
    if layout == "ep":  # the dense part; the expert slices are nobody's replicas at dp = ep
        assert ".experts." not in first["tensor"], first


@pytest.mark.slow
def test_expert_slices_replicated_over_edp_compare_and_are_checked(runs):
    """dp=4 x ep=2: each expert slice lives on two ranks (edp). The pieces still combine into the logical
    tensor (equal to dp=1), and a bit flipped in one copy breaks the edp rule, naming that group."""
    wide = [*MOE, "--set", "parallelism.dp=4", "--set", "parallelism.ep=2"]
    wide += ["--set", "training.grad_accum_steps=1"]
    ref, ep = _run(runs, *EP_REF), _run(runs, *wide)
    assert diff_runs(ref, ep, mode="numeric").equal
    assert cli("check", ep).returncode == 0
    tensor = "layers.1.moe.experts.w2.weight"
    bad = _inject(runs, "bitflip-param", 3, 2, *wide, "--param", f"tensor={tensor}")
    proc = cli("check", bad, "--json")
    assert proc.returncode == 1, proc.stderr
    first = orjson.loads(proc.stdout)["first"]
    assert (first["step"], first["phase"], first["tensor"]) == (3, "optimizer", tensor), first
    assert first["group"] == [0, 2], first


# ------------------------------------------------------------------ a user's script, attached

BUGS = ROOT / "tests" / "scripts" / "moe_cp_bugs.py"


def _script(out, family, bug="none", *extra):
    proc = subprocess.run(
        [sys.executable, BUGS, "--family", family, "--bug", bug, "--out", out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    effect = [line for line in proc.stderr.splitlines() if line.startswith("effect:")]
    return Path(proc.stdout.strip().splitlines()[-1]), effect[0]


def _zero_code(out, family, bug="none", *cli_args):
    """The script without its attach call (--no-attach), recorded by `disttrace run|inject -- CMD`."""
    verb = cli_args[0] if cli_args else "run"
    proc = cli(
        verb, "--out", out, *cli_args[1:], "--", sys.executable, BUGS,
        "--family", family, "--bug", bug, "--no-attach",
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def _check(run):
    proc = cli("check", run, "--json")
    return proc.returncode, orjson.loads(proc.stdout) if proc.stdout.strip() else proc.stderr


def test_an_attached_expert_parallel_script_is_consistent(tmp_path):
    # DDP ignores the rank's own experts: attach leaves them out of DDP's rule, which still holds the rest
    fix, _ = _script(tmp_path, "ep")
    rc, doc = _check(fix)
    assert rc == 0, doc
    notes = orjson.loads((fix / "replicas.json").read_bytes())["inferred"]["notes"]
    assert "DDP ignores (mixer.experts)" in notes[0], notes


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ep", "cp"])
def test_the_fix_variants_are_consistent_attached_and_zero_code_and_a_replica_fault_is_not(
    tmp_path, family
):
    attached, _ = _script(tmp_path, family)
    recorded = _zero_code(tmp_path, family)
    assert orjson.loads((recorded / LOCK).read_bytes())["source"] == "zero-code"
    for run in (attached, recorded):
        rc, doc = _check(run)
        assert rc == 0, (run, doc)
    # the other way: the dense part's all-reduce skipped on rank 1 at step 2 breaks its rule there
    bad = _zero_code(tmp_path, family, "none", "inject", "--fault", "skip-allreduce", "--step", "2",
                     "--rank", "1")  # fmt: skip
    rc, doc = _check(bad)
    assert rc == 1, doc
    assert (doc["first"]["step"], doc["first"]["phase"]) == (2, "reduce"), doc["first"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,bug,phase", [("ep", "router-detached", "backward"), ("cp", "label-roll", "loss")]
)
def test_a_public_bug_family_under_zero_code_is_found_at_its_phase(tmp_path, family, bug, phase):
    fix = _zero_code(tmp_path, family)
    bad = _zero_code(tmp_path, family, bug)
    first = diff_runs(fix, bad).first_divergence
    assert (first.step, first.micro_batch, first.phase) == (1, 0, phase), first


@pytest.mark.slow
def test_dp_shards_of_context_parallel_groups_that_read_one_batch_are_found(tmp_path):
    # 4 ranks, cp groups [0, 1] and [2, 3] (attach(layout={"cp": group})): the cp ranks' one batch is
    # allowed, the two groups reading the same one is not
    fix, _ = _script(tmp_path, "cp", "none", "--world", "4")
    rc, doc = _check(fix)
    assert rc == 0, doc
    rep = orjson.loads((fix / "replicas.json").read_bytes())
    assert rep["groups"]["cp"] == [[0, 1], [2, 3]] and rep["groups"]["dp-shards"] == [
        [0, 2],
        [1, 3],
    ]
    bad, _ = _script(tmp_path, "cp", "dp-same-data", "--world", "4")
    rc, doc = _check(bad)
    assert rc == 1, doc
    first = doc["first"]
    assert (first["step"], first["phase"], first["group"]) == (1, "data", [0, 2]), first


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,bug,phase",
    # the router's gradient loses the language-model loss while the loss stays bit for bit the same: first
    # seen at backward (the embedding's gradient, which also reached the router's input, comes first); the
    # labels rolled within a slice change the loss itself
    [("ep", "router-detached", "backward"), ("cp", "label-roll", "loss")],
)
def test_a_public_bug_family_in_an_attached_script_is_found(tmp_path, family, bug, phase):
    fix, fix_effect = _script(tmp_path, family)
    again, _ = _script(tmp_path, family)
    bad, bad_effect = _script(tmp_path, family, bug)
    assert diff_runs(fix, again).equal  # the fix is deterministic: one run equals the next
    # the script's own measurement, without disttrace: the bug is real and small
    numbers = [float(x) for x in bad_effect.replace("'", " ").split() if x[0].isdigit()]
    if family == "ep":
        fixed = float(fix_effect.split()[-1])
        assert numbers[-1] < fixed / 10  # the router kept only the load-balancing term's gradient
    else:
        assert numbers[0] != numbers[1] and abs(numbers[0] / numbers[1] - 1) < 0.05
    rc, doc = _check(fix)  # the fix is consistent too (DDP-ignored experts; a cp group's one batch)
    assert rc == 0, doc
    d = diff_runs(fix, bad)
    first = d.first_divergence
    assert not d.equal and (first.step, first.micro_batch, first.phase) == (1, 0, phase), first
    if family == "ep":  # the forward and the loss were identical
        losses = [r for r in Run(bad).records(0) if r["phase"] == "loss" and r["step"] == 1]
        want = [r for r in Run(fix).records(0) if r["phase"] == "loss" and r["step"] == 1]
        assert [r["digest"] for r in losses] == [r["digest"] for r in want]
