"""What attach sees of a user's data and model: the batches of a DataLoader driven by a
DistributedSampler (each micro-batch's `data` record with the sample ids the sampler yielded), the
top-level blocks' outputs (`forward`), and FSDP2 and DTensor tensor-parallel scripts
(tests/scripts/loader_train.py, 2 ranks on gloo).
The oracles: the sampler itself (recomputed here), and where a planted change must first show."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli
from torch.utils.data import DistributedSampler

from disttrace.analysis.diff import diff_runs
from disttrace.store.jsonlines import read_json
from disttrace.store.rundir import Run

SCRIPT = ROOT / "tests" / "scripts" / "loader_train.py"
SAMPLES, BATCH, ACCUM = 32, 4, 2  # as in the script

VARIANTS = {
    "ddp": [],
    "ddp-again": [],
    "ddp-seed-1": ["--sampler-seed", "1"],
    "ddp-perturb": ["--bug", "perturb"],
    "fsdp2": ["--engine", "fsdp2"],
    "fsdp2-again": ["--engine", "fsdp2"],
    "fsdp2-same-data": ["--engine", "fsdp2", "--bug", "same-data"],
    "tp": ["--engine", "tp"],
    "tp-again": ["--engine", "tp"],
    "tp-different-data": [
        "--engine",
        "tp",
        "--bug",
        "same-data",
    ],  # under tp the bug is ranks reading different data
}


def run_script(out: Path, *args) -> Path:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", SCRIPT, "--out", out, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("loader")
    return {name: run_script(out, *args) for name, args in VARIANTS.items()}


def first(a: Path, b: Path) -> tuple:
    d = diff_runs(a, b)
    assert not d.equal
    f = d.first_divergence
    return f.step, f.micro_batch, f.phase, f.tensor


def sampler_batches(rank: int, seed: int, epoch: int) -> list[list[int]]:
    sampler = DistributedSampler(range(SAMPLES), num_replicas=2, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


@pytest.mark.slow
@pytest.mark.parametrize("name,seed", [("ddp", 0), ("ddp-seed-1", 1), ("fsdp2", 0)])
def test_data_records_carry_the_samplers_ids_per_micro_batch(runs, name, seed):
    per_epoch = SAMPLES // 2 // BATCH  # batches per rank and epoch: 3 steps of 2 cross into epoch 1
    for rank in (0, 1):
        data = [r for r in Run(runs[name]).records(rank) if r["phase"] == "data"]
        assert [(r["step"], r["micro_batch"]) for r in data] == [
            (s, m) for s in (1, 2, 3) for m in range(ACCUM)
        ]
        for r in data:
            n = (r["step"] - 1) * ACCUM + r["micro_batch"]
            assert r["samples"] == sampler_batches(rank, seed, n // per_epoch)[n % per_epoch], r
            assert r["shape"] == [BATCH, 8]


@pytest.mark.slow
@pytest.mark.parametrize("fix", ["ddp", "fsdp2", "tp"])
def test_the_fix_twice_is_bit_identical_and_check_finds_nothing(runs, fix):
    d = diff_runs(runs[fix], runs[f"{fix}-again"])
    assert d.mode == "bitwise" and d.equal and d.compared_steps.count == 3
    proc = cli("check", runs[fix], "--json")
    assert proc.returncode == 0 and orjson.loads(proc.stdout)["consistent"] is True, proc.stdout


@pytest.mark.slow
def test_another_sampler_seed_diverges_first_at_data(runs):
    assert first(runs["ddp"], runs["ddp-seed-1"]) == (1, 0, "data", "inputs")
    proc = cli("diff", runs["ddp"], runs["ddp-seed-1"])
    assert "data" in proc.stdout and "step 1" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_forward_records_every_top_level_block_and_name_the_perturbed_one(runs):
    recs = [r for r in Run(runs["ddp"]).records(0) if r["phase"] == "forward" and r["step"] == 1]
    assert [(r["micro_batch"], r["tensor"]) for r in recs] == [
        (m, b) for m in (0, 1) for b in ("embed", "mix", "head")
    ]
    assert Run(runs["ddp"]).manifest_doc["record"] == {
        "every": 1,
        "forward": True,
        "forward_modules": ["embed", "mix", "head"],
    }
    # the data and the embedding are the same; the perturbed block's output is where the evidence first differs
    assert first(runs["ddp"], runs["ddp-perturb"]) == (1, 0, "forward", "mix")


@pytest.mark.slow
def test_fsdp2_run_records_shards_where_they_sit(runs):
    run = Run(runs["fsdp2"])
    assert (
        run.manifest_doc["parallelism"]["engine"] == "FSDP2"
        and run.manifest_doc["parallelism"]["zero_stage"] == 3
    )
    assert {r["tensor"] for r in run.records(0) if r["phase"] == "forward"} == {
        "mix"
    }  # forward=["mix"]
    for rank, offset in ((0, 0), (1, 16)):  # dim 0 of embed.weight [32, 16] split over 2 ranks
        by = {(r["phase"], r["tensor"]): r for r in run.records(rank) if r["step"] == 1}
        for phase in ("reduce", "optimizer"):
            rec = by[(phase, "embed.weight")]
            assert rec["shard"] == {"offset": [offset, 0], "logical_shape": [32, 16]} and rec[
                "shape"
            ] == [16, 16]
    replicas = read_json(run.path / "replicas.json")
    assert replicas["groups"]["dp"] == [[0, 1]]
    assert {r["phase"] for r in replicas["rules"]} == {"data", "clip", "optimizer"}
    topo = run.topology()
    assert (
        topo.engine == "FSDP2" and topo.groups["dp"] == [[0, 1]] and topo.groups["tp"] == [[0], [1]]
    )
    assert (run.manifest_doc["parallelism"]["dp"], run.manifest_doc["parallelism"]["tp"]) == (2, 1)


@pytest.mark.slow
def test_tensor_parallel_run_records_shards_and_its_replica_map(runs):
    run = Run(runs["tp"])
    assert run.manifest_doc["parallelism"]["engine"] == "DTensor"
    by = {(r["phase"], r["tensor"]): r for r in run.records(1) if r["step"] == 1}
    # mix column-wise (weight rows split), head row-wise (weight columns split, bias replicated)
    assert by[("optimizer", "mix.weight")]["shard"] == {"offset": [8, 0], "logical_shape": [16, 16]}
    assert by[("optimizer", "head.weight")]["shard"] == {
        "offset": [0, 8],
        "logical_shape": [32, 16],
    }
    assert "shard" not in by[("optimizer", "head.bias")]
    rules = read_json(run.path / "replicas.json")["rules"]
    assert {"phase": "data", "dim": "mesh:0", "relation": "agree"} in rules
    assert {
        "phase": "optimizer",
        "dim": "mesh:0",
        "relation": "agree",
        "tensors": ["head.bias"],
    } in rules
    # the evidence states the layout: one tensor-parallel group of both ranks, no data parallelism
    topo = run.topology()
    assert topo.groups["tp"] == [[0, 1]] and topo.groups["dp"] == [[0], [1]]
    assert [r.coords["tp"] for r in topo.ranks] == [0, 1]
    assert (run.manifest_doc["parallelism"]["dp"], run.manifest_doc["parallelism"]["tp"]) == (1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["fsdp2-same-data", "tp-different-data"])
def test_check_flags_ranks_reading_the_wrong_data(runs, bug):
    """The replica map from the placements: FSDP2's ranks are data-parallel, so identical batches are a bug;
    tensor-parallel ranks share one batch, so different batches are."""
    proc = cli("check", runs[bug], "--json")
    assert proc.returncode == 1, proc.stdout
    f = orjson.loads(proc.stdout)["first"]
    assert (f["step"], f["phase"]) == (1, "data") and sorted(f["group"]) == [0, 1], f


SINGLE = """
import torch, disttrace.api as d
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
o = torch.optim.SGD(m.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.arange(24.).reshape(6, 4)), batch_size=2)
r = d.attach(m, o, out={out!r}, forward={forward!r})
with torch.no_grad():  # an evaluation pass over a watched loader: no micro-batch, nothing queued
    [m(x) for (x,) in r.watch_loader(DataLoader(TensorDataset(torch.ones(6, 4)), batch_size=3))]
for (x,) in r.watch_loader(loader):
    o.zero_grad(); r.loss(m(x).sum()).backward(); o.step()
r.close(); print(r.run_dir)
"""


def attach_single(tmp_path, forward) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SINGLE.format(out=str(tmp_path), forward=forward)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_watched_loader_and_chosen_blocks_in_one_process(tmp_path):
    proc = attach_single(tmp_path, ["0", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = Run(proc.stdout.strip().splitlines()[-1])
    recs = list(run.records(0))
    # a SequentialSampler's batches, one per step: samples [0, 1], [2, 3], [4, 5] (none of the eval pass's)
    assert [(r["step"], r["samples"]) for r in recs if r["phase"] == "data"] == [
        (1, [0, 1]),
        (2, [2, 3]),
        (3, [4, 5]),
    ]
    assert [(r["step"], r["tensor"]) for r in recs if r["phase"] == "forward"] == [
        (s, b) for s in (1, 2, 3) for b in ("0", "2")
    ]


def test_forward_naming_a_module_the_model_lacks_is_refused(tmp_path):
    proc = attach_single(tmp_path, ["0", "blocks.9"])
    assert proc.returncode != 0
    assert (
        "attach(forward=...)" in proc.stderr
        and "blocks.9" in proc.stderr
        and "0, 1, 2" in proc.stderr
    )


TWICE = """
import torch, disttrace.api as d
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
o = torch.optim.SGD(m.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.arange(32.).reshape(8, 4)), batch_size=2)
r = d.attach(m, o, out={out!r}, loader=loader)
it = iter(loader)
for step in range(2):
    window = [next(it) for _ in range(2)]  # the accumulation window fetched first
    o.zero_grad()
    for (x,) in window:  # the model run twice on each batch (e.g. a loss with two passes)
        r.loss(m(x).sum() + m(x[:1]).square().sum()).backward()
    o.step()
r.close(); print(r.run_dir)
"""


def test_a_second_forward_of_one_batch_does_not_take_the_next_batchs_ids(tmp_path):
    """Batches pair with forwards by order; a forward reading the batch the previous forward took (the same
    storage, here a slice of it) is not the next batch's: by order it was given the next batch's sample ids."""
    proc = subprocess.run(
        [sys.executable, "-c", TWICE.format(out=str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = [r for r in Run(proc.stdout.strip().splitlines()[-1]).records(0) if r["phase"] == "data"]
    # a SequentialSampler: batches [0, 1], [2, 3] in step 1 and [4, 5], [6, 7] in step 2, each at its first
    # forward (micro-batches 0 and 2); the second forwards (1 and 3) record their own input without ids
    assert [(r["step"], r["micro_batch"], r["samples"]) for r in data] == [
        (1, 0, [0, 1]),
        (1, 1, []),
        (1, 2, [2, 3]),
        (1, 3, []),
        (2, 0, [4, 5]),
        (2, 1, []),
        (2, 2, [6, 7]),
        (2, 3, []),
    ]
    assert [r["shape"] for r in data] == [[2, 4], [1, 4]] * 4
