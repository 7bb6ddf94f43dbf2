"""Batched device digests (run/record/devdigest.py). No GPU here: the same torch kernels run on CPU tensors, with
`digest._digest_on_device` (one tensor at a time, the path GPUs took before) as the oracle; the CUDA side
stream, pinned copy and event are the only parts these tests cannot reach (bench/gpu_check.sh does, on a
GPU)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import DEFAULT, SHORT, cli, last_line, raw_records, traj_file

from disttrace.run.faults import flip_bit
from disttrace.run.record.devdigest import DeviceDigests
from disttrace.run.record.digest import _digest_on_device


def _items():
    g = torch.Generator().manual_seed(3)
    nan = torch.randn(9, 7, generator=g)
    nan[4, 2] = float("nan")
    return [
        (torch.randn(64, 32, generator=g), None, None),
        (torch.randn(64, 32, generator=g), None, None),  # same shape: stacked with the one before
        (torch.randn(3, 5, 7, generator=g), None, None),
        (torch.tensor(2.5), None, None),  # a scalar (a loss)
        (torch.randn(100, generator=g), None, None),
        (torch.randn(40, 40, generator=g).double(), None, None),
        (torch.randn(33, 17, generator=g).to(torch.bfloat16), None, None),
        (torch.randint(0, 1000, (4, 16), generator=g), None, None),  # token ids
        (
            torch.randn(16, 64, generator=g),
            [16, 0],
            [64, 64],
        ),  # a shard placed in its logical tensor
        (torch.randn(32, 8, generator=g), [0, 8], [32, 16]),
        (torch.empty(0, 4), None, None),
        (nan, None, None),
    ]


def _check_against_oracle(got: list[dict], items) -> None:
    for (t, off, lshape), d in zip(items, got):
        one = _digest_on_device(t, off, lshape) if t.numel() else None
        if one is None:
            assert d["digest"] == "dev:" + "0" * 32 and d["numel"] == 0 and d["sketch"] is None
            continue
        for k in ("digest", "dtype", "shape", "numel", "nonfinite"):
            assert d[k] == one[k], (tuple(t.shape), k, d[k], one[k])
        if one["sum"] is None:
            assert d["sum"] is None and d["sketch"] is None
            continue
        scale = float(torch.linalg.vector_norm(t.double())) * math.sqrt(t.numel()) + 1e-300
        assert abs(d["sum"] - one["sum"]) <= 1e-12 * scale, tuple(t.shape)
        assert abs(d["norm"] - one["norm"]) <= 1e-12 * one["norm"] + 1e-300, tuple(t.shape)
        assert np.abs(np.subtract(d["sketch"], one["sketch"])).max() <= 1e-12 * scale, tuple(
            t.shape
        )


@pytest.mark.parametrize(
    "chunk,budget", [(1 << 24, 1 << 28), (64, 1 << 28), (1, 1 << 28), (1 << 24, 2048), (64, 0)]
)
def test_batched_device_digests_agree_with_the_per_tensor_path(chunk, budget):
    """Every digest equals digest.device_digest's exactly (the checksum is exact integer arithmetic, so
    chunking and stacking cannot change it); sums, norms and sketches agree to float64 rounding. Chunks:
    one kernel per group, whole rows, one row at a time; a snapshot budget that some groups or none fit in
    (the rest digested tensor by tensor, in place)."""
    items = _items()
    dev = DeviceDigests(chunk=chunk, snapshot_bytes=budget)
    rows = dev.add(items[:5])
    rows += dev.add(items[5:])  # two hooks, one collect: rows number on across them
    assert rows == list(range(len(items)))
    _check_against_oracle(dev.collect().result(), items)
    assert dev.collect().result() == []  # the queue is empty after a collect


def test_a_flipped_bit_changes_the_batched_digest_and_runs_repeat_bit_for_bit():
    items = _items()
    dev = DeviceDigests()
    dev.add(items)
    base = dev.collect().result()
    dev.add(items)
    assert (
        dev.collect().result() == base
    )  # the same tensors, the same bits (no atomics, fixed order)
    for k in (0, 1, 7, 8):  # the first and second of one stacked group, token ids, a shard
        t = items[k][0].clone()
        flip_bit(t, 5, 0)
        dev.add([(t, items[k][1], items[k][2])])
        assert dev.collect().result()[0]["digest"] != base[k]["digest"], k


def test_the_snapshot_is_taken_when_the_hook_fires():
    """An in-place update after `add` (an optimizer step) does not change the digest queued before it."""
    t = torch.randn(8, 8)
    before = _digest_on_device(t)["digest"]
    dev = DeviceDigests()
    dev.add([(t, None, None)])
    t.add_(1.0)
    assert dev.collect().result()[0]["digest"] == before


def _run(out, *args, env):
    return last_line(cli("run", DEFAULT, *SHORT, *args, "--out", out, check=0, env=env))


def test_a_run_on_the_batched_device_path_repeats_bit_for_bit_and_finds_a_fault(tmp_path):
    """Real dp=2 jobs with every tensor on the batched device path (DISTTRACE_DEVICE_DIGESTS=1), so each step
    is written one step late, as on a GPU: two references are bit-identical, every step is in the store and
    verifies. The fault run adds the live check, which fetches the current step's digests at once (no lag):
    its steps before the fault equal the reference's, and the bit flipped at step 3 is the first divergence."""
    env = {"DISTTRACE_DEVICE_DIGESTS": "1"}
    a = _run(tmp_path / "a", env=env)
    b = _run(tmp_path / "b", env=env)
    for rank in (0, 1):
        assert traj_file(a, rank).read_bytes() == traj_file(b, rank).read_bytes(), rank
        recs = raw_records(a, rank)
        assert {r["step"] for r in recs} == {
            1,
            2,
            3,
            4,
        }  # the last step too: written when the run closes
        assert all(
            r["digest"].startswith("dev:") for r in recs if r["dtype"] != "bytes"
        )  # not checkpoint files
    cli("verify", a, check=0)
    fault = last_line(
        cli(
            "inject",
            DEFAULT,
            *SHORT,
            "--fault",
            "bitflip-grad",
            "--step",
            3,
            "--rank",
            1,
            "--set",
            "debug.live_check=true",
            "--out",
            tmp_path / "f",
            check=0,
            env=env,
        )
    )
    doc = json.loads(cli("diff", a, fault, "--json").stdout)
    first = doc["first_divergence"]
    assert (first["step"], first["rank"]) == (3, 1), first


def _indexed_steps(run_dir, rank: int = 0) -> list[int]:
    path = run_dir / "trajectory" / f"rank-{rank:05d}.steps.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if path.exists()
        else []
    )


def test_a_step_awaiting_its_device_digests_is_written_before_a_kill_rank_sigkill(
    tmp_path, monkeypatch
):
    """On a GPU a finished step waits for its digests' copy; a kill-rank fault at the next step's start must not
    take it down with the process. Here the copy never reports ready, as a slow GPU's would not."""
    from types import SimpleNamespace

    from disttrace.config.freezing import read_toml, validate
    from disttrace.run import faults
    from disttrace.run.job.hooks import HookBus
    from disttrace.run.record import devdigest
    from disttrace.run.record.recorder import Recorder

    monkeypatch.setenv("DISTTRACE_DEVICE_DIGESTS", "1")
    monkeypatch.setattr(devdigest.Fetch, "ready", lambda self: False)
    killed = []

    def kill(pid, sig):
        killed.append(_indexed_steps(tmp_path))  # what is on disk when the signal would land
        raise SystemExit(137)

    monkeypatch.setattr(faults.job.os, "kill", kill)
    (tmp_path / "trajectory").mkdir()
    bus = HookBus(rank=0)
    recorder = Recorder(tmp_path, 0).attach(bus)
    ctx = SimpleNamespace(run_dir=tmp_path, manifest=validate(read_toml(DEFAULT), DEFAULT))
    faults.build({"name": "kill-rank", "step": 3, "rank": 0, "params": {}}).attach(bus, ctx)
    w = torch.nn.Linear(4, 4)
    for step in (1, 2, 3):
        bus.step = step
        try:
            bus.emit("step_start")
        except SystemExit:
            break
        bus.emit("optimizer", params=[(0, "w", w.weight), (1, "b", w.bias)])
        bus.emit("step_end")
        with torch.no_grad():
            w.weight.add_(1.0)
    assert killed == [[1, 2]], killed  # step 2 was still waiting for its digests when step 3 began
    recorder.close()


def test_an_attached_script_that_raises_keeps_its_last_finished_step(tmp_path):
    """An exception out of `with attach(...)` leaves the run incomplete but must not lose the finished step still
    waiting for its device digests."""
    from conftest import run_snippet

    code = f"""
import os
os.environ["DISTTRACE_DEVICE_DIGESTS"] = "1"
import torch, torch.distributed as dist
import disttrace.api
from disttrace.run.record import devdigest
devdigest.Fetch.ready = lambda self: False  # as a busy GPU's copy would not be, at the next step's start
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with disttrace.api.attach(model, opt, out={str(tmp_path)!r}) as run:
        for step in range(3):
            opt.zero_grad()
            run.loss(model(torch.randn(8, 4)).square().mean()).backward()
            if step == 2:
                raise KeyboardInterrupt
            opt.step()
except KeyboardInterrupt:
    print("run_dir", run.run_dir)
dist.destroy_process_group()
"""
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = __import__("pathlib").Path(proc.stdout.split("run_dir ", 1)[1].split()[0])
    assert not (run_dir / "COMPLETE").exists()
    assert _indexed_steps(run_dir) == [1, 2]
