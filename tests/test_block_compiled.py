"""The compiled block decoder (store/blockdecode.py, the optional numba extra) against the pyarrow path of
store/trajectory.py as the oracle (itself held to pyarrow's reading of the whole file by test_block_decode):
on random stores of the writer's steps it decodes the block (it does not decline) into the batch the pyarrow
path gives; on mutated bytes (anywhere in a step: message headers, buffer descriptors, the LZ4 frames'
headers, tokens, literals and offsets) it either declines or gives what the pyarrow path gives, never a
batch where the pyarrow path refuses, and decode_steps' outcome (its batch, or its refusal naming the step)
is the same with it and without it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import test_diff_synthetic as syn
from test_block_decode import _steps
from test_trajectory_format import _realistic, every_kind, write_v2

from disttrace.errors import BadInput
from disttrace.store import trajectory

pytest.importorskip("numba")
from disttrace.store import blockdecode  # noqa: E402


def _short_names(records: list[dict]) -> list[dict]:
    """every_kind's records with its long phase and dtype cut to a string view's 12 inline bytes (a longer name
    has a data buffer, which the compiled decoder leaves to pyarrow)."""
    return [{**r, "phase": r["phase"][:12], "dtype": r["dtype"][:12]} for r in records]


def _random_steps(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for s in range(1, n + 1):
        kind = rng.random()
        if kind < 0.5:
            recs = _realistic(s, rng)
            recs = recs[: rng.randint(1, len(recs))]
        else:
            recs = _short_names(every_kind(s, seed=rng.randrange(100)))
            rng.shuffle(recs)
            recs = recs[: rng.randint(1, len(recs))]
            recs = [{**r, "index": i} for i, r in enumerate(recs)]
        out.append(recs)
    return out


def _outcome(fn, *args):
    try:
        return fn(*args)
    except (BadInput, *trajectory._DECODE_ERRORS) as e:
        return e


def _same(a: pa.RecordBatch, b: pa.RecordBatch) -> bool:
    """The same records (Arrow's equals holds a NaN unequal to itself, and a flipped byte makes NaNs)."""
    return a.schema.equals(b.schema) and repr(a.to_pylist()) == repr(b.to_pylist())


def _pyarrow(block: list[bytes]):
    return _outcome(trajectory._decode_block, block)


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_decode_as_the_pyarrow_path(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, _random_steps(rng, rng.randint(2, 12))))
    for lo in (0, 1):  # from the file's first step (its schema message) and from a later one
        block = [d for d, _ in parts[lo:]]
        assert blockdecode.kernel_status(block) == 0, blockdecode.DECLINED.get(
            blockdecode.kernel_status(block)
        )
        got, starts = blockdecode.decode(block)
        want, want_starts = trajectory._decode_block(block)
        assert got.schema.equals(trajectory.SCHEMA)
        assert got.equals(want), seed
        assert starts.tolist() == want_starts.tolist()


def test_decode_steps_takes_it_for_large_blocks_of_a_large_job(tmp_path, monkeypatch):
    """decode_steps takes the compiled path for a block of COMPILED_MIN bytes or more once the process has
    decoded COMPILED_AFTER bytes with pyarrow (numba's import is paid by large jobs only), pyarrow's below;
    DISTTRACE_BLOCK=0 keeps pyarrow's for every block, DISTTRACE_BLOCK=1 takes the compiled one at once."""
    rng = random.Random(9)
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [_realistic(s, rng) for s in range(1, 40)]))
    # the default bound, also where the suite runs with DISTTRACE_BLOCK=1 (which sets it to 0)
    monkeypatch.setattr(trajectory, "COMPILED_MIN", 1 << 16)
    calls = []
    real = blockdecode.decode
    monkeypatch.setattr(
        trajectory, "_kernel", lambda block: calls.append(len(block)) or real(block)
    )
    size = sum(len(d) for d, _ in parts)
    assert size >= trajectory.COMPILED_MIN
    monkeypatch.setattr(trajectory, "_work", [0])
    monkeypatch.setattr(trajectory, "COMPILED_AFTER", size)
    small = parts[:2]
    assert sum(len(d) for d, _ in small) < trajectory.COMPILED_MIN
    first, _ = trajectory.decode_steps(path, parts)  # the job's first bytes: pyarrow's
    assert calls == [] and trajectory._work == [size]
    for _ in range(2):
        trajectory.decode_steps(path, small)  # small: pyarrow's, however large the job
    assert calls == []
    batch, _ = trajectory.decode_steps(path, parts)
    assert calls == [len(parts)]
    assert batch.equals(first)
    code = "from disttrace.store import trajectory as t; print(t.COMPILED_AFTER, t.COMPILED_MIN, t._compiled() is None)"
    for value, want in (("0", f"{128 << 20} {1 << 16} True"), ("1", "0 0 False")):
        env = {**os.environ, "DISTTRACE_BLOCK": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.split() == want.split(), out.stderr


def test_a_numeric_diff_says_how_much_it_will_decode(tmp_path, monkeypatch):
    """A numeric diff of every step tells the decoder the bytes it is about to read: both runs' step ranges
    where their digests differ (here every step of both trajectories, the files less their end-of-stream
    markers), and nothing for runs whose steps are all equal (skipped unread)."""
    from disttrace.analysis.diff import diff_runs

    m = syn.manifest(**{"training.steps": 4})
    recs = syn.gen_records(m, range(1, 5))
    a = syn.write_run(tmp_path / "a", m, recs)
    same = syn.write_run(tmp_path / "same", m, recs)
    for rank_recs in recs.values():  # every value rounded differently: every step's digests differ
        for r in rank_recs:
            if r["phase"] != "data":
                r["sum"] *= 1 + 1e-12
                r["digest"] = syn.digest(r)
    b = syn.write_run(tmp_path / "b", m, recs)
    files = [p for run in (a, b) for p in sorted((run / "trajectory").glob("rank-*.arrows"))]
    told = []
    monkeypatch.setattr(trajectory, "expect", told.append)
    diff_runs(a, b, mode="numeric")
    diff_runs(a, same, mode="numeric")
    assert told == [sum(p.stat().st_size - len(trajectory.END_OF_STREAM) for p in files), 0]


def _mutate(rng: random.Random, block: list[bytes]) -> list[bytes]:
    out = [bytearray(d) for d in block]
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(out))
        at = rng.randrange(len(out[i]))
        how = rng.random()
        if how < 0.6:
            out[i][at] = rng.choice(
                [0, 0xFF, rng.randrange(256), out[i][at] ^ (1 << rng.randrange(8))]
            )
        elif how < 0.8:  # a little-endian word nudged: a length, an offset, a count
            at -= at % 4
            word = int.from_bytes(out[i][at : at + 4], "little")
            word = (word + rng.choice([-8, -1, 1, 8, 1 << 16])) % (1 << 32)
            out[i][at : at + 4] = word.to_bytes(4, "little")[: len(out[i]) - at]
        elif how < 0.9:  # a byte dropped or added
            if rng.random() < 0.5:
                del out[i][at]
            else:
                out[i].insert(at, rng.randrange(256))
        else:
            del out[i][at:]
    return [bytes(x) for x in out]


def mutation_trials(seed: int, trials: int, tmp: Path) -> tuple[int, int, int]:
    """(declined, accepted, accepted with a changed batch): every outcome held to the pyarrow path's."""
    rng = random.Random(seed)
    path = tmp / "rank-00000.arrows"
    steps = _random_steps(rng, 5)
    parts = _steps(path, write_v2(path, steps))[1:]
    good = [d for d, _ in parts]
    reference = trajectory._decode_block(good)[0]
    declined = accepted = changed = 0
    for trial in range(trials):
        block = _mutate(rng, good)
        got = blockdecode.decode(block)
        want = _pyarrow(block)
        if got is None:
            declined += 1
        else:
            assert isinstance(want, tuple), (trial, want)  # never a batch the pyarrow path refuses
            assert _same(got[0], want[0]) and got[1].tolist() == want[1].tolist(), trial
            accepted += 1
            changed += not _same(got[0], reference)
        named = [(d, w) for d, (_, w) in zip(block, parts)]
        old = trajectory._kernel
        try:
            trajectory._kernel = blockdecode.decode
            with_it = _outcome(trajectory.decode_steps, path, named)
            trajectory._kernel = False
            without = _outcome(trajectory.decode_steps, path, named)
        finally:
            trajectory._kernel = old
        if isinstance(without, tuple):
            assert _same(with_it[0], without[0]), trial
        else:
            assert str(with_it) == str(without), trial
    return declined, accepted, changed


def test_mutated_blocks_decline_or_decode_as_the_pyarrow_path(tmp_path, monkeypatch):
    monkeypatch.setattr(trajectory, "COMPILED_MIN", 0)
    monkeypatch.setattr(trajectory, "COMPILED_AFTER", 0)
    declined, accepted, changed = mutation_trials(1, 150, tmp_path)
    # both ways exercised: flipped literals decode (to other values, as pyarrow reads them), the rest declines
    assert declined > 25 and accepted > 10 and changed > 5, (declined, accepted, changed)


@pytest.mark.slow  # a fresh interpreter compiling the kernels again with bounds checks: ~30 s
def test_mutated_blocks_read_nothing_out_of_bounds(tmp_path):
    """The same trials with numba's bounds checking on (NUMBA_BOUNDSCHECK=1: an index out of any array raises
    IndexError instead of reading past it), so the kernels' own checks are shown to keep every access in
    range, not merely to give pyarrow's answer."""
    env = {
        **os.environ,
        "NUMBA_BOUNDSCHECK": "1",
        "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = (
        "import sys, pathlib, test_block_compiled as t\n"
        "from disttrace.store import trajectory\n"
        "trajectory.COMPILED_MIN = trajectory.COMPILED_AFTER = 0\n"
        "for seed in (2, 3):\n"
        "    print(t.mutation_trials(seed, 300, pathlib.Path(sys.argv[1])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IndexError" not in proc.stderr
    assert len(proc.stdout.split("\n")) >= 2


def test_a_block_with_long_names_is_left_to_pyarrow(tmp_path):
    """every_kind's phase and dtype longer than 12 bytes: the compiled decoder declines, the block decodes."""
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [every_kind(s) for s in (1, 2, 3)]))
    block = [d for d, _ in parts]
    assert blockdecode.decode(block) is None
    assert isinstance(_pyarrow(block)[0], pa.RecordBatch)


def test_a_shape_dictionary_that_expands_without_bound_declines(tmp_path, monkeypatch):
    """The compiled path holds a step's dimensions to the pyarrow path's bound: it declines the step whose
    records all take one shape of 200 dimensions (36,000 for ~180 records), and decode_steps then refuses it as
    the pyarrow path does."""
    monkeypatch.setattr(trajectory, "COMPILED_MIN", 0)
    monkeypatch.setattr(trajectory, "COMPILED_AFTER", 0)
    recs = _realistic(1, random.Random(3))
    path = tmp_path / "rank-00000.arrows"
    long = [[{**r, "step": s, "shape": [1] * 200, "numel": 1} for r in recs] for s in (1, 2)]
    parts = _steps(path, write_v2(path, long))
    block = [d for d, _ in parts]
    assert blockdecode.kernel_status(block) == 14, blockdecode.DECLINED.get(
        blockdecode.kernel_status(block)
    )
    with pytest.raises(BadInput, match="dimensions in all"):
        trajectory.decode_steps(path, parts)
