"""The gate reuses an evaluation only from its own cache, keyed by the bytes the evaluation read: an
eval.json in the run store, whoever wrote it, is never read back as a score."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from conftest import cli

from disttrace.gate import evalcache
from disttrace.store.checkpoints import INDEX, final_checkpoint
from disttrace.store.rundir import Run


def copy_of(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "runs" / run.parent.name / run.name
    shutil.copytree(run, dst)  # copy2: the INDEX keeps its mtime
    return dst


def gate_eval(run: Path, cache: Path) -> dict:
    proc = cli("gate", run, "--json", env={"DISTTRACE_CACHE_DIR": str(cache)}, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return orjson.loads(proc.stdout)["eval"]


@pytest.fixture(scope="module")
def scored(runs, tmp_path_factory) -> tuple[Path, dict]:
    """A gate's evaluation of a copy of the reference, into a cache of its own: (that cache, the score)."""
    tmp = tmp_path_factory.mktemp("scored")
    cache = tmp / "cache"
    return cache, gate_eval(copy_of(runs.reference(), tmp), cache)


def test_a_forged_eval_json_with_a_matching_index_mtime_is_not_trusted(runs, scored, tmp_path):
    run = copy_of(runs.reference(), tmp_path)
    true = scored[1]  # the gate's score of the same bytes (another copy: the same evaluation key)
    index = final_checkpoint(Run(run)) / INDEX
    # what a store's writer can put there: a flattering score naming this checkpoint, the INDEX's mtime (the
    # old reuse key) and even the new key, which anyone can compute from the store
    forged = {
        **true,
        "eval_loss": 0.01,
        "perplexity": 1.01,
        "token_accuracy": 0.99,
        "index_mtime": index.stat().st_mtime,
        "evaluation_key": true.get("evaluation_key"),
    }
    (run / "eval.json").write_bytes(orjson.dumps(forged))
    again = gate_eval(
        run, tmp_path / "cache-b"
    )  # another machine's gate: nothing cached, so it scores
    assert again["eval_loss"] == true["eval_loss"] != 0.01
    assert orjson.loads((run / "eval.json").read_bytes())["eval_loss"] == true["eval_loss"]


def test_a_cached_score_is_the_gates_own_and_named_by_what_was_scored(runs, scored, tmp_path):
    run = copy_of(runs.reference(), tmp_path)
    cache, true = scored
    entries = list((cache / "eval").iterdir())
    assert [e.name for e in entries] == [f"{true['evaluation_key']}.json"]
    # the cache is the user's own: mark its entry, and the next gate reports the mark (reused, not rescored)
    entries[0].write_bytes(orjson.dumps({**true, "eval_loss": 1.2345}))
    assert gate_eval(run, cache)["eval_loss"] == 1.2345


def test_the_key_changes_with_the_checkpoint_index_and_the_lock(runs, tmp_path, monkeypatch):
    run = copy_of(runs.reference(), tmp_path)
    ckpt = final_checkpoint(Run(run))
    key = evalcache.evaluation_key(Run(run), ckpt)
    assert evalcache.evaluation_key(Run(run), ckpt) == key
    index = ckpt / INDEX
    index.write_bytes(index.read_bytes() + b"\n")  # still a valid INDEX of the same files
    assert evalcache.evaluation_key(Run(run), ckpt) != key
    lock = run / "manifest.lock.json"
    doc = orjson.loads(lock.read_bytes())
    doc["manifest"]["experiment"]["description"] += " (edited)"
    keyed = evalcache.evaluation_key(Run(run), ckpt)
    lock.write_bytes(orjson.dumps(doc))
    assert evalcache.evaluation_key(Run(run), ckpt) != keyed
    # an entry that names another key is not this evaluation
    cache = tmp_path / "cache"
    (cache / "eval").mkdir(parents=True)
    (cache / "eval" / f"{key}.json").write_bytes(
        orjson.dumps({"evaluation_key": "0" * 64, "eval_loss": 1.0})
    )
    monkeypatch.setenv("DISTTRACE_CACHE_DIR", str(cache))
    assert evalcache.cached(key) is None
