"""Tests whose oracle is not the tool's own output: what was planted (the rank, the document, the damaged
file) is known before the tool looks, and the tool must name exactly that.

The eval-metric oracle (a fault that moves the eval loss fails `eval_metric`) is in test_gate_policy.py."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from conftest import cli

from disttrace.analysis.diff import diff_runs
from disttrace.data import corpus
from disttrace.store.rundir import Run

CORPUS = Path(__file__).resolve().parent.parent / "manifests" / "data" / "corpus.jsonl"
DP4 = ("--set", "parallelism.dp=4", "--set", "training.grad_accum_steps=1")


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


def check_first(run_dir) -> dict:
    proc = cli("check", run_dir, "--json")
    assert proc.returncode == 1, proc.stderr
    return orjson.loads(proc.stdout)["first"]


# ---------------------------------------------------------------- the minority rank


def test_check_names_exactly_the_planted_rank_among_four_replicas(runs):
    """Four copies: three agree, so the odd one out is known. The planted rank (1) and only it is named."""
    first = check_first(runs.fault("skip-allreduce", 3, 1, *DP4))
    assert (first["step"], first["phase"]) == (3, "reduce")
    assert first["minority"] == [1] and first["majority"] == [0, 2, 3] and first["tie"] is False, (
        first
    )


# ---------------------------------------------------------------- contamination


def _variant_in_train(evl: list[dict]) -> tuple[dict, dict]:
    """An eval document and a copy of it, changed only in case and spacing, that the hash split sends to
    the train side (most variants do: 90% of texts hash to train)."""
    for d in evl:
        for variant in (
            d["text"].upper(),
            "  " + d["text"].replace(" ", "  "),
            d["text"].lower() + " ",
        ):
            if variant.strip() != d["text"].strip() and not corpus.in_eval(
                variant, 10, "disttrace-v1"
            ):
                return d, {"id": "planted", "text": variant}
    raise AssertionError("no variant of any eval document hashes to train")


def test_contamination_planted_in_the_train_split_is_caught():
    docs = corpus.load_documents(CORPUS)
    _, evl, clean = corpus.split_documents(docs, 10, "disttrace-v1")
    assert clean["eval_in_train"] == 0
    original, planted = _variant_in_train(evl)
    train, evl2, report = corpus.split_documents(docs + [planted], 10, "disttrace-v1")
    assert any(
        d["id"] == "planted" for d in train
    )  # the plant went where it was meant to: the train split
    assert report["eval_in_train"] == 1
    assert corpus.eval_in_train(train, evl2) == [original["id"]]


def test_an_exact_copy_placed_in_train_is_caught():
    docs = corpus.load_documents(CORPUS)
    train, evl, _ = corpus.split_documents(docs, 10, "disttrace-v1")
    assert corpus.eval_in_train(train + [dict(evl[7], id="copy")], evl) == [evl[7]["id"]]
    assert corpus.eval_in_train(train, evl) == []


# ---------------------------------------------------------------- checkpoint faults, seen by diff


def test_a_corrupted_checkpoint_file_is_a_checkpoint_divergence(runs, ref):
    """corrupt-checkpoint flips bytes of rank 1's shard file after it is written; the training is untouched.
    diff names the checkpoint phase, the step and the rank whose file it was, and nothing before."""
    fault = runs.fault("corrupt-checkpoint", 2, 1)
    fired = [e for e in Run(fault).events().records if e["event"] == "fault_fired"]
    d = diff_runs(ref, fault)
    f = d.first_divergence
    assert not d.equal and (f.step, f.phase, f.rank) == (2, "checkpoint", 1), f
    assert f.tensor == f"file:{fired[0]['file']}"
    # one record differs, the damaged file's; the training itself and the next checkpoint are bit-equal
    assert [(p.step, p.differing) for p in d.propagation] == [(2, 1), (3, 0), (4, 0)], d.propagation


def test_a_checkpoint_saved_without_optimizer_state_is_a_checkpoint_divergence(runs, ref):
    fault = runs.fault("optimizer-reset", 2, 0)
    d = diff_runs(ref, fault)
    f = d.first_divergence
    assert (f.step, f.phase, f.rank) == (2, "checkpoint", 0), f
    assert f.missing_in == "b" and f.tensor.startswith("optim."), (
        f
    )  # the optimizer state is what is gone
