"""Issue 13, item 3: faults prove they fired. The event names what was actually changed (the wrapped element,
the bit, the values and a digest before/after); a spec that could change nothing is refused before any
process starts; parameter-server faults act on the master state, so what the workers receive changes."""

from __future__ import annotations

import struct
from pathlib import Path

import orjson
import pytest
from conftest import DEFAULT, SHORT, cli, last_line, raw_records

PS = [
    "--set",
    'parallelism.architecture="parameter-server"',
]  # as test_strategies.py spells it: one run


def fired(run: Path) -> list[dict]:
    lines = (run / "events.jsonl").read_bytes().splitlines()
    return [e for e in map(orjson.loads, lines) if e["event"] == "fault_fired"]


def records(run: Path, rank: int, step: int, phase: str) -> dict[str, dict]:
    """A rank's records of one step and phase, read straight from the Arrow stream (no disttrace reader)."""
    out = {}
    for r in raw_records(run, rank):
        if r["step"] == step and r["phase"] == phase:
            out[f"{r['micro_batch']}:{r['tensor']}"] = r
    return out


def xor_bits32(a: float, b: float) -> int:
    return (
        struct.unpack("<I", struct.pack("<f", a))[0] ^ struct.unpack("<I", struct.pack("<f", b))[0]
    )


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("proof")


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()  # the session's reference run (conftest.py)


@pytest.fixture(scope="module")
def ps_ref(runs) -> Path:
    return runs.reference(*PS)


# ---------------------------------------------------------------- refused before the job


@pytest.mark.parametrize(
    "fault,params,sets,field",
    [
        ("unsynced-param", ["--param", "tensor=layers.0.no_such.weight"], [], "--param tensor"),
        (
            "bitflip-grad",
            ["--param", "tensor=layers.7.attention.wq.weight"],
            [],
            "--param tensor",
        ),  # 2 layers
        (
            "bitflip-param",
            ["--param", "tensor=99"],
            [],
            "--param tensor",
        ),  # 21 parameters: index 0..20
        ("lr-skew", ["--param", "k=1"], [], "--param k"),
        # FSDP2 shards the norm weights over dp under dp x tp: nothing is replicated, nothing left unclipped
        (
            "clip-skip-replicated",
            [],
            ["--set", "parallelism.tp=2", "--set", "training.max_grad_norm=0.1"],
            "--fault",
        ),
    ],
)
def test_a_fault_that_could_change_nothing_is_refused_before_the_job(
    tmp_path, fault, params, sets, field
):
    proc = cli(
        "inject",
        DEFAULT,
        *SHORT,
        *sets,
        "--fault",
        fault,
        "--step",
        2,
        "--rank",
        0,
        *params,
        "--out",
        tmp_path / "runs",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and field in proc.stderr  # one line naming the field
    assert not list(tmp_path.rglob("rank-*.jsonl"))  # no job ran: no trajectory anywhere
    assert not (tmp_path / "runs").exists()


def test_parameter_names_match_the_built_model():
    """The torch-free name list that specs are checked against is the model's own (and the pipeline's split)."""
    from types import SimpleNamespace

    import torch

    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model
    from disttrace.model.names import parameter_names
    from disttrace.run.parallel.pp import stage_layers

    m = freeze(DEFAULT).manifest
    model = build_model(SimpleNamespace(**m["model"]), torch.float32)
    assert parameter_names(m["model"]) == [n for n, _ in model.named_parameters()]
    for pp in (2, 3):
        for stage in range(pp):
            layers = {
                n.split(".")[1]
                for n in parameter_names({"n_layers": 5}, pp, stage)
                if n.startswith("layers.")
            }
            assert layers == set(stage_layers(5, pp, stage))


# ---------------------------------------------------------------- the actual coordinates


def test_bitflip_grad_logs_the_element_it_flipped_when_the_index_wraps(ref, out):
    big = 10**9 + 7
    run = last_line(
        cli(
            "inject",
            DEFAULT,
            *SHORT,
            "--fault",
            "bitflip-grad",
            "--step",
            2,
            "--rank",
            1,
            "--param",
            f"element={big}",
            "--param",
            "bit=30",
            "--out",
            out,
            check=0,
        )
    )
    [e] = fired(run)
    numel = 64 * 64  # wq of the default model: dim x (n_heads * head_dim) = 64 x 64
    assert e["requested_element"] == big and e["element"] == big % numel and e["bit"] == 30
    assert (
        xor_bits32(e["before"], e["after"]) == 1 << 30
    )  # the values differ by exactly the flipped bit
    assert e["changed"] is True and e["digest_before"] != e["digest_after"]
    # the digests are of the tensor itself: before = the reference's record, after = the fault run's
    key = "1:layers.0.attention.wq.weight"
    assert e["digest_before"] == records(ref, 1, 2, "backward")[key]["digest"]
    assert e["digest_after"] == records(run, 1, 2, "backward")[key]["digest"]


# ---------------------------------------------------------------- the parameter server's master state


@pytest.mark.parametrize(
    "fault", ["bitflip-param", pytest.param("stale-param", marks=pytest.mark.slow)]
)
def test_parameter_server_faults_change_what_the_workers_receive(ps_ref, out, fault):
    """Fired at the last step on the server: only a change of the master state can reach rank 1 (a worker)
    within that step; a change of rank 0's local copy never leaves rank 0."""
    last = 4
    run = last_line(
        cli(
            "inject",
            DEFAULT,
            *SHORT,
            *PS,
            "--fault",
            fault,
            "--step",
            last,
            "--rank",
            0,
            "--out",
            out,
            check=0,
        )
    )
    [e] = fired(run)
    assert e["target"] == "master" and e["changed"] is True
    a, b = records(ps_ref, 1, last, "optimizer"), records(run, 1, last, "optimizer")
    assert a.keys() == b.keys()
    params = [k for k in a if not k.split(":", 1)[1].count(":")]  # parameters, not optimizer state
    assert params and any(a[k]["digest"] != b[k]["digest"] for k in params)
    if fault == "bitflip-param":
        assert xor_bits32(e["before"], e["after"]) == 1 << 16
        k = f"{a[params[0]]['micro_batch']}:{e['tensor']}"
        assert a[k]["digest"] != b[k]["digest"]  # the flipped tensor itself reached the worker
