"""Several steps of a trajectory decoded as one block (store/trajectory_decode.py, `decode_steps`), against pyarrow's
own reading of the whole file as the oracle, and against each step decoded alone; a malformed step inside a
block is refused, named, as it is alone, and `disttrace diff` exits 2 on it.

The oracle's conversion to the readers' columns is written here from the layout's definition (phase and
dtype as strings, shape as a list, numel its product, the shard list cut in half), not taken from the code
under test.

Each test of decode_steps runs two ways (the `decoder` fixture): the pyarrow path alone, and the C kernels
(store/blockdecode.py) ahead of it from the first block of two steps, skipped where they are not built.
"""

from __future__ import annotations

import math
import random
from functools import partial
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import test_diff_synthetic as syn
from conftest import cli
from test_trajectory_format import (
    _realistic,
    _shapes,
    _v2_step,
    every_kind,
    write_v1,
    write_v2,
)

from disttrace.errors import BadInput
from disttrace.store import trajectory, trajectory_decode, trajectory_frames, trajectory_read


def block_kernels():
    """store/blockdecode.py's C kernels, or the test skipped where they are not built (or DISTTRACE_NATIVE=0)."""
    # the module raises ImportError where the C kernels are not there (pytest skips only a missing module
    # unless told)
    blockdecode = pytest.importorskip("disttrace.store.blockdecode", exc_type=ImportError)
    return blockdecode.c_kernels()


@pytest.fixture(params=["pyarrow", "c"])
def decoder(request, monkeypatch):
    """decode_steps' decoder: the pyarrow path alone, or the C kernels ahead of it for every block of two
    steps or more (declining to the pyarrow path as it does)."""
    if request.param == "pyarrow":
        monkeypatch.setattr(trajectory_decode, "_kernel", False)
        return None
    k = block_kernels()
    from disttrace.store import blockdecode

    monkeypatch.setattr(trajectory_decode, "_kernel", partial(blockdecode.decode, kernels=k))
    return k


def _oracle(path: Path) -> list[dict]:
    """Every record of the file as pyarrow reads the stream, in the readers' columns."""
    rows = ipc.open_stream(path.read_bytes()).read_all().to_pylist()
    for r in rows:
        if "shard" in r:
            shard = r.pop("shard")
            half = None if shard is None else len(shard) // 2
            r["shard_offset"] = None if shard is None else shard[:half]
            r["shard_shape"] = None if shard is None else shard[half:]
            r["numel"] = math.prod(r["shape"])
    return [{k: r[k] for k in trajectory.FIELDS} for r in rows]


def _steps(path: Path, ranges) -> list[tuple[bytes, str]]:
    data = path.read_bytes()
    return [(data[o : o + n], f"step {i + 1}") for i, (o, n) in enumerate(ranges)]


def _mixed_steps() -> list[list[dict]]:
    """Steps of every kind of record, of different sizes and dictionaries, one of them empty."""
    rng = random.Random(5)
    steps = [every_kind(1), _realistic(2, rng), every_kind(3, seed=2), [], _realistic(5, rng)]
    steps[1] = steps[1][:37]  # another length, fewer distinct shapes
    return steps


@pytest.mark.parametrize("layout", [1, 2])
def test_a_block_decodes_as_pyarrow_reads_the_file(tmp_path, layout, decoder):
    steps = _mixed_steps()
    path = tmp_path / "rank-00000.arrows"
    ranges = (write_v1 if layout == 1 else write_v2)(path, steps)
    batch, starts = trajectory_decode.decode_steps(path, _steps(path, ranges))
    assert batch.schema.equals(trajectory.SCHEMA)
    assert batch.to_pylist() == _oracle(path)
    assert starts.tolist() == [sum(map(len, steps[:i])) for i in range(len(steps))]
    # any part of the file's steps, not only from its first (which holds the schema message)
    tail, tail_starts = trajectory_decode.decode_steps(path, _steps(path, ranges)[2:])
    assert tail.to_pylist() == _oracle(path)[starts[2] :]
    assert tail_starts.tolist() == (starts[2:] - starts[2]).tolist()


def test_a_block_equals_its_steps_decoded_alone(tmp_path, monkeypatch, decoder):
    steps = _mixed_steps()
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, steps))
    alone = [trajectory_decode.decode_step(path, d, w) for d, w in parts]
    with monkeypatch.context() as mp:  # decoded as a block, not step by step (the refusal's path)
        mp.setattr(trajectory_decode, "decode_step", lambda *a: pytest.fail("decoded step by step"))
        batch, _ = trajectory_decode.decode_steps(path, parts)
    assert batch.equals(pa.concat_batches(alone))
    assert [trajectory_read.to_records(b) for b in alone] == steps  # the records as written


def test_every_rank_of_a_real_store_decodes_as_pyarrow_reads_it(runs, decoder):
    run = runs.reference()
    files = sorted((run / "trajectory").glob("rank-*.arrows"))
    assert len(files) >= 2
    for path in files:
        index = [
            orjson.loads(x) for x in path.with_name(path.stem + ".steps.jsonl").read_bytes().split()
        ]
        assert len(index) >= 2
        parts = _steps(path, [(e["offset"], e["length"]) for e in index])
        batch, starts = trajectory_decode.decode_steps(path, parts)
        assert batch.to_pylist() == _oracle(path)
        assert (starts[1:] - starts[:-1]).tolist() == [e["records"] for e in index[:-1]]


def _forged_size(data: bytes) -> bytes:
    """The step with the first LZ4 frame's length prefix (Arrow's, before the frame) set to 2**40."""
    out = bytearray(data)
    frame = data.find(b'\x04"M\x18')
    out[frame - 8 : frame] = (2**40).to_bytes(8, "little")
    return bytes(out)


def _without_schema(step: bytes) -> bytes:
    r = pa.BufferReader(step)
    ipc.read_message(r)
    return step[r.tell() :]


def _crafted() -> dict[str, tuple[bytes, str]]:
    """Steps each refused alone (the crafted cases of test_trajectory_format), as a later step's bytes."""
    cases = {
        "index out of the dictionary": ({"shape": _shapes([0, 0, 5], [[4]], safe=False)}, None),
        "odd shard": ({"shard": pa.array([[1, 2, 3], None, None], pa.list_(pa.int64()))}, None),
        "shape product overflows": ({"shape": _shapes([0, 0, 0], [[2**40, 2**40]])}, None),
        "zstd": ({}, ipc.IpcWriteOptions(compression="zstd")),
    }
    out = {
        k: (_without_schema(_v2_step(cols, 3, options)), "not a trajectory record batch")
        for k, (cols, options) in cases.items()
    }
    out["forged size"] = (_forged_size(_without_schema(_v2_step({}, 3))), "says it holds")
    good = _without_schema(_v2_step({}, 3))
    out["two batches"] = (good + good[len(_dictionary(good)) :], "not a trajectory record batch")
    out["torn"] = (good[: len(good) - 40], "not a trajectory record batch")
    return out


def _dictionary(step: bytes) -> bytes:
    r = pa.BufferReader(step)
    ipc.read_message(r)
    return step[: r.tell()]


@pytest.mark.parametrize("case", sorted(_crafted()))
def test_a_malformed_step_inside_a_block_is_refused_and_named(tmp_path, case, decoder):
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [every_kind(s) for s in (1, 2, 3, 4)]))
    bad, message = _crafted()[case]
    with pytest.raises(BadInput, match=message) as alone:
        trajectory_decode.decode_step(path, bad, "step 3")
    parts[2] = (bad, "step 3")
    with pytest.raises(BadInput) as block:
        trajectory_decode.decode_steps(path, parts)
    assert str(block.value) == str(alone.value) and "step 3" in str(block.value)
    assert str(path) in str(block.value)


def test_diff_exits_2_naming_a_malformed_step_in_the_middle_of_a_block(tmp_path):
    """A numeric diff of runs that differ at every step reads each rank's steps as one block; a step in the
    middle of it whose compressed buffer claims 2**40 bytes is refused before anything is allocated, naming
    the file and the step. The control: the same pair unforged compares equal."""
    m = syn.manifest(**{"training.steps": 6})
    recs = syn.gen_records(m, range(1, 7))
    a = syn.write_run(tmp_path / "a", m, recs)
    for rank_recs in recs.values():  # every value rounded differently: every step is read
        for r in rank_recs:
            if r["phase"] != "data":
                r["sum"] *= 1 + 1e-12
                r["digest"] = syn.digest(r)
    b = syn.write_run(tmp_path / "b", m, recs)
    ok = cli("diff", a, b, "--mode", "numeric", "--json")
    assert ok.returncode == 0, ok.stderr
    assert orjson.loads(ok.stdout)["stats"]["steps_read"] == 12  # every step of both ranks
    traj = b / "trajectory" / "rank-00001.arrows"
    index = [orjson.loads(x) for x in traj.with_name("rank-00001.steps.jsonl").read_bytes().split()]
    e = index[3]  # step 4
    data = bytearray(traj.read_bytes())
    data[e["offset"] : e["offset"] + e["length"]] = _forged_size(
        bytes(data[e["offset"] : e["offset"] + e["length"]])
    )
    traj.write_bytes(bytes(data))
    for args in ((a, b), (b, a)):
        proc = cli("diff", *args, "--mode", "numeric", "--json")
        assert proc.returncode == 2, proc.stderr
        assert "rank-00001.arrows" in proc.stderr and "step 4" in proc.stderr, proc.stderr
        assert "says it holds" in proc.stderr and proc.stdout == ""


def test_null_shapes_and_null_indices_decode_as_pyarrow_reads_them(tmp_path, decoder):
    """The writer never stores a null shape, but a reader must not stumble on one: a null dictionary entry
    and a null index both read as a null shape without numel, alone and inside a block."""
    crafted = _v2_step({"shape": _shapes([0, None, 1], [[2, 3], None])}, 3)
    batch = trajectory_decode.decode_step(tmp_path / "x.arrows", crafted, "step 1")
    assert batch.column("shape").to_pylist() == [[2, 3], None, None]
    assert batch.column("numel").to_pylist() == [6, None, None]
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [every_kind(1), every_kind(2)]))
    parts.insert(1, (_without_schema(crafted), "step 9"))
    block, starts = trajectory_decode.decode_steps(path, parts)
    rows = block.slice(int(starts[1]), 3)
    assert rows.column("shape").to_pylist() == [[2, 3], None, None]
    assert rows.column("numel").to_pylist() == [6, None, None]


def test_the_block_checks_refuse_on_their_own(tmp_path):
    """The block's own checks (the buffers' declared sizes read for all steps at once, the shapes' products
    over every step's dictionary), before any step-by-step decoding names the step."""
    path = tmp_path / "rank-00000.arrows"
    good = [d for d, _ in _steps(path, write_v2(path, [every_kind(s) for s in (1, 2, 3)]))]
    for bad, message in (
        (_forged_size(_without_schema(_v2_step({}, 3))), "says it holds"),
        (
            _without_schema(_v2_step({"shape": _shapes([0, 0, 0], [[2**40, 2**40]])}, 3)),
            "overflows int64",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            trajectory_decode._decode_block([good[0], bad, good[2]])
    trajectory_decode._decode_block(good)  # and the honest block passes them


def _list_array(entries: list, gaps: bool) -> pa.ListArray:
    """A list<int64> array of `entries` (None: a null shape); with gaps, every null entry still spans values
    (allowed by Arrow, never written by disttrace)."""
    offsets, values, mask = [0], [], []
    for e in entries:
        values += e if e is not None else ([7, 7] if gaps else [])
        offsets.append(len(values))
        mask.append(e is None)
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values, pa.int64()), mask=pa.array(mask, pa.bool_())
    )


@pytest.mark.parametrize(
    "size", [5, 150]
)  # a step's few shapes (a loop) and a block's many (numpy)
def test_shape_products_are_math_prod(size):
    rng = random.Random(size)
    dims = [0, 1, 2, 3, 2**20, 2**31, -5, 2**62, -(2**63)]
    for trial in range(300):
        entries = [
            None if rng.random() < 0.15 else [rng.choice(dims) for _ in range(rng.randint(0, 4))]
            for _ in range(rng.randint(0, size))
        ]
        arr = _list_array(entries, gaps=trial % 2 == 1)
        if entries and trial % 3 == 0:
            arr, entries = arr.slice(1), entries[1:]
        want = [None if e is None else math.prod(e) for e in entries]
        overflow = any(w is not None and not -(2**63) <= w < 2**63 for w in want)
        if overflow:
            with pytest.raises(ValueError, match="overflows int64"):
                trajectory_decode._products(arr)
            continue
        numel, known = trajectory_decode._products(arr)
        assert [int(v) if k else None for v, k in zip(numel, known)] == want


def _headers_of(step: bytes) -> list[tuple[int, int]]:
    """Where each message's prefix and flatbuffer header lie in a step's bytes (pyarrow's framing)."""
    r, out = pa.BufferReader(step), []
    while r.tell() < len(step):
        at = r.tell()
        m = ipc.read_message(r)
        out.append((at, at + 8 + m.metadata.size))
    return out


def _outcome(fn, *args):
    try:
        return fn(*args)
    except (BadInput, *trajectory_decode._DECODE_ERRORS) as e:
        return e


@pytest.mark.parametrize("layout", [1, 2])
def test_the_block_framing_reads_what_the_message_loop_reads(
    tmp_path, monkeypatch, layout, decoder
):
    """_frame_block reads every step's message headers at once; _frame_steps, the oracle, reads them message by
    message (pyarrow's reader for each message, the header's fields one by one). On the writer's own blocks
    the fast framing is taken; on blocks whose header bytes are changed (a flipped, zeroed or saturated byte
    in a message's prefix or flatbuffer) it gives the same layout, bytes and declared sizes as the loop or
    declines (None, for the loop to read), never less strict, and decode_steps returns the same batch or the
    same refusal with it as without it."""
    rng = random.Random(layout)
    path = tmp_path / "rank-00000.arrows"
    steps = [every_kind(1), _realistic(2, rng), every_kind(3, seed=2), _realistic(4, rng)]
    steps += [every_kind(s, seed=s) for s in range(5, 9)]
    parts = _steps(path, (write_v1 if layout == 1 else write_v2)(path, steps))[1:]
    good = [d for d, _ in parts]
    fast, slow = trajectory_frames._frame_block(good), trajectory_frames._frame_steps(good)
    assert fast is not None, "the writer's block takes the fast framing"
    assert fast[:2] == slow[:2] and fast[2].tolist() == slow[2].tolist()
    assert fast[0] == layout
    declined = agreed = refused = 0
    for trial in range(100):
        block = [bytearray(d) for d in good]
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(block))
            a, b = rng.choice(_headers_of(good[i]))
            block[i][rng.randrange(a, b)] = rng.choice([0, 0xFF, rng.randrange(256)])
        block = [bytes(x) for x in block]
        f = _outcome(trajectory_frames._frame_block, block)
        s = _outcome(trajectory_frames._frame_steps, block)
        if isinstance(f, Exception):  # the declared sizes refused: the loop refuses too
            assert isinstance(s, Exception), (trial, f)
            refused += 1
        elif f is None:
            declined += 1
        elif not isinstance(
            s, Exception
        ):  # (the loop's pyarrow may refuse a header the decoder then refuses)
            assert f[:2] == s[:2] and f[2].tolist() == s[2].tolist(), trial
            agreed += 1
        named = [(d, w) for d, (_, w) in zip(block, parts)]
        with_fast = _outcome(trajectory_decode.decode_steps, path, named)
        with monkeypatch.context() as mp:
            mp.setattr(trajectory_frames, "_frame_block", lambda _: None)
            without = _outcome(trajectory_decode.decode_steps, path, named)
        if isinstance(without, tuple):
            assert isinstance(with_fast, tuple), (trial, with_fast)
            assert with_fast[0].equals(without[0]) and with_fast[1].tolist() == without[1].tolist()
        else:
            assert str(with_fast) == str(without), trial
    assert declined and agreed and (refused or layout == 1), (declined, agreed, refused)


def test_a_shape_dictionary_that_expands_without_bound_is_refused(tmp_path, decoder):
    """A step's dictionary names each shape once, so a few KB on disk can give every record one shape of
    10,000 dimensions (160 MB of values for 2 x 1,000 records): refused, naming the step, where records of
    20 dimensions each (within the bound of 16 a record plus a few thousand) decode."""
    rng = random.Random(3)
    recs = _realistic(1, rng)
    ok, bomb = tmp_path / "ok.arrows", tmp_path / "bomb.arrows"
    wide = [[{**r, "step": s, "shape": [1] * 20, "numel": 1} for r in recs] for s in (1, 2)]
    parts = _steps(ok, write_v2(ok, wide))
    batch, _ = trajectory_decode.decode_steps(ok, parts)
    assert batch.num_rows == 2 * len(recs) and set(map(len, batch["shape"].to_pylist())) == {20}
    long = [[{**r, "step": s, "shape": [1] * 10_000, "numel": 1} for r in recs] for s in (1, 2)]
    parts = _steps(bomb, write_v2(bomb, long))
    assert bomb.stat().st_size < 64 << 10
    for block in (parts, parts[1:]):
        with pytest.raises(BadInput, match="dimensions in all") as e:
            trajectory_decode.decode_steps(bomb, block)
        assert block[0][1] in str(e.value)
