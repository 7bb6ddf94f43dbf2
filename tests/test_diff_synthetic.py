"""diff on synthetic run stores (no torch, fast): ordering, skipping, missing records, recovered and
incomplete runs, compatibility, numeric comparison across topologies, shards, propagation.

The run dirs are written here in the format the recorder writes (manifest.lock.json, run.json, the trajectory
through the recorder's own writer + .steps.jsonl with byte offsets and a digest of digests, COMPLETE). Every
test runs twice: on the Arrow stream (`rank-NNNNN.arrows`, compared column-wise where steps align) and on the
JSON lines of stores written before it (`rank-NNNNN.jsonl`, the record path)."""

from __future__ import annotations

import io
import math
import random
import sys
from pathlib import Path

import orjson
import pytest
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import synthetic  # noqa: E402

from disttrace.analysis import tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.errors import BadInput
from disttrace.store.records import PHASE_ORDER
from disttrace.views.diff import render_md, render_rich

FORMAT = {"suffix": ".arrows"}


@pytest.fixture(autouse=True, params=[".arrows", ".jsonl"], ids=["arrow", "jsonl"])
def trajectory_format(request):
    """Every test on both formats: the Arrow stream, and the JSON lines of stores written before it."""
    FORMAT["suffix"] = request.param
    yield request.param
    FORMAT["suffix"] = ".arrows"


# ---------------------------------------------------------------- building synthetic runs

# the benches' manifest (bench/synthetic.py), a tiny model, 2 ranks, 6 steps
BASE = synthetic.manifest(
    2,
    6,
    name="synthetic",
    **{
        "model.dim": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 4,
        "model.vocab_size": 256,
        "model.max_seq_len": 64,
        "model.ffn_hidden": 192,
    },
)
PARAMS = [
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.feed_forward.w1.weight",
    "norm.weight",
]
SHAPES = [[256, 64], [64, 64], [192, 64], [64]]


def manifest(**over) -> dict:
    """The base manifest with dotted overrides: manifest(**{"parallelism.dp": 1})."""
    return synthetic.overridden(BASE, **over)


def digest(rec: dict) -> str:
    return xxhash.xxh3_128_hexdigest(
        orjson.dumps(
            [
                rec["tensor"],
                rec["shape"],
                rec["sum"],
                rec["norm"],
                rec.get("shard"),
                rec.get("salt"),
            ]
        )
    )


def _stats(*key) -> tuple[float, float]:
    r = random.Random(repr(key))
    return r.uniform(-5, 5), r.uniform(1, 10)


def rec(step, mb, phase, rank, index, tensor, shape, key, **extra) -> dict:
    s, n = _stats(*key)
    r = {
        "step": step,
        "micro_batch": mb,
        "phase": phase,
        "rank": rank,
        "index": index,
        "tensor": tensor,
        "dtype": "float32",
        "shape": shape,
        "numel": math.prod(shape),
        "sum": s,
        "norm": n,
        "nonfinite": 0,
        **extra,
    }
    r["digest"] = digest(r)
    return r


def gen_records(m: dict, steps, ranks=None) -> dict[int, list[dict]]:
    """Records of a run: per rank, per step, in the recorder's order. Values of reduce/optimizer (the
    logical, topology-invariant tensors) depend only on (step, phase, tensor), so two topologies agree."""
    accum = m["training"]["grad_accum_steps"]
    ranks = range(m["parallelism"]["world_size"]) if ranks is None else ranks
    out = {}
    for rank in ranks:
        recs = []
        for step in steps:
            step_recs = []
            for mb in range(accum):
                step_recs.append(
                    rec(step, mb, "data", rank, 0, "inputs", [4, 64], (step, mb, rank, "data"))
                )
                for i, name in enumerate(["layers.0", "norm"]):
                    step_recs.append(
                        rec(step, mb, "forward", rank, i, name, [4, 64, 64], (step, mb, rank, name))
                    )
                step_recs.append(
                    rec(step, mb, "loss", rank, 0, "loss", [], (step, mb, rank, "loss"), tokens=256)
                )
                for i, name in enumerate(PARAMS):
                    step_recs.append(
                        rec(
                            step,
                            mb,
                            "backward",
                            rank,
                            i,
                            name,
                            SHAPES[i],
                            (step, mb, rank, "bw", name),
                        )
                    )
            last = accum - 1
            for i, name in enumerate(PARAMS):
                step_recs.append(
                    rec(step, last, "reduce", rank, i, name, SHAPES[i], (step, "reduce", name))
                )
            for i, name in enumerate(PARAMS):
                step_recs.append(
                    rec(step, last, "optimizer", rank, i, name, SHAPES[i], (step, "opt", name))
                )
            for i, name in enumerate(PARAMS):
                for slot, key in enumerate(("exp_avg", "exp_avg_sq")):
                    step_recs.append(
                        rec(
                            step,
                            last,
                            "optimizer",
                            rank,
                            len(PARAMS) + i * 4 + slot,
                            f"{name}:{key}",
                            SHAPES[i],
                            (step, "opt", name, key),
                        )
                    )
            step_recs.sort(key=lambda r: (r["micro_batch"], PHASE_ORDER[r["phase"]], r["index"]))
            recs.extend(step_recs)
        out[rank] = recs
    return out


def write_run(
    path,
    m: dict,
    records: dict[int, list[dict]],
    kind="reference",
    resume_step=None,
    complete=True,
    torn_rank=None,
    fault=None,
):
    """Write a run dir exactly like the recorder does; `torn_rank` gets half a line appended (a crash)."""
    resume = (
        {"checkpoint": f"checkpoints/step-{resume_step:06d}", "step": resume_step}
        if resume_step
        else None
    )
    synthetic.write_shared(path, m, kind, fault, resume, replicas=False)
    for rank, recs in records.items():
        by_step: dict[int, list[dict]] = {}
        for r in recs:
            by_step.setdefault(r["step"], []).append({k: v for k, v in r.items() if k != "salt"})
        if FORMAT["suffix"] == ".arrows":
            _arrow_steps(path, rank, by_step)
        else:
            data, index = _jsonl_steps(by_step)
            (path / f"trajectory/rank-{rank:05d}.jsonl").write_bytes(bytes(data))
            (path / f"trajectory/rank-{rank:05d}.steps.jsonl").write_bytes(bytes(index))
        if rank == torn_rank:  # half a line / part of a message (a crash)
            p = path / f"trajectory/rank-{rank:05d}{FORMAT['suffix']}"
            data = p.read_bytes()
            torn = (
                b'{"step": 99, "micro_batch": 0, "pha'
                if FORMAT["suffix"] == ".jsonl"
                else data[len(data) // 2 : len(data) // 2 + 100]
            )
            p.write_bytes(data + torn)
    if complete:
        (path / "COMPLETE").write_bytes(b"{}\n")
    return path


def _index_line(step, offset, length, srecs) -> bytes:
    """A step index line of a JSON-lines trajectory (stores of before the Arrow stream, and of the seal)."""
    return (
        orjson.dumps(
            {
                "step": step,
                "offset": offset,
                "length": length,
                "records": len(srecs),
                "digest": synthetic.digest_of_digests(r["digest"] for r in srecs),
                "time": {"start": 0.0, "end": 0.0},
            }
        )
        + b"\n"
    )


def _jsonl_steps(by_step) -> tuple[bytearray, bytearray]:
    data, index = bytearray(), bytearray()
    for step, srecs in by_step.items():
        lines = b"".join(orjson.dumps(r) + b"\n" for r in srecs)
        index += _index_line(step, len(data), len(lines), srecs)
        data += lines
    return data, index


def _arrow_steps(path, rank, by_step) -> None:
    """The recorder's writer (bench/synthetic.py), one record batch per step. The index lines are left
    unsealed (no step hash), as a store of before the seal: the tests of malformed steps edit the bytes,
    which a step hash would refuse before the decoder they test sees them."""
    f = synthetic.RankFiles(path, rank, sealed=False, times=False)
    for step, srecs in by_step.items():
        f.step(step, srecs, time={"start": 0.0, "end": 0.0})
    f.close()


def find(records, step, mb, phase, rank, index) -> dict:
    for r in records[rank]:
        if (r["step"], r["micro_batch"], r["phase"], r["index"]) == (step, mb, phase, index):
            return r
    raise KeyError((step, mb, phase, rank, index))


def plant(records, step, mb, phase, rank, index, factor=1.001, salt=None) -> dict:
    """Change one record: its statistics scaled by `factor` (and the digest with them), or only its bits
    (`salt`, statistics unchanged)."""
    r = find(records, step, mb, phase, rank, index)
    if salt is not None:
        r["salt"] = salt
    else:
        r["sum"] *= factor
        r["norm"] *= factor
    r["digest"] = digest(r)
    return r


@pytest.fixture
def pair(tmp_path):
    """Two identical reference runs (2 ranks, 6 steps, 1 micro-batch); returns a writer for run B."""
    m = manifest()
    a = write_run(tmp_path / "a", m, gen_records(m, range(1, 7)))

    def b(records=None, m_b=None, **kw):
        mm = m_b or m
        return write_run(
            tmp_path / "b",
            mm,
            records if records is not None else gen_records(mm, range(1, 7)),
            **kw,
        )

    return a, b, m


# ---------------------------------------------------------------- bitwise


def test_identical_runs_are_equal_and_read_nothing(pair):
    a, b, _ = pair
    r = diff_runs(a, b())
    assert r.equal is True and r.first_divergence is None and r.mode == "bitwise"
    assert r.propagation == [] and r.warnings == []
    assert r.compared_steps.to_dict() == {
        "first": 1,
        "last": 6,
        "count": 6,
        "why": "all 6 steps",
        "full": True,
    }
    assert r.stats.steps_read == 0  # every step skipped on the index digests
    assert r.a.kind == "reference" and r.b.complete is True and len(r.a.manifest_id) == 64
    orjson.dumps(r)  # one JSON document


def test_planted_difference_found_exactly(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    planted = plant(recs, 3, 0, "backward", 1, 2)
    r = diff_runs(a, b(recs))
    f = r.first_divergence
    assert not r.equal
    assert (f.step, f.micro_batch, f.phase, f.rank, f.index) == (
        3,
        0,
        "backward",
        1,
        2,
    )
    assert f.tensor == PARAMS[2] and f.missing_in is None and f.bound == 0.0
    assert f.b.digest == planted["digest"] and f.a.digest != planted["digest"]
    assert f.rel_err == pytest.approx(0.001 / 1.001)  # |dnorm| / max(norm_a, norm_b)
    assert (
        r.stats.steps_read == 1
    )  # only rank 1's step 3: everything else is skipped on the digests


def test_order_phase_before_rank_and_step_before_all(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 3, 0, "reduce", 0, 0)  # lower rank but later phase
    plant(recs, 3, 0, "backward", 1, 3)  # the winner: backward < reduce, whatever the rank
    plant(recs, 4, 0, "data", 0, 0)  # a later step: never first
    plant(recs, 3, 0, "backward", 1, 1, salt="bits only")  # same step/phase/rank, lower index: wins
    f = diff_runs(a, b(recs)).first_divergence
    assert (f.step, f.phase, f.rank, f.index) == (3, "backward", 1, 1)
    assert f.rel_err == 0.0  # bits differ, statistics do not


def test_micro_batch_orders_before_phase(tmp_path):
    m = manifest(
        **{"training.grad_accum_steps": 2, "parallelism.dp": 1, "training.micro_batch_size": 8}
    )
    recs_a = gen_records(m, range(1, 4))
    a = write_run(tmp_path / "a", m, recs_a)
    recs = gen_records(m, range(1, 4))
    plant(recs, 2, 1, "data", 0, 0)  # micro-batch 1: later, though its phase is earlier
    plant(recs, 2, 0, "loss", 0, 0)
    f = diff_runs(a, write_run(tmp_path / "b", m, recs)).first_divergence
    assert (f.step, f.micro_batch, f.phase) == (2, 0, "loss")


def test_record_missing_on_one_side(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    recs[0].remove(find(recs, 2, 0, "forward", 0, 1))
    r = diff_runs(a, b(recs))
    f = r.first_divergence
    assert (f.step, f.phase, f.rank, f.index, f.missing_in) == (
        2,
        "forward",
        0,
        1,
        "b",
    )
    assert f.b is None and f.a.digest
    r2 = diff_runs(r.b.path, a)  # the other way round
    assert r2.first_divergence.missing_in == "a"


def test_recovered_run_compares_from_its_resume_step(pair):
    a, b, m = pair
    r = diff_runs(a, b(gen_records(m, range(3, 7)), kind="recovered", resume_step=2))
    cs = r.compared_steps
    assert r.equal and (cs.first, cs.last, cs.count, cs.full) == (3, 6, 4, False)
    assert "recovered" in cs.why and "checkpoint of step 2" in cs.why
    assert r.b.resume_step == 2 and r.b.kind == "recovered"


def test_incomplete_run_with_torn_line_warns_not_fails(pair):
    a, b, m = pair
    r = diff_runs(a, b(gen_records(m, range(1, 5)), complete=False, torn_rank=1))
    cs = r.compared_steps
    assert r.equal and (cs.first, cs.last) == (1, 4)
    assert "run B is incomplete: stops at step 4" in cs.why
    assert any("torn" in w and f"rank-00001{FORMAT['suffix']}" in w for w in r.warnings)
    assert any("incomplete" in w for w in r.warnings)
    assert r.b.complete is False


def test_streaming_scan_agrees_with_index(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 5, 0, "optimizer", 1, 5)
    bb = b(recs, complete=False, torn_rank=0)
    r1, r2 = diff_runs(a, bb), diff_runs(a, bb, use_index=False)
    assert r1.first_divergence == r2.first_divergence
    assert r1.propagation == r2.propagation
    assert r2.stats.steps_read == 12 and r1.stats.steps_read == 1


def test_propagation_counts_and_recovery(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 3, 0, "backward", 1, 0, factor=1.5)
    plant(recs, 3, 0, "reduce", 1, 0)
    plant(recs, 4, 0, "optimizer", 0, 1, factor=1.01)
    plant(recs, 4, 0, "optimizer", 1, 1, factor=1.01)
    r = diff_runs(a, b(recs))
    prop = {e.step: e for e in r.propagation}
    assert sorted(prop) == [3, 4, 5, 6]
    n = len(gen_records(m, [1], ranks=[0])[0])
    s3 = prop[3].ranks
    assert s3[0].to_dict() == {"differing": 0, "total": n, "max_rel_err_by_phase": {}}
    assert s3[1].differing == 2 and s3[1].total == n
    assert s3[1].max_rel_err_by_phase["backward"] == pytest.approx(0.5 / 1.5)
    assert s3[1].max_rel_err_by_phase["reduce"] == pytest.approx(0.001 / 1.001)
    assert prop[4].ranks[0].differing == 1 and prop[4].ranks[1].differing == 1
    assert prop[4].differing == 2 and prop[5].equal and prop[6].equal
    assert r.recovered_steps == [5, 6]
    assert (
        r.stats.steps_read == 3
    )  # rank 1 at step 3, both ranks at step 4: equal ones are not read


def test_propagate_false_stops_at_first_divergent_step(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 2, 0, "loss", 0, 0)
    r = diff_runs(a, b(recs), propagate=False)
    assert [e.step for e in r.propagation] == [2]


# ---------------------------------------------------------------- compatibility


def test_edition_mismatch_is_bad_input_unless_allowed(pair):
    a, b, m = pair
    m2 = manifest(**{"experiment.edition": "v2"})
    bb = b(gen_records(m2, range(1, 7)), m_b=m2)
    with pytest.raises(BadInput) as e:
        diff_runs(a, bb)
    assert e.value.field == "experiment.edition" and e.value.exit_code == 2
    assert "manifest.lock.json" in str(e.value) and "'v2'" in str(e.value)
    r = diff_runs(a, bb, allow_edition_mismatch=True)
    assert r.equal and any("edition" in w for w in r.warnings)


def test_different_experiment_names_every_field(pair):
    a, b, m = pair
    m2 = manifest(**{"data.sha256": "c" * 64, "model.dim": 128, "training.lr": 2e-3})
    with pytest.raises(BadInput) as e:
        diff_runs(a, b(gen_records(m2, range(1, 7)), m_b=m2))
    msg = str(e.value)
    assert "\n" not in msg
    for f in ("data.sha256", "model.dim", "training.lr"):
        assert f in e.value.field and f in msg


def test_global_batch_must_match(pair):
    a, b, m = pair
    m2 = manifest(**{"training.micro_batch_size": 8})
    with pytest.raises(BadInput) as e:
        diff_runs(a, b(gen_records(m2, range(1, 7)), m_b=m2))
    assert "global_batch" in e.value.field and "8 vs 16" in str(e.value)


def test_not_a_run_dir(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(BadInput) as e:
        diff_runs(tmp_path / "x", tmp_path / "x")
    assert str(tmp_path / "x") in str(e.value)


def test_bitwise_across_topologies_refused(tmp_path):
    ma, mb = manifest(), manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2})
    a = write_run(tmp_path / "a", ma, gen_records(ma, range(1, 4)))
    b = write_run(tmp_path / "b", mb, gen_records(mb, range(1, 4)))
    with pytest.raises(BadInput) as e:
        diff_runs(a, b, mode="bitwise")
    assert "same topology" in str(e.value) and "parallelism.dp" in e.value.field
    assert diff_runs(a, b).mode == "numeric"


# ---------------------------------------------------------------- numeric


def _topologies(tmp_path, perturb=None, steps=4):
    """A: dp=2 (2 ranks, accumulation 1). B: dp=1 with accumulation 2. Same global batch."""
    ma, mb = manifest(), manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2})
    ra, rb = gen_records(ma, range(1, steps + 1)), gen_records(mb, range(1, steps + 1))
    if perturb:
        perturb(rb)
    return write_run(tmp_path / "a", ma, ra), write_run(tmp_path / "b", mb, rb), ma


def test_numeric_across_topologies_small_errors_are_equal(tmp_path):
    eps1 = tolerance.step_bound(manifest(), manifest(), "reduce")

    def perturb(rb):
        for r in rb[0]:
            if r["phase"] in ("reduce", "optimizer"):
                r["norm"] *= 1 + 0.1 * eps1  # well below the bound
                r["digest"] = digest(r)
            if r["phase"] == "backward":
                r["norm"] *= 2  # per-micro-batch local gradients are not compared across topologies
                r["digest"] = digest(r)

    a, b, m = _topologies(tmp_path, perturb)
    r = diff_runs(a, b)
    assert r.mode == "numeric" and r.equal, r.first_divergence
    assert r.compared_phases == ["reduce", "optimizer"]
    assert not any("'clip'" in w for w in r.warnings)  # neither side records clip: nothing to say
    bp = r.numeric.by_phase
    assert set(bp) == {"reduce", "optimizer"}
    assert bp["reduce"].max_rel_err == pytest.approx(0.1 * eps1, rel=1e-3)
    assert bp["reduce"].max_ratio <= 0.1 + 1e-9
    assert r.tolerance.kind == "derived" and r.tolerance.per_step == pytest.approx(eps1)


def test_numeric_across_topologies_above_bound_diverges(tmp_path):
    eps1 = tolerance.step_bound(manifest(), manifest(), "reduce")

    def perturb(rb):
        plant(
            rb, 3, 1, "optimizer", 0, len(PARAMS) + 4 + 1, factor=1 + 10 * 3 * eps1
        )  # 10x the step-3 bound

    a, b, m = _topologies(tmp_path, perturb)
    r = diff_runs(a, b)
    f = r.first_divergence
    assert not r.equal
    assert (f.step, f.phase, f.tensor, f.rank) == (
        3,
        "optimizer",
        f"{PARAMS[1]}:exp_avg_sq",
        0,
    )
    # k = 3 steps since the common initial state; x2 for a second moment (tolerance.tensor_factor); the
    # norm's term is reported, with both records' rounding of a recorded norm (0 for a tensor this small,
    # whose statistics are float64)
    rounding = 2 * tolerance.norm_rounding(f.b.dtype, f.b.shape)
    assert rounding < eps1 / 4
    assert f.bound == pytest.approx(2 * 3 * eps1 + rounding)
    x = 10 * 3 * eps1
    assert f.rel_err == pytest.approx(x / (1 + x))
    # the other way round: B (dp=2) holds replicas on ranks 0 and 1; each is compared
    r2 = diff_runs(b, a)
    assert (r2.first_divergence.step, r2.first_divergence.rank) == (3, 0)
    assert r2.propagation[0].ranks[1].differing == 1


def test_numeric_replica_on_one_rank_only(tmp_path):
    ma, mb = manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2}), manifest()
    ra, rb = gen_records(ma, range(1, 4)), gen_records(mb, range(1, 4))
    plant(rb, 2, 0, "reduce", 1, 3, factor=1.01)  # rank 1's copy of the reduced gradient drifted
    r = diff_runs(write_run(tmp_path / "a", ma, ra), write_run(tmp_path / "b", mb, rb))
    f = r.first_divergence
    assert (f.step, f.phase, f.rank, f.tensor) == (2, "reduce", 1, PARAMS[3])


def test_user_tolerance_overrides(tmp_path):
    def perturb(rb):
        plant(rb, 2, 1, "reduce", 0, 0, factor=1 + 1e-3)

    a, b, m = _topologies(tmp_path, perturb)
    assert not diff_runs(a, b).equal
    r = diff_runs(a, b, rtol=1e-2)
    assert r.equal and r.tolerance.to_dict() == {"kind": "user", "rtol": 1e-2, "atol": 0.0}
    r = diff_runs(a, b, rtol=1e-4)
    assert not r.equal and r.first_divergence.bound == pytest.approx(1e-4)


def test_numeric_same_topology_explicit(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 2, 0, "backward", 0, 1, factor=1 + 1e-9)
    r = diff_runs(a, b(recs), mode="numeric")
    assert r.equal and r.numeric.by_step[0].step == 2
    plant(recs, 4, 0, "forward", 1, 0, factor=1.1)
    import shutil

    shutil.rmtree(r.b.path)
    r = diff_runs(a, b(recs), mode="numeric")
    f = r.first_divergence
    assert (f.step, f.phase, f.rank) == (4, "forward", 1) and f.rel_err > f.bound > 0
    assert r.numeric.by_step[0].ranks[0].max_rel_err == pytest.approx(1e-9, rel=1e-3)


def test_data_must_be_exact_in_numeric_mode(pair):
    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 2, 0, "data", 1, 0, factor=1 + 1e-12)
    f = diff_runs(a, b(recs), mode="numeric").first_divergence
    assert (f.step, f.phase, f.bound) == (2, "data", 0.0)


def test_nonfinite_is_a_divergence(tmp_path):
    def perturb(rb):
        r = find(rb, 2, 1, "reduce", 0, 2)
        r.update(sum=None, norm=None, nonfinite=7)
        r["digest"] = digest(r)

    a, b, m = _topologies(tmp_path, perturb)
    r = diff_runs(a, b)
    f = r.first_divergence
    assert (f.step, f.phase, f.index) == (2, "reduce", 2)
    assert f.rel_err is None and f.b.nonfinite == 7 and f.note == "non-finite values"
    assert r.propagation[0].ranks[0].hard == 1


# ---------------------------------------------------------------- shards


def shard_records(
    m: dict, steps, shard_ranks: dict[int, int], tamper=None
) -> dict[int, list[dict]]:
    """Like gen_records, but every optimizer-phase tensor is split in two halves along dim 0:
    rank -> which half it holds (two ranks may hold the same half: a replicated shard)."""
    base = gen_records(m, steps)
    out = {}
    for rank, recs in base.items():
        new = []
        for r in recs:
            if r["phase"] != "optimizer":
                new.append(r)
                continue
            half = shard_ranks[rank]
            shape = r["shape"]
            rows = shape[0] // 2
            sshape = [rows, *shape[1:]]
            # split the logical statistics: sums add up, norms add in squares
            s0, s1 = r["sum"] * 0.3, r["sum"] * 0.7
            n0, n1 = r["norm"] * 0.6, r["norm"] * 0.8  # 0.36 + 0.64 = 1
            sh = dict(
                r,
                tensor=r["tensor"],
                shape=sshape,
                numel=math.prod(sshape),
                sum=(s0, s1)[half],
                norm=(n0, n1)[half],
                shard={"offset": [half * rows] + [0] * (len(shape) - 1), "logical_shape": shape},
            )
            if tamper:
                tamper(rank, sh)
            sh["digest"] = digest(sh)
            new.append(sh)
        out[rank] = new
    return out


def test_sharded_records_combine_into_the_logical_tensor(tmp_path):
    ma = manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2})
    # B: dp=2 x tp=2 = 4 ranks, micro-batch 4, accumulation 1; halves held by ranks (0,2) and (1,3)
    mb = manifest(**{"parallelism.tp": 2})
    a = write_run(tmp_path / "a", ma, gen_records(ma, range(1, 4)))
    b = write_run(tmp_path / "b", mb, shard_records(mb, range(1, 4), {0: 0, 1: 1, 2: 0, 3: 1}))
    r = diff_runs(a, b)
    assert r.equal, r.first_divergence
    opt = r.numeric.by_phase["optimizer"]
    assert opt.max_rel_err < 1e-15  # only float rounding of the split itself
    assert r.propagation == [] and not any("cover" in w for w in r.warnings)
    # a replicated shard's second copy (rank 2) is not counted twice: the combined norm would be off by far
    # a wrong shard on the lowest holder is a divergence, attributed to the lowest rank holding the tensor

    def tamper(rank, sh):
        if rank == 1 and sh["step"] == 2 and sh["index"] == 1:
            sh["sum"] += 1.0

    b2 = write_run(
        tmp_path / "b2", mb, shard_records(mb, range(1, 4), {0: 0, 1: 1, 2: 0, 3: 1}, tamper)
    )
    r2 = diff_runs(a, b2)
    f = r2.first_divergence
    assert (f.step, f.phase, f.index, f.rank) == (2, "optimizer", 1, 0)
    assert f.b.digest.startswith("shards:") and f.b.shape == SHAPES[1]
    # rank 3's copy of the same shard was not tampered: the replicas disagree, and diff says so
    assert any("rank 3's copy differs from rank 1's" in w for w in r2.warnings)


def test_missing_shard_is_reported(tmp_path):
    ma = manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2})
    mb = manifest(**{"parallelism.tp": 2})
    a = write_run(tmp_path / "a", ma, gen_records(ma, range(1, 3)))
    b = write_run(
        tmp_path / "b", mb, shard_records(mb, range(1, 3), {0: 0, 1: 0, 2: 0, 3: 0})
    )  # half 1 lost
    r = diff_runs(a, b)
    assert not r.equal and "shards incomplete" in r.first_divergence.note
    assert any("do not cover" in w for w in r.warnings)


# ---------------------------------------------------------------- tolerance


def test_tolerance_formula():
    m = manifest()
    u = 2.0**-24
    T = 8 * 64
    eps1 = 2 * u * (math.sqrt(T) + math.sqrt(192))
    assert tolerance.bound(m, m, 1, "reduce") == pytest.approx(eps1)
    assert tolerance.bound(m, m, 5, "optimizer") == pytest.approx(5 * eps1)
    assert tolerance.bound(m, m, 5, "optimizer", since=3) == pytest.approx(2 * eps1)
    assert tolerance.bound(m, m, 3, "data") == 0.0
    m64 = manifest(**{"training.dtype": "float64"})
    assert tolerance.bound(m64, m64, 1, "reduce") == pytest.approx(eps1 * 2.0**-29)
    assert tolerance.bound(m, m64, 1, "reduce") == pytest.approx(eps1)  # the coarser dtype counts
    assert (
        1e-6 < eps1 < 1e-5
    )  # measured float32 differences of 4e-8..4e-7: 1 to 3 orders of magnitude below


# ---------------------------------------------------------------- rendering


def test_render_rich_and_md(pair):
    from rich.console import Console

    a, b, m = pair
    recs = gen_records(m, range(1, 7))
    plant(recs, 3, 0, "backward", 1, 2)
    recs[0].remove(find(recs, 4, 0, "forward", 0, 1))
    for r in (diff_runs(a, a), diff_runs(a, b(recs))):
        buf = io.StringIO()
        render_rich(r, Console(file=buf, width=120, color_system=None))
        out = buf.getvalue()
        md = render_md(r)
        if r.equal:
            assert "EQUAL" in out and "equal" in md
        else:
            assert "FIRST DIVERGENCE" in out and "backward" in out and "rank 1" in out
            grid = [line for line in out.splitlines() if line.strip().startswith(("0  ", "1  "))]
            assert (
                grid[1].strip() == "1  ··3···"
            )  # rank 1: rel err 1e-3 at step 3, equal again after
            assert grid[0].strip() == "0  ···■··"  # rank 0: a record missing at step 4
            assert "| 3 | 1 | 1 / " in md and "First divergence" in md


def test_grid_is_capped(tmp_path):
    from rich.console import Console

    m = manifest(**{"training.steps": 100})
    a = write_run(tmp_path / "a", m, gen_records(m, range(1, 101), ranks=[0, 1]))
    recs = gen_records(m, range(1, 101), ranks=[0, 1])
    plant(recs, 90, 0, "loss", 0, 0)
    r = diff_runs(a, write_run(tmp_path / "b", m, recs))
    buf = io.StringIO()
    render_rich(r, Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "steps 85..100" in out and "grid shows 16 of 100" in out


def test_diff_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, disttrace.analysis.diff; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
