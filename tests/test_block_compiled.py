"""The compiled block decoder (store/blockdecode.py: the C kernels) against the pyarrow path of
store/trajectory_decode.py as the oracle (itself held to pyarrow's reading of the whole file by test_block_decode):
on random stores of the writer's steps it decodes the block (it does not decline) into the batch the pyarrow
path gives; on mutated bytes (anywhere in a step: message headers, buffer descriptors, the LZ4 frames'
headers, tokens, literals and offsets) it either declines or gives what the pyarrow path gives, never a
batch where the pyarrow path refuses, and decode_steps' outcome (its batch, or its refusal naming the step)
is the same with it and without it. Skipped where the C extension is not built (or DISTTRACE_NATIVE=0).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_block_decode import _steps, block_kernels
from test_trajectory_format import _realistic, every_kind, write_v2

from disttrace.errors import BadInput
from disttrace.store import trajectory, trajectory_decode

blockdecode = pytest.importorskip("disttrace.store.blockdecode", exc_type=ImportError)


@pytest.fixture
def kernels():
    """The C kernels, as blockdecode.decode and decode_steps take them."""
    return block_kernels()


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
    except (BadInput, *trajectory_decode._DECODE_ERRORS) as e:
        return e


def _same(a: pa.RecordBatch, b: pa.RecordBatch) -> bool:
    """The same records (Arrow's equals holds a NaN unequal to itself, and a flipped byte makes NaNs)."""
    return a.schema.equals(b.schema) and repr(a.to_pylist()) == repr(b.to_pylist())


def _pyarrow(block: list[bytes]):
    return _outcome(trajectory_decode._decode_block, block)


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_decode_as_the_pyarrow_path(tmp_path, seed, kernels):
    rng = random.Random(seed)
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, _random_steps(rng, rng.randint(2, 12))))
    for lo in (0, 1):  # from the file's first step (its schema message) and from a later one
        block = [d for d, _ in parts[lo:]]
        assert blockdecode.kernel_status(block) == 0, blockdecode.DECLINED.get(
            blockdecode.kernel_status(block)
        )
        got, starts = blockdecode.decode(block)
        want, want_starts = trajectory_decode._decode_block(block)
        assert got.schema.equals(trajectory.SCHEMA)
        assert got.equals(want), seed
        assert starts.tolist() == want_starts.tolist()


def test_c_kernels_take_every_block_from_the_first(tmp_path, monkeypatch):
    """decode_steps takes the C kernels for every block of two steps or more, from the process's first,
    however small; one step alone stays pyarrow's."""
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [_realistic(s, random.Random(s)) for s in range(1, 5)]))
    calls = []
    real = blockdecode.decode
    monkeypatch.setattr(
        trajectory_decode, "_kernel", lambda block: calls.append(len(block)) or real(block)
    )
    small = parts[1:3]
    got, _ = trajectory_decode.decode_steps(path, small)
    assert calls == [2]
    trajectory_decode.decode_steps(path, parts[:1])
    assert calls == [2]
    assert got.equals(trajectory_decode._decode_block([d for d, _ in small])[0])


def test_the_switch_in_a_fresh_process():
    """The C kernels decode where built; DISTTRACE_NATIVE=0 leaves them out (the pyarrow path, the oracle)."""
    code = "from disttrace.store import trajectory_decode as t; print(t._compiled() is None, t.native_decoder())"
    for env, want in (({}, "False True"), ({"DISTTRACE_NATIVE": "0"}, "True False")):
        out = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
        )
        assert out.stdout.split() == want.split(), (env, out.stdout, out.stderr)


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
    reference = trajectory_decode._decode_block(good)[0]
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
        old = trajectory_decode._kernel
        try:
            trajectory_decode._kernel = blockdecode.decode
            with_it = _outcome(trajectory_decode.decode_steps, path, named)
            trajectory_decode._kernel = False
            without = _outcome(trajectory_decode.decode_steps, path, named)
        finally:
            trajectory_decode._kernel = old
        if isinstance(without, tuple):
            assert _same(with_it[0], without[0]), trial
        else:
            assert str(with_it) == str(without), trial
    return declined, accepted, changed


def test_mutated_blocks_decline_or_decode_as_the_pyarrow_path(tmp_path, kernels):
    declined, accepted, changed = mutation_trials(1, 150, tmp_path)
    # both ways exercised: flipped literals decode (to other values, as pyarrow reads them), the rest declines
    assert declined > 25 and accepted > 10 and changed > 5, (declined, accepted, changed)


def _large_steps(rng: random.Random, n: int) -> list[list[dict]]:
    """Steps of ~4,500 records (a 32-layer model's): buffers past one 64 KiB LZ4 block, which the writer
    compresses as frames of linked blocks."""
    out = []
    for s in range(1, n + 1):
        recs = [r for _ in range(25) for r in _realistic(s, rng)]
        out.append([{**r, "index": i} for i, r in enumerate(recs)])
    return out


def test_steps_of_linked_lz4_blocks_decode_as_the_pyarrow_path(tmp_path, kernels):
    """Real runs' steps hold buffers of more than 64 KiB, written as LZ4 frames of linked blocks (a match may
    reach into the blocks before it): decoded by the kernels (not declined) into the pyarrow path's batch;
    mutated, declined or decoded as the pyarrow path decodes them, never a batch where it refuses."""
    rng = random.Random(5)
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, _large_steps(rng, 3)))
    good = [d for d, _ in parts[1:]]
    assert any(b"\x04\x22\x4d\x18\x40\x40\xc0" in d for d in good)  # a linked frame's descriptor
    assert blockdecode.kernel_status(good) == 0, blockdecode.DECLINED.get(
        blockdecode.kernel_status(good)
    )
    got, starts = blockdecode.decode(good)
    want, want_starts = trajectory_decode._decode_block(good)
    assert got.equals(want) and starts.tolist() == want_starts.tolist()
    accepted = 0
    for trial in range(40):
        block = _mutate(rng, good)
        got = blockdecode.decode(block)
        if got is not None:
            want = _pyarrow(block)
            assert isinstance(want, tuple), (trial, want)
            assert _same(got[0], want[0]) and got[1].tolist() == want[1].tolist(), trial
            accepted += 1
    assert accepted > 0


def test_a_block_with_long_names_is_left_to_pyarrow(tmp_path, kernels):
    """every_kind's phase and dtype longer than 12 bytes: the compiled decoder declines, the block decodes."""
    path = tmp_path / "rank-00000.arrows"
    parts = _steps(path, write_v2(path, [every_kind(s) for s in (1, 2, 3)]))
    block = [d for d, _ in parts]
    assert blockdecode.decode(block) is None
    assert isinstance(_pyarrow(block)[0], pa.RecordBatch)


def test_a_shape_dictionary_that_expands_without_bound_declines(tmp_path, kernels):
    """The compiled path holds a step's dimensions to the pyarrow path's bound: it declines the step whose
    records all take one shape of 200 dimensions (36,000 for ~180 records), and decode_steps then refuses it as
    the pyarrow path does."""
    recs = _realistic(1, random.Random(3))
    path = tmp_path / "rank-00000.arrows"
    long = [[{**r, "step": s, "shape": [1] * 200, "numel": 1} for r in recs] for s in (1, 2)]
    parts = _steps(path, write_v2(path, long))
    block = [d for d, _ in parts]
    assert blockdecode.kernel_status(block) == 14, blockdecode.DECLINED.get(
        blockdecode.kernel_status(block)
    )
    with pytest.raises(BadInput, match="dimensions in all"):
        trajectory_decode.decode_steps(path, parts)


def _arguments(block: list[bytes]) -> dict:
    """Each C kernel's arguments for a good block, as _run makes them (the calls before it made)."""
    c = block_kernels()
    calls = {}

    def keep(name, fn):
        def call(*args):
            calls[name] = [np.array(a, copy=True) for a in args]
            return fn(*args)

        return call

    k = blockdecode.Kernels(
        *(keep(n, getattr(c, n)) for n in ("headers", "inflate", "check", "assemble"))
    )
    assert blockdecode._run(block, k)[0] == 0
    return calls


def _views(args: list, name: str) -> list:
    """The copied arguments made whole again: the scratch's and the arena's int views of their bytes."""
    if name in ("check", "assemble"):
        args[1:4] = [args[0].view(t) for t in (np.int16, np.int32, np.int64)]
    if name == "assemble":
        args[14:16] = [args[13].view(t) for t in (np.int32, np.int64)]
    return args


def test_c_kernels_refuse_arguments_of_another_shape(tmp_path):
    """A wrong dtype, a non-contiguous array, a read-only output or an array too short for the steps raises
    ValueError before anything is read; the same arguments as they should be are taken."""
    c = block_kernels()
    rng = random.Random(1)
    path = tmp_path / "rank-00000.arrows"
    block = [d for d, _ in _steps(path, write_v2(path, _random_steps(rng, 4)))[1:]]
    calls = _arguments(block)
    for name, args in calls.items():
        fn = getattr(c, name)
        fn(*_views([a.copy() for a in args], name))  # the control: taken
        for i, a in enumerate(args):
            bad = {
                "dtype": a.astype(np.float64 if a.dtype != np.float64 else np.int64),
                "narrower": a.astype(np.int32) if a.dtype == np.int64 else a.astype(np.int64),
                "strided": np.repeat(a, 2, axis=0)[::2] if a.ndim else None,
                "short": a[:-1] if a.ndim and a.shape[0] > 0 else None,
                "read-only": a.copy(),
            }
            bad["read-only"].flags.writeable = False
            for how, x in bad.items():
                if x is None or (how == "read-only" and not _written(name, i)):
                    continue
                if how == "short" and not _short_is_wrong(name, i):
                    continue
                got = _views([y.copy() for y in args], name)
                got[i] = x
                with pytest.raises(ValueError):
                    fn(*got)
    with pytest.raises(TypeError):
        c.headers(*calls["headers"][:-1])


def _written(name: str, i: int) -> bool:
    return i >= {"headers": 9, "inflate": 2, "check": 9, "assemble": 13}[name]


def _short_is_wrong(name: str, i: int) -> bool:
    """Whether an argument one row shorter no longer fits the others (the raw bytes, the scratch, the
    templates, the fixed columns' table and the arena may be any length the rest of the arguments fit)."""
    return not {
        "headers": {0, 4, 5, 6, 7},
        "inflate": {0, 2},
        "check": {0, 1, 2, 3, 8},
        "assemble": {0, 1, 2, 3, 8, 13, 14, 15},
    }[name].__contains__(i)


def test_c_kernels_refuse_arguments_that_point_outside_their_buffers(tmp_path):
    """What one kernel hands the next (buf's positions, spos and slen, where) is held to the buffers it
    points into: ValueError, not a read or write outside them, when it does not fit."""
    c = block_kernels()
    rng = random.Random(2)
    path = tmp_path / "rank-00000.arrows"
    block = [d for d, _ in _steps(path, write_v2(path, _random_steps(rng, 3)))[1:]]
    calls = _arguments(block)

    def call(name, i, edit):
        args = _views([a.copy() for a in calls[name]], name)
        edit(args[i])
        return getattr(c, name)(*_views(args, name))

    def put(at, value):
        def edit(a):
            a[at] = value

        return edit

    raw_len = calls["headers"][0].shape[0]
    for name, i, edit in (
        ("headers", 2, put(0, raw_len + 1)),  # ends past raw
        ("headers", 1, put(0, -1)),
        ("headers", 8, put((1, 4), 10**6)),  # a template's field past it
        ("inflate", 1, put((0, 1, 0), raw_len)),  # a buffer past raw
        ("inflate", 1, put((0, 1, 2), 1 << 40)),  # a size past the scratch
        ("check", 6, put((0, 5), 1 << 40)),  # spos past the scratch
        ("check", 6, put((0, 5), 4)),  # not 8-aligned
        ("check", 4, put((0, 1), 1 << 40)),  # a length past 2^31
        ("check", 8, put((0, 0), 99)),  # a node out of range
        ("assemble", 10, put((0, 0), 1 << 40)),  # an output buffer past the arena
        ("assemble", 7, put(0, 1 << 20)),  # more rows than check counted: a write past its buffer
    ):
        with pytest.raises(ValueError):
            call(name, i, edit)
