"""Each fault's handlers on a bare hook bus, without a job: the point's payload as the loop and the strategies
emit it, the change the fault must make computed here from its parameters (the oracle), and the
`fault_fired` line with its proof. A mistake in what a handler reads of a payload fails here in a second,
where the located-fault jobs of test_faults.py take minutes (and some run in the slow tier only)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import DEFAULT

from disttrace.config.freezing import read_toml, validate
from disttrace.run import faults
from disttrace.run.job.hooks import (
    Backward,
    Batch,
    BeforeCheckpoint,
    BeforeClip,
    BeforeOptimizer,
    Data,
    HookBus,
    Loss,
    Optimizer,
    Reduce,
    StepStart,
    TensorRef,
)

STEP, RANK = 3, 1


def _armed(tmp_path, name: str, step: int = STEP, **params):
    manifest = validate(
        read_toml(DEFAULT), DEFAULT
    )  # dp 2, two micro-batches, a checkpoint every 2
    spec = faults.get(name).spec(step, RANK, params, manifest)
    fault = faults.build(spec)
    bus = HookBus(RANK)
    bus.step, bus.micro_batch = step, 0
    fault.attach(bus, SimpleNamespace(run_dir=tmp_path, manifest=manifest, dp_rank=1))
    return fault, bus


def _fired(tmp_path) -> list[dict]:
    p = tmp_path / "events.jsonl"
    lines = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return [e for e in lines if e["event"] == "fault_fired"]


def _grads(*values) -> list[TensorRef]:
    return [
        TensorRef(i, f"t{i}", torch.tensor(v, dtype=torch.float32)) for i, v in enumerate(values)
    ]


def test_grad_scale_divides_the_reduced_gradient_by_dp_once(tmp_path):
    fault, bus = _armed(tmp_path, "grad-scale")
    grads = _grads([2.0, 4.0], [6.0])
    bus.step = STEP - 1
    bus.emit(Reduce(grads))  # another step: untouched
    assert grads[0].tensor.tolist() == [2.0, 4.0]
    bus.step = STEP
    bus.emit(Reduce(grads))
    bus.emit(Reduce(grads))  # fires once
    assert grads[0].tensor.tolist() == [1.0, 2.0] and grads[1].tensor.tolist() == [3.0]
    (e,) = _fired(tmp_path)
    assert (e["step"], e["rank"], e["point"], e["divisor"], e["changed"]) == (
        STEP,
        RANK,
        "reduce",
        2,
        True,
    )


def test_data_swap_hands_the_rank_the_next_dp_ranks_shard(tmp_path):
    fault, bus = _armed(tmp_path, "data-swap", micro_batch=1)
    shards = {r: Batch(torch.full((2, 4), r), torch.full((2, 4), 10 + r), [r]) for r in range(2)}
    assert bus.emit(Data(shards[1], fetch=shards.__getitem__)).batch is shards[1]  # micro-batch 0
    bus.micro_batch = 1
    got = bus.emit(Data(shards[1], fetch=shards.__getitem__)).batch
    assert got is shards[0]  # (dp_rank 1 + 1) % dp 2
    (e,) = _fired(tmp_path)
    assert (e["micro_batch"], e["read_shard_of_dp_rank"], e["changed"]) == (1, 0, True)


@pytest.mark.parametrize(
    ("name", "params", "factor"),
    [("drop-microbatch", {}, 0.0), ("loss-scale", {"factor": 1.5}, 1.5)],
)
def test_loss_faults_scale_the_micro_batchs_loss(tmp_path, name, params, factor):
    fault, bus = _armed(tmp_path, name, **params)
    out = bus.emit(Loss(torch.tensor(2.0), tokens=8)).loss
    assert float(out) == 2.0 * factor
    (e,) = _fired(tmp_path)
    assert (e["before"], e["after"], e["changed"]) == (2.0, 2.0 * factor, True)


def test_bitflip_grad_flips_the_named_bit_on_the_last_micro_batch(tmp_path):
    fault, bus = _armed(tmp_path, "bitflip-grad", tensor="1", element=1, bit=31)
    grads = _grads([1.0, 2.0], [3.0, 4.0])
    bus.emit(Backward(grads))  # micro-batch 0: not the last
    bus.micro_batch = 1
    bus.emit(Backward(grads))
    assert grads[1].tensor.tolist() == [3.0, -4.0] and grads[0].tensor.tolist() == [
        1.0,
        2.0,
    ]  # the sign bit
    (e,) = _fired(tmp_path)
    assert (e["tensor"], e["element"], e["bit"], e["before"], e["after"]) == (
        "t1",
        1,
        31,
        4.0,
        -4.0,
    )


def test_lr_skew_steps_with_k_times_the_rate_and_restores_it(tmp_path):
    fault, bus = _armed(tmp_path, "lr-skew", k=3.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    params = [TensorRef(0, "w", w)]
    bus.emit(BeforeOptimizer(opt, params))
    assert opt.param_groups[0]["lr"] == 1.5
    bus.emit(Optimizer(params, optimizer=opt))
    assert opt.param_groups[0]["lr"] == 0.5
    (e,) = _fired(tmp_path)
    assert (e["lr_before"], e["lr_used"]) == ([0.5], [1.5])


def test_stale_param_applies_the_update_to_the_previous_steps_parameters(tmp_path):
    fault, bus = _armed(tmp_path, "stale-param")
    w = torch.nn.Parameter(torch.tensor([1.0]))
    params = [TensorRef(0, "w", w)]
    history = []
    for step, new in ((STEP - 1, 2.0), (STEP, 5.0)):  # the optimizer moves w to `new` at each step
        bus.step = step
        history.append(float(w.detach()))
        bus.emit(BeforeOptimizer(None, params))
        with torch.no_grad():
            w.fill_(new)
        bus.emit(Optimizer(params))
    # step STEP's update (5 - 2) applied to the parameters step STEP - 1 started from (1)
    assert float(w) == history[0] + (5.0 - history[1])
    (e,) = _fired(tmp_path)
    assert (e["step"], e["target"], e["changed"]) == (STEP, "local", True)


def test_optimizer_reset_drops_the_optimizer_state_of_the_checkpoint(tmp_path):
    fault, bus = _armed(tmp_path, "optimizer-reset", step=4)  # a checkpoint step
    state = {"model": {}, "optim": {}, "progress": {}}
    bus.step = 2
    assert "optim" in bus.emit(BeforeCheckpoint(dict(state), 2)).state
    bus.step = 4
    assert sorted(bus.emit(BeforeCheckpoint(dict(state), 4)).state) == ["model", "progress"]
    (e,) = _fired(tmp_path)
    assert (e["dropped"], e["changed"]) == ("optim", True)


def test_skip_allreduce_restores_what_the_rank_sent(tmp_path):
    fault, bus = _armed(tmp_path, "skip-allreduce")
    grads = _grads([1.0], [2.0])
    bus.emit(Backward(grads))  # the local gradient after backward, not the one sent: not kept
    bus.emit(Backward(grads, before_collective=True))
    reduced = _grads([9.0], [8.0])
    bus.emit(Reduce(reduced))
    assert [g.tensor.tolist() for g in reduced] == [[1.0], [2.0]]
    (e,) = _fired(tmp_path)
    assert (e["tensors"], e["names"], e["changed"]) == (2, ["t0", "t1"], True)


def test_clip_local_norm_clips_with_the_local_norm(tmp_path):
    manifest = read_toml(DEFAULT)
    manifest["parallelism"]["zero_stage"] = 2
    manifest["training"]["max_grad_norm"] = 0.5
    manifest = validate(manifest, DEFAULT)
    spec = faults.get("clip-local-norm").spec(STEP, RANK, {}, manifest)
    bus = HookBus(RANK)
    bus.step = STEP
    faults.build(spec).attach(bus, SimpleNamespace(run_dir=tmp_path, manifest=manifest))
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    p = bus.emit(BeforeClip(torch.tensor(10.0), [TensorRef(0, "w", w)], max_norm=0.5))
    assert float(p.norm) == 5.0
    (e,) = _fired(tmp_path)
    assert (e["global_norm"], e["local_norm"]) == (10.0, 5.0)


def test_kill_rank_is_installed_on_its_rank_only(tmp_path):
    manifest = validate(read_toml(DEFAULT), DEFAULT)
    fault = faults.build(faults.get("kill-rank").spec(STEP, RANK, {}, manifest))
    other = HookBus(0)
    other.step = STEP
    fault.attach(other, SimpleNamespace(run_dir=tmp_path, manifest=manifest))
    other.emit(StepStart())  # rank 0 holds no handler: nothing happens
    assert not other.listening("step_start") and not _fired(tmp_path)
