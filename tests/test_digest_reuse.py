"""The recorder hashes only the bytes it digested lately (run/record/digest.py, `Seen`) and still writes exactly the
records a full digest of every tensor writes: the oracle is the same recorder with `reuse=False`, which
digests each tensor with digest_tensor as the recorder always did, listening to the same step."""

from __future__ import annotations

import orjson
import pytest
import torch
from conftest import DEFAULT, SHORT, cli, last_line, raw_records, traj_file

from disttrace.run.job.hooks import Batch, HookBus, grads_of, param_refs
from disttrace.run.job.loop import emit_module_outputs
from disttrace.run.parallel.common import clip_gradients, optimizer_state_list
from disttrace.run.record import digest as D
from disttrace.run.record import digestmany as M
from disttrace.run.record.recorder import Recorder
from disttrace.run.record.seen import Seen


def _model():
    from types import SimpleNamespace

    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model

    m = freeze(DEFAULT, []).manifest["model"]
    return build_model(SimpleNamespace(**m), torch.float32, 1234), m["vocab_size"]


def _index(run_dir):
    lines = (run_dir / "trajectory" / "rank-00000.steps.jsonl").read_bytes().splitlines()
    # the wall time, and the chain hash over the line that holds it, differ; the rest is the step's bytes
    return [{k: v for k, v in orjson.loads(x).items() if k not in ("time", "chain")} for x in lines]


def _traj(run_dir) -> bytes:
    return traj_file(run_dir, 0).read_bytes()


def test_reused_statistics_are_the_full_digests_and_a_hidden_write_is_seen(tmp_path):
    """A step as tensor parallelism emits it (the last micro-batch's local gradients are the reduced ones),
    clipped by the harness's clip_gradients with a coefficient of 1, AdamW, then the checkpoint's state dict:
    the reusing recorder writes the same bytes as the full one, reusing gradients at reduce and clip and the
    parameters and Adam state at checkpoint. At step 3 a fault writes a parameter through `.data` (its
    version counter does not move): the reusing recorder hashes it, sees other bytes and digests it."""
    model, vocab = _model()
    emit_module_outputs(model, bus := HookBus(0))
    named = param_refs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reuse = Recorder(tmp_path / "reuse", 0, reuse=True).attach(bus)
    full = Recorder(tmp_path / "full", 0, reuse=False).attach(bus)
    emb = model.tok_embeddings.weight
    assert emb.numel() > M.SMALL  # digested on its own: the path Seen remembers
    hidden = {}

    def write_through_data(b, p):
        if b.step == 3:
            v = emb._version
            emb.data.add_(1.0)
            hidden["version moved"] = emb._version != v

    bus.on("before_checkpoint", write_through_data, 10)
    g = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        bus.step = step
        bus.emit("step_start")
        opt.zero_grad(set_to_none=True)
        for mb in (0, 1):
            bus.micro_batch = mb
            tokens = torch.randint(0, vocab, (2, 17), generator=g)
            bus.emit("data", batch=Batch(tokens[:, :-1], sample_ids=[2 * mb, 2 * mb + 1]))
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss = bus.emit("loss", loss=loss, tokens=32).loss
            (loss / 2).backward()
            bus.emit("backward", grads=grads_of(named))
        bus.emit("reduce", grads=grads_of(named))
        clip_gradients(bus, named, opt, 1e9)  # the coefficient is 1: the gradients keep their bytes
        opt.step()
        bus.emit("optimizer", params=named, state=optimizer_state_list(opt, named), optimizer=opt)
        bus.emit(
            "before_checkpoint",
            state={"model": model.state_dict(), "optim": opt.state_dict()},
            step=step,
        )
        bus.emit("step_end")
    reuse.close()
    full.close()
    assert hidden == {"version moved": False}
    assert _traj(tmp_path / "reuse") == _traj(tmp_path / "full")
    assert _index(tmp_path / "reuse") == _index(tmp_path / "full")
    big = [p for _, _, p in named if p.numel() > M.SMALL]
    # per step at least: reduce and clip reuse the big gradients, the checkpoint the big parameters and
    # their two Adam moments; every step counter after the first
    assert reuse._seen.hits >= 3 * 6 * len(big), reuse._seen.hits
    assert reuse._seen.misses >= 1  # the hidden write, hashed and found changed
    recs = [r for r in raw_records(tmp_path / "reuse", 0) if r["step"] == 3]
    name = "tok_embeddings.weight"
    saved = [r for r in recs if r["phase"] == "checkpoint" and r["tensor"] == f"model.{name}"]
    updated = [r for r in recs if r["phase"] == "optimizer" and r["tensor"] == name]
    assert len(saved) == len(updated) == 1
    assert saved[0]["digest"] != updated[0]["digest"]  # the write through .data is in the record
    assert saved[0]["digest"] == D.digest_tensor(emb)["digest"]


def test_a_changed_storage_or_changed_bytes_are_digested_afresh():
    """Seen against digest_tensor: the same tensor unchanged is reused; multiplied by 1 (its version moves
    on) only with `recheck`; multiplied by 0.5, or a new tensor where a freed one lived, never."""
    seen = Seen()
    g = torch.Generator().manual_seed(3)
    t = torch.randn(300, 70, generator=g)
    assert seen.digest(t) == D.digest_tensor(t) and seen.hits == 0
    assert seen.digest(t) == D.digest_tensor(t) and seen.hits == 1
    t.mul_(1.0)
    assert seen.digest(t) == D.digest_tensor(t) and seen.hits == 1  # version moved: not even hashed
    assert seen.digest(t, recheck=True) == D.digest_tensor(t) and seen.hits == 2
    t.mul_(0.5)
    assert seen.digest(t, recheck=True) == D.digest_tensor(t) and seen.misses == 1
    ptr = t.data_ptr()
    del t
    u = torch.randn(300, 70, generator=g)  # often where t lived, version 0 as t's was at first
    assert seen.digest(u) == D.digest_tensor(u)
    assert seen.hits == 2, ptr
    for scalar in (torch.tensor(3.0), torch.tensor(3.0), torch.tensor(-0.0), torch.tensor(0.0)):
        assert seen.digest(scalar) == D.digest_tensor(scalar)
    assert seen.hits == 3  # the second 3.0; -0.0 and 0.0 are other bytes


@pytest.mark.slow
def test_a_tensor_parallel_run_with_checkpoints_writes_the_same_trajectory_with_and_without_reuse(
    tmp_path,
):
    """Real tp=2 jobs (DTensor; the last micro-batch's gradients are the reduced ones, checkpoints at steps 2
    and 4, clipping): the trajectory of every rank is byte for byte the one written digesting every tensor in
    full (DISTTRACE_DIGEST_REUSE=0)."""
    sets = [
        *("--set", "parallelism.dp=1", "--set", "parallelism.tp=2"),
        *("--set", "model.n_kv_heads=2", "--set", "training.max_grad_norm=1000"),
    ]
    a = last_line(cli("run", DEFAULT, *SHORT, *sets, "--out", tmp_path / "a", check=0))
    b = last_line(
        cli(
            "run",
            DEFAULT,
            *SHORT,
            *sets,
            "--out",
            tmp_path / "b",
            check=0,
            env={"DISTTRACE_DIGEST_REUSE": "0"},
        )
    )
    for rank in (0, 1):
        assert traj_file(a, rank).read_bytes() == traj_file(b, rank).read_bytes(), rank
