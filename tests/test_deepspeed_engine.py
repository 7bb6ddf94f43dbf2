"""disttrace attached to DeepSpeed's own engine (`disttrace[deepspeed]`): ZeRO stages 0-3 of one tiny model on
2 CPU ranks over gloo, run by torchrun as a user would. The oracles: DeepSpeed's stages train the same model
(so their logical tensors agree within the derived bound), a planted fault's (step, rank, phase), and the
flat ranges DeepSpeed partitions (torch's own flatten says which elements a range holds).

`make test` installs the extra; the end-to-end cases skip only when DeepSpeed cannot be imported, and say so.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
from pathlib import Path

import orjson
import pytest
import torch
from conftest import ROOT, cli, last_line
from launchers import deepspeed_cmd, job_env, launch, need_deepspeed, torchrun_cmd

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.diff.shards import _Logical
from disttrace.run.deepspeed import flat_boxes, pieces
from disttrace.run.record.digest import digest_tensor
from disttrace.store.rundir import Run

SCRIPT = str(ROOT / "tests" / "scripts" / "ds_train.py")
CMD = torchrun_cmd(SCRIPT)
PARAMS = {"inp.weight": [10, 6], "inp.bias": [10], "out.weight": [3, 10], "out.bias": [3]}


# ---------------------------------------------------------------- the default tier: no DeepSpeed needed


def test_a_flat_range_is_the_boxes_it_is_cut_into():
    """Every range of every small shape: the boxes, written into the tensor at their offsets, cover exactly the
    flattened elements torch's own flatten puts in the range, each box contiguous at its stated position."""
    for shape in ([7], [3, 5], [2, 3, 4], [2, 1, 3, 2]):
        n = math.prod(shape)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            mark = torch.zeros(shape, dtype=torch.int64)
            for offset, box, flat in flat_boxes(lo, hi, shape):
                sl = tuple(slice(o, o + b) for o, b in zip(offset, box))
                assert (mark[sl] == 0).all(), (shape, lo, hi)  # no element twice
                mark[sl] = 1
                pos = torch.arange(n).view(shape)[sl].reshape(-1)
                assert pos.tolist() == list(
                    range(flat, flat + math.prod(box))
                )  # contiguous, in place
            want = torch.zeros(n, dtype=torch.int64)
            want[lo:hi] = 1
            assert torch.equal(mark.reshape(-1), want), (shape, lo, hi)
            assert len(flat_boxes(lo, hi, shape)) <= 2 * len(shape) - 1


def test_partition_pieces_combine_into_the_whole_tensor_as_diff_reads_them():
    """A tensor cut at an arbitrary flat point (as ZeRO partitions it over two ranks), each piece digested with
    its offset: diff's logical tensor of the pieces has the whole tensor's sum, norm and sketch."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(10, 6, generator=g)
    recs = []
    for rank, (lo, hi) in enumerate(((0, 31), (31, 60))):
        for _, name, box in pieces(0, 4, "w", t.reshape(-1)[lo:hi], lo, [10, 6]):
            place = box._disttrace_shard["shard"]
            recs.append(
                {
                    **digest_tensor(box, place["offset"], place["logical_shape"]),
                    "tensor": name,
                    "rank": rank,
                    "shard": place,
                }
            )
    logical = _Logical()
    logical.recs = recs
    value, _, complete = logical.value()
    whole = digest_tensor(t)
    assert complete and value["shape"] == [10, 6] and value["shards"] == len(recs) > 2
    assert math.isclose(value["sum"], whole["sum"], rel_tol=1e-6, abs_tol=1e-6)
    assert math.isclose(value["norm"], whole["norm"], rel_tol=1e-6)
    assert all(
        math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)
        for a, b in zip(value["sketch"], whole["sketch"])
    )


def test_a_deepspeed_format_checkpoint_is_verified_by_its_files_and_their_pickles(tmp_path):
    """The INDEX of a DeepSpeed checkpoint (format deepspeed) needs no DCP .metadata; its files are still
    hashed, and a torch.save archive naming a global outside tensors and DeepSpeed's records is refused unread."""
    from disttrace.errors import BadInput
    from disttrace.store.checkpoints import verify, write_index

    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(3)}}, ckpt / "mp_rank_00_model_states.pt")
    write_index(ckpt, 1, "m" * 64, 2, ["model", "optim"], fmt="deepspeed")
    assert verify(ckpt)["format"] == "deepspeed"
    write_index(
        ckpt, 1, "m" * 64, 2, ["model", "optim"]
    )  # the same files called DCP's: no .metadata
    with pytest.raises(BadInput, match="metadata"):
        verify(ckpt)
    torch.save({"x": os.system}, ckpt / "mp_rank_00_model_states.pt")
    write_index(ckpt, 1, "m" * 64, 2, ["model", "optim"], fmt="deepspeed")
    with pytest.raises(BadInput, match="system"):
        verify(ckpt)


# ---------------------------------------------------------------- end to end, on DeepSpeed itself


def _need_deepspeed():
    need_deepspeed("the DeepSpeed integration")


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> dict[int, Path]:
    _need_deepspeed()
    out = tmp_path_factory.mktemp("ds")
    return {s: launch(CMD, out, "--stage", s) for s in (0, 1, 2, 3)}


@pytest.mark.slow
def test_zero_stages_are_pairwise_equal_under_the_numeric_diff(stages):
    for a, b in itertools.combinations(sorted(stages), 2):
        d = diff_runs(stages[a], stages[b])
        assert d.mode == "numeric" and d.compared_steps.count == 3, (a, b, d.compared_steps)
        assert d.equal, (a, b, d.first_divergence)
        assert {"reduce", "clip", "optimizer"} <= set(d.compared_phases), (a, b)


@pytest.mark.slow
def test_every_stage_records_the_whole_optimizer_state_once_per_element(stages):
    """Each parameter's fp32 master and both Adam moments at every step: the ranks' pieces (whole tensors under
    stage 0) cover each logical tensor's elements exactly, by DeepSpeed's own partition of them."""
    for s, path in stages.items():
        run = Run(path)
        for step in (1, 2, 3):
            covered: dict[str, int] = {}
            for rank in run.ranks():
                for r in run.records(rank):
                    if r["step"] == step and r["phase"] == "optimizer":
                        covered[r["tensor"]] = covered.get(r["tensor"], 0) + r["numel"]
            for name, shape in PARAMS.items():
                copies = 2 if s == 0 else 1  # stage 0 holds everything on every rank
                for key in (name, f"{name}:exp_avg", f"{name}:exp_avg_sq"):
                    assert covered.get(key) == copies * math.prod(shape), (s, step, key, covered)


@pytest.mark.slow
def test_zero3_is_recorded_by_logical_names_and_shapes(stages):
    m = Run(stages[3]).manifest_doc
    assert m["parallelism"]["engine"] == "DeepSpeed" and m["parallelism"]["zero_stage"] == 3
    assert m["model"]["parameters"] == sum(math.prod(s) for s in PARAMS.values())
    assert {n: t["shape"] for n, t in m["model"]["tensors"].items()} == PARAMS
    assert m["model"] == Run(stages[0]).manifest_doc["model"]  # the same experiment as stage 0
    # nothing empty was recorded in its place
    assert all(r["numel"] > 0 for rank in (0, 1) for r in Run(stages[3]).records(rank))


@pytest.mark.slow
def test_check_is_quiet_on_clean_runs_of_every_stage(stages):
    for s, path in stages.items():
        proc = cli("check", path, "--json")
        assert proc.returncode == 0, (s, proc.stdout[-2000:])


def _inject(
    out: Path, fault: str, step: int, rank: int, *args, params=()
) -> subprocess.CompletedProcess:
    return cli(
        "inject",
        "--out",
        out,
        "--fault",
        fault,
        "--step",
        step,
        "--rank",
        rank,
        *[x for p in params for x in ("--param", p)],
        "--",
        *CMD,
        out,
        *map(str, args),
        timeout=900,
        env=job_env(),
    )


@pytest.mark.slow
def test_a_planted_bitflip_grad_is_located_at_its_step_rank_and_phase(stages, tmp_path):
    """Under ZeRO-2 (whose gradients DeepSpeed reduces in buckets during backward): the flip is planted at
    step 2, rank 1, the last micro-batch's local gradient; diff against the clean stage-2 run names it."""
    proc = _inject(tmp_path, "bitflip-grad", 2, 1, "--stage", 2, params=["tensor=inp.weight"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = last_line(proc)
    fired = [e for e in Run(run).events().records if e["event"] == "fault_fired"]
    assert [(e["step"], e["rank"], e["point"]) for e in fired] == [(2, 1, "backward")], fired
    f = diff_runs(stages[2], run).first_divergence
    assert (f.step, f.rank, f.phase, f.micro_batch) == (2, 1, "backward", 1), f
    # the control across stages: the same flip seen from the clean stage-0 run, where only the reduced
    # gradient is compared (numerically), first at the step it was planted
    d = diff_runs(stages[0], run)
    assert d.mode == "numeric" and not d.equal, d.first_divergence
    f = d.first_divergence
    assert (f.step, f.phase) == (2, "reduce"), f


def _digests(run: Path, step: int, rank: int) -> dict:
    """The rank's parameter pieces after the step (no optimizer state): (tensor, index) -> digest."""
    return {
        (r["tensor"], r["index"]): r["digest"]
        for r in Run(run).records(rank)
        if (r["step"], r["phase"]) == (step, "optimizer") and ":" not in r["tensor"]
    }


def _clip_scalar(run: Path, step: int, rank: int, name: str) -> float:
    (v,) = [
        r["sum"]
        for r in Run(run).records(rank)
        if (r["step"], r["phase"], r["tensor"]) == (step, "clip", name)
    ]
    return v


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,stage,rank,phase,tensor,acted",
    [
        # the reduced partition divided by the dp size a second time: DeepSpeed's norm is then another
        ("grad-scale", 1, 0, "reduce", None, "grad_norm"),
        # one step at 2 x the lr: the rank's lr scalar shows it, and its parameters after that step
        ("lr-skew", 3, 1, "clip", "lr", None),
    ],
)
def test_the_other_offered_faults_are_located_where_they_act(
    stages, tmp_path, fault, stage, rank, phase, tensor, acted
):
    proc = _inject(tmp_path, fault, 2, rank, "--stage", stage)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = last_line(proc)
    fired = [e for e in Run(run).events().records if e["event"] == "fault_fired"]
    assert [(e["step"], e["rank"]) for e in fired] == [(2, rank)], fired
    d = diff_runs(stages[stage], run)
    f = d.first_divergence
    assert not d.equal and (f.step, f.rank, f.phase) == (2, rank, phase), f
    assert tensor is None or f.tensor == tensor, f
    if acted:  # it changed what DeepSpeed computed, not only what was recorded
        assert _clip_scalar(run, 1, 0, acted) == _clip_scalar(stages[stage], 1, 0, acted)
        assert _clip_scalar(run, 2, 0, acted) != _clip_scalar(stages[stage], 2, 0, acted)
    else:  # the rank's fp32 master partition after step 2 moved by another amount
        assert _digests(run, 1, rank) == _digests(stages[stage], 1, rank)
        assert _digests(run, 2, rank) != _digests(stages[stage], 2, rank)


@pytest.mark.slow
def test_check_flags_a_rank_whose_replicated_parameter_drifted(tmp_path):
    """Stage 0: every rank holds every parameter, so a bit flipped in rank 1's copy after step 2 is a replica
    drift `check` finds without a reference, at that step and phase."""
    _need_deepspeed()
    proc = _inject(
        tmp_path, "bitflip-param", 2, 1, "--stage", 0, "--checkpoint", params=["tensor=out.weight"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = last_line(proc)
    proc = cli("check", run, "--json")
    first = orjson.loads(proc.stdout)["first"]
    assert proc.returncode == 1 and (first["step"], first["phase"]) == (2, "optimizer"), first
    # run.checkpoint() after step 2: DeepSpeed's own files, with our INDEX, verified; one byte changed is not
    ckpt = Run(run).path / "checkpoints" / "step-000002"
    index = orjson.loads((ckpt / "INDEX.json").read_bytes())
    assert index["format"] == "deepspeed" and index["step"] == 2 and len(index["files"]) >= 1
    assert cli("verify", run).returncode == 0
    listed = orjson.loads(cli("show", run, "checkpoints", "--json", check=0).stdout)["checkpoints"]
    assert [(c["step"], c["verified"]) for c in listed] == [(2, True)], listed
    victim = ckpt / sorted(index["files"])[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = cli("verify", run)
    assert proc.returncode != 0 and victim.name in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert cli("show", run, "checkpoints").returncode == 1


@pytest.mark.slow
def test_a_fault_without_a_deepspeed_point_is_refused(tmp_path):
    _need_deepspeed()
    proc = _inject(tmp_path, "skip-allreduce", 1, 0, "--stage", 2)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "DeepSpeed" in last and "--fault" in last, proc.stderr[-2000:]


@pytest.mark.slow
def test_the_deepspeed_launcher_runs_an_attached_script_as_torchrun_does(stages, tmp_path):
    """`disttrace run -- deepspeed --num_gpus 2 ...`: DeepSpeed's own launcher (its runner, then
    deepspeed.launcher.launch, which sets the ranks' environment and passes --local_rank) starts the same
    ZeRO-2 script; the run is the torchrun one's bit for bit."""
    proc = cli(
        "run",
        "--out",
        tmp_path,
        "--",
        *deepspeed_cmd(SCRIPT),
        tmp_path,
        "--stage",
        2,
        timeout=900,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Run(last_line(proc))
    assert run.complete and run.ranks() == [0, 1]
    assert run.manifest_doc["parallelism"]["engine"] == "DeepSpeed"
    assert run.manifest_doc["parallelism"]["zero_stage"] == 2
    d = diff_runs(stages[2], run.path, mode="bitwise")
    assert d.equal and d.compared_steps.count == 3, d.first_divergence
