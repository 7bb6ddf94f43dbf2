"""Experiment identity from what a run observed: an attached run's global batch is the samples per optimizer
step it counted (never a factor defaulted to 1), and a field one attached run does not know is not compared,
so two equivalent experiments are not refused and two different ones still are. The oracles: the batch
sizes the scripts below feed (known by construction), and, end to end, the numeric diff of the pair."""

from __future__ import annotations

import copy

import pytest
from conftest import run_snippet

from disttrace.analysis.diff import diff_runs
from disttrace.config.identity import experiment_differences, known_global_batch, unknown_line
from disttrace.errors import BadInput
from disttrace.run.attach import observed_batch
from disttrace.store.records import ATTACHED_SOURCE
from disttrace.store.rundir import Run


def attached_lock(accum=None, mbs=None, observed=None, config=None, dp=2) -> dict:
    training = {"optimizer": "SGD", "lr": 0.1, "dtype": "float32"}
    if accum is not None:
        training["grad_accum_steps"] = accum
    if mbs is not None:
        training["micro_batch_size"] = mbs
    lock = {
        "manifest": {
            "experiment": {"name": "x", "edition": "user", "seed": 0},
            "parallelism": {"dp": dp, "tp": 1, "pp": 1, "world_size": dp, "engine": "DDP"},
            "model": {"class": "Tiny", "parameters": 10, "tensors": {}},
            "optimizer": {"type": "torch.optim.SGD", "param_groups": {"0": {"lr": 0.1}}},
            "training": training,
            "config": config if config is not None else {"max_epochs": -1},
        },
        "manifest_id": "0" * 64,
        "source": ATTACHED_SOURCE,
    }
    if observed is not None:
        lock["observed"] = {"global_batch": observed, "step": 1}
    return lock


def test_the_lightning_pair_is_one_experiment_by_what_it_counted():
    """accumulate 2 x batch 4 against 1 x 8 on 2 ranks: 16 samples a step both. The callback states the
    accumulation but no micro-batch size; the old rule read that as 1 and refused (4 vs 2)."""
    a, b = attached_lock(accum=2, observed=16), attached_lock(accum=1, observed=16)
    assert experiment_differences(a, b) == ([], [])
    c = attached_lock(accum=1, observed=32)  # batch 16 x 1: another experiment
    diffs, unknown = experiment_differences(a, c)
    assert diffs == [("global_batch", 16, 32)] and unknown == []


def test_a_global_batch_nobody_counted_is_not_compared_and_said_once():
    unfinished = attached_lock(accum=2)  # no `observed`: the run never reached close
    diffs, unknown = experiment_differences(attached_lock(accum=1, observed=16), unfinished)
    assert diffs == [] and len(unknown) == 1 and unknown[0].startswith("global_batch (B: ")
    line = unknown_line(unknown)
    assert "\n" not in line and "did not finish" in line
    # stated in full by the user's config (micro-batch and accumulation): that is known, and compared
    assert known_global_batch(attached_lock(accum=2, mbs=4)["manifest"]) == (16, "stated")
    diffs, _ = experiment_differences(attached_lock(accum=2, mbs=4), attached_lock(observed=32))
    assert diffs == [("global_batch", 16, 32)]
    # never a factor defaulted to 1: accumulation stated, micro-batch not
    assert known_global_batch(attached_lock(accum=2)["manifest"])[0] is None


def test_unknown_config_keys_are_not_compared_but_known_differences_are():
    a = attached_lock(observed=16, config={"max_epochs": -1, "steps": 3})
    b = attached_lock(observed=16, config={"max_epochs": -1})
    assert experiment_differences(a, b) == ([], ["config.steps (B)"])
    b["manifest"]["config"]["steps"] = 4
    assert experiment_differences(a, b)[0] == [("config.steps", 3, 4)]
    c = copy.deepcopy(a)
    c["manifest"]["optimizer"]["param_groups"]["0"]["lr"] = 0.1001
    assert [k for k, _, _ in experiment_differences(a, c)[0]] == ["optimizer.param_groups.0.lr"]
    # an optimizer's None is a setting (torch's foreach=None), not an unknown
    a["manifest"]["optimizer"]["param_groups"]["0"]["foreach"] = None
    c = copy.deepcopy(a)
    c["manifest"]["optimizer"]["param_groups"]["0"]["foreach"] = True
    assert [k for k, _, _ in experiment_differences(a, c)[0]] == [
        "optimizer.param_groups.0.foreach"
    ]


def test_a_harness_run_and_an_attached_one_are_held_to_every_field():
    harness = {
        "manifest": {
            "experiment": {"name": "x", "edition": "user", "seed": 0},
            "data": {"sha256": "ab"},
            "parallelism": {"dp": 2},
            "training": {"micro_batch_size": 4, "grad_accum_steps": 2, "lr": 0.1},
        },
        "manifest_id": "1" * 64,
        "source": "manifest.toml",
    }
    diffs, unknown = experiment_differences(harness, attached_lock(accum=2, observed=16))
    assert "data.sha256" in [k for k, _, _ in diffs] and unknown == []


def test_observed_batch_counts_each_tensor_parallel_group_once():
    parts = [{"step": 1, "samples": 4, "micro_batches": 2} for _ in range(4)]
    assert observed_batch(parts, [[0, 1], [2, 3]])["global_batch"] == 8  # dp 2 x tp 2
    assert observed_batch(parts, [[0], [1], [2], [3]])["global_batch"] == 16  # dp 4
    parts[2]["samples"] = None
    doc = observed_batch(parts, [[0, 1], [2, 3]])
    assert doc["global_batch"] is None and "leading dimension" in doc["why"]


def test_observed_tokens_are_the_bounds_reduction_size():
    """The tokens a step summed over (the numeric bound's T), counted like the samples: once a tensor-parallel
    group; left out where a rank could not count them. Token ids count every element, a float input every
    vector of its last dimension."""
    parts = [{"step": 1, "samples": 4, "tokens": 4 * 31, "micro_batches": 2} for _ in range(4)]
    assert observed_batch(parts, [[0, 1], [2, 3]])["tokens"] == 2 * 4 * 31
    parts[3]["tokens"] = None
    assert "tokens" not in observed_batch(parts, [[0], [1], [2], [3]])
    torch = pytest.importorskip("torch")
    from disttrace.run.attach.steps import tokens_of

    assert tokens_of(torch.zeros(4, 31, dtype=torch.long)) == 4 * 31
    assert tokens_of(torch.zeros(4, 31, 8)) == 4 * 31
    assert tokens_of(torch.zeros(4)) == 4
    assert tokens_of(None) is None and tokens_of(torch.tensor(1.0)) is None


SCRIPT = """
import torch, disttrace.api as d
torch.manual_seed(0)
data = torch.randn(12, 4)
def train(accum, size, batch_call, close):
    torch.manual_seed(1)
    m = torch.nn.Linear(4, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)
    r = d.attach(m, o, out={out!r}, config={{"lr": 0.1}})
    for step in range(2):
        o.zero_grad()
        for k in range(accum):
            x = data[(step * accum + k) * size:(step * accum + k + 1) * size]
            if batch_call:
                r.batch(x)
            r.loss(m(x).pow(2).mean() / accum).backward()
        o.step()
    if close:
        r.close()
    print(r.run_dir)
train(2, 3, False, True)
train(1, 6, True, True)
train(1, 6, False, False)
"""


def test_an_attached_script_counts_its_batches_and_compares_as_one_experiment(tmp_path):
    """One process, 2 micro-batches of 3 (counted from the forward's input) against one of 6 (from
    run.batch): 6 samples a step each, the same training, so diff compares them, numerically equal. A third,
    never closed, has no count: compared, with the one line saying the global batch was not."""
    proc = run_snippet(SCRIPT.format(out=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b, unfinished = proc.stdout.split()[-3:]
    for path, accum in ((a, 2), (b, 1)):
        obs = Run(path).lock["observed"]
        assert obs["global_batch"] == 6 and obs["micro_batches"] == {"0": accum}, obs
    d = diff_runs(a, b, mode="numeric")
    assert d.equal and d.compared_steps.count == 2 and d.warnings == []
    d = diff_runs(a, unfinished, mode="numeric")
    assert sum("global_batch" in w for w in d.warnings) == 1, d.warnings


def test_an_attached_pair_of_different_global_batches_is_refused(tmp_path):
    script = SCRIPT.replace(
        "train(2, 3, False, True)\ntrain(1, 6, True, True)\ntrain(1, 6, False, False)",
        "train(2, 3, False, True)\ntrain(2, 2, False, True)",
    )
    proc = run_snippet(script.format(out=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = proc.stdout.split()[-2:]
    with pytest.raises(BadInput) as e:
        diff_runs(a, b, mode="numeric")
    assert e.value.field == "global_batch" and "6 vs 4" in str(e.value)
