"""The C kernels of the block comparison (disttrace/native/compare.c): their constants, which are
analysis/tolerance.py's, and their checks: an argument of the wrong type, layout or length, or an index in the data out of range, raises
ValueError instead of reading or writing out of bounds (the columns come from a run store, whose values are
anyone's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from disttrace.analysis import block_summary, columnar, tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.compiled import native

C = native("_compare")
ROOT = Path(__file__).resolve().parent.parent
needs_c = pytest.mark.skipif(
    C is None, reason="the C extension disttrace.native._compare is not built"
)

K = 4
N_ORDERS = 8
SPECIAL = np.array(
    [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e308, -1e308, 5e-324, 1e-300, 1e-310, 1.0, 3.0, 2.0**-53]
)


def _floats(rng, n, special=0.2):
    """float64 values across magnitudes, with NaN, inf, -0.0, huge and subnormal ones at rate `special`."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)
    pick = rng.random(n) < special
    x[pick] = rng.choice(SPECIAL, pick.sum())
    return x


def _near(rng, x, special=0.1):
    """B's values: A's, A's perturbed around the bounds, or special."""
    e = rng.choice([0.0, 1e-16, 1e-12, 1e-8, 1e-6, 1e-3, 1.0], len(x))
    y = x * (1 + e * rng.uniform(-1, 1, len(x)))
    pick = rng.random(len(x)) < special
    y[pick] = rng.choice(SPECIAL, pick.sum())
    return y


def _starts(rng, n):
    """Step starts over n rows: empty steps, steps of one row, longer ones; the first at 0."""
    sizes = [0] if n == 0 else []
    while sum(sizes) < n:
        sizes.append(int(rng.choice([0, 0, 1, 1, 2, 5, 17, 60])))
    sizes[-1] -= sum(sizes) - n
    if rng.random() < 0.3:
        sizes.append(0)  # an empty last step
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def _classify_args(rng, n):
    da = rng.integers(0, 4, (n, 16), dtype=np.uint8)
    db = da.copy()
    change = rng.random(n) < 0.5
    db[change, rng.integers(0, 16, change.sum())] ^= 1
    dev_a = rng.random(n) < 0.2
    dev_b = np.where(rng.random(n) < 0.9, dev_a, ~dev_a)
    same_type = rng.random(n) < 0.85
    sa, na = _floats(rng, n, 0.05), np.abs(_floats(rng, n, 0.05))
    sb, nb = _near(rng, sa, 0.05), _near(rng, na, 0.05)
    numel = rng.choice([0, 1, 3, 64, 4096, 20000, 1 << 40, -1], n).astype(np.int64)
    nf_a = np.where(rng.random(n) < 0.05, 1, 0).astype(np.int64)
    nf_b = np.where(rng.random(n) < 0.05, 3, 0).astype(np.int64)
    return [da, db, dev_a, dev_b, same_type, sa, sb, na, nb, numel, nf_a, nf_b]


def _sketch(rng, n, f32: bool, present: float):
    """A sketch column as compare_block takes it: (values, flat; valid per row), empty where no row has one."""
    valid = rng.random(n) < present
    if not valid.any() and rng.random() < 0.5:
        return (np.empty(0, dtype=np.float32 if f32 else np.float64), valid)
    vals = _floats(rng, n * K, 0.05) * 1e-20 ** rng.integers(0, 2)
    vals = vals.astype(np.float32) if f32 else vals
    return vals, valid


def _compare_args(rng, n, *, kind=None, starts=None) -> dict:
    """Every argument of compare_block, by name, for random columns of n rows."""
    if kind is None:
        kind = rng.choice(np.array([0, 1, 1, 1, 2, 3, -1], dtype=np.int8), n)
    if starts is None:
        starts = _starts(rng, n)
    n_steps = len(starts)
    sa, na = _floats(rng, n), np.abs(_floats(rng, n))
    sb, nb = _near(rng, sa), _near(rng, na)
    lens = rng.choice([0, 1, 2, 3], n)
    shape_off = np.concatenate(([0], np.cumsum(lens))).astype(np.int64) + int(rng.integers(0, 3))
    shape_val = rng.choice(
        np.array([0, 1, 3, 64, 512, 1 << 20, 1 << 62, 2**63 - 1, -5], dtype=np.int64),
        int(shape_off[-1]) + 2,
    )
    present = rng.choice([0.0, 0.5, 1.0])
    k32a, v32a = _sketch(rng, n, True, present)
    k64a, v64a = _sketch(rng, n, False, rng.choice([0.0, 0.5, 1.0]))
    k32b, v32b = _sketch(rng, n, True, present)
    k64b, v64b = _sketch(rng, n, False, rng.choice([0.0, 0.5, 1.0]))
    user = bool(rng.random() < 0.3)
    use_table = bool(rng.random() < 0.6)
    has_mags = bool(rng.random() < 0.4)
    projections = int(rng.integers(0, K + 1))
    return dict(
        kind=np.asarray(kind, dtype=np.int8),
        f32=rng.random(n) < 0.5,
        sa=sa,
        sb=sb,
        na=na,
        nb=nb,
        numel_a=rng.choice(np.array([0, 1, 7, 512, 20000, 1 << 40, 2**62, -3], dtype=np.int64), n),
        numel_b=rng.choice(np.array([0, 1, 7, 512, 20000, 1 << 40, -3], dtype=np.int64), n),
        k32a=k32a,
        v32a=v32a,
        k64a=k64a,
        v64a=v64a,
        k32b=k32b,
        v32b=v32b,
        k64b=k64b,
        v64b=v64b,
        shape_off=shape_off,
        shape_val=shape_val,
        order=rng.integers(0, N_ORDERS, n).astype(np.int64),
        micro_batch=rng.integers(0, 3, n).astype(np.uint32),
        index=rng.integers(0, 4, n).astype(np.uint32),
        starts=starts,
        bitwise=bool(rng.random() < 0.2),
        user=user,
        rtol=float(rng.choice([0.0, 1e-6, 1e-3, np.inf])),
        atol=float(rng.choice([0.0, 1e-9, 1.0])),
        use_table=use_table,
        table=np.abs(_floats(rng, n_steps * N_ORDERS, 0.1) * 1e-6).reshape(n_steps, N_ORDERS),
        factor=rng.choice([1.0, 2.0], n),
        row_base=np.abs(_floats(rng, n, 0.1)) * 1e-6,
        has_mags=has_mags,
        extra=np.abs(_floats(rng, n)) if has_mags else np.empty(0),
        unbounded=(rng.random(n) < 0.1) if has_mags else np.empty(0, dtype=bool),
        copied_from=slice(projections, None).indices(K)[0],
        projections=projections,
        K=K,
        n_orders=N_ORDERS,
        counts=np.zeros((3, n_steps), dtype=np.int64),
        first=np.full(n_steps, -1, dtype=np.int64),
        specials=np.full(n, -7, dtype=np.int64),
        g_best=np.full(n_steps * N_ORDERS, -1, dtype=np.int64),
        g_ratio=np.full(n_steps * N_ORDERS, -1, dtype=np.int64),
        rel_out=np.full(n, 7.5),
        bnd_out=np.full(n, -7.5),
    )


OUTPUTS = ("counts", "first", "specials", "g_best", "g_ratio", "rel_out", "bnd_out")


def _copy(args: dict) -> dict:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in args.items()}


def _readonly(args: dict, outputs=OUTPUTS) -> dict:
    """The inputs read-only, as Arrow lends its buffers."""
    out = _copy(args)
    for k, v in out.items():
        if isinstance(v, np.ndarray) and k not in outputs:
            v.flags.writeable = False
    return out


@needs_c
def test_the_c_module_holds_tolerances_constants():
    assert C.CONSTANTS == (
        columnar.TINY,
        tolerance.UNIT_ROUNDOFF["float32"],
        tolerance.UNIT_ROUNDOFF["float64"],
        tolerance.SKETCH_ROWS,
        tolerance.STAT_CHUNK,
        tolerance.FLOAT64_STATS,
    )
    assert block_summary._CONSTANTS == C.CONSTANTS


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")


def _strings(rng, n, words):
    """A string column without nulls as (int32 offsets, uint8 data), starting at a random offset (a slice)."""
    picked = [words[i] for i in rng.integers(0, len(words), n)]
    pad = int(rng.integers(0, 5))
    data = b"x" * pad + b"".join(picked)
    off = np.cumsum([pad] + [len(w) for w in picked]).astype(np.int32)
    return off, np.frombuffer(data, dtype=np.uint8)


WORDS = [
    b"float32",
    b"float16",
    b"bfloat16",
    b"float64",
    b"float",
    b"",
    b"float321",
    b"int64",
    b"w:exp_avg_sq",
    b"w:exp_avg",
    b":exp_avg_sq",
    b"exp_avg_sq",
    b"\xff\x00",
]


# ------------------------------------------------------------------------------------------------------------
# the checks


def _valid(n=20, seed=5) -> dict:
    rng = np.random.default_rng(seed)
    starts = np.array(
        [0, 5, 5, 6, 12], dtype=np.int64
    )  # an empty step, one of one row, the last of 8
    args = _compare_args(rng, n, kind=np.ones(n, dtype=np.int8), starts=starts)
    args.update(user=False, use_table=True, has_mags=True)
    args["extra"], args["unbounded"] = np.ones(n), np.zeros(n, dtype=bool)
    args["k32a"], args["v32a"] = np.ones(n * K, dtype=np.float32), np.ones(n, dtype=bool)
    args["k32b"], args["v32b"] = np.ones(n * K, dtype=np.float32), np.ones(n, dtype=bool)
    return args


@needs_c
def test_the_valid_arguments_of_the_checks_pass():
    args = _valid()
    C.compare_block(*_readonly(args).values())


def _bad(args: dict, **changes) -> list:
    out = _copy(args)
    out.update(changes)
    return list(out.values())


BAD_COMPARE = {
    "float32 for float64": lambda a: {"sa": a["sa"].astype(np.float32)},
    "int32 for int64": lambda a: {"numel_a": a["numel_a"].astype(np.int32)},
    "uint8 for bool": lambda a: {"f32": a["f32"].view(np.uint8)},
    "int64 for uint32": lambda a: {"micro_batch": a["micro_batch"].astype(np.int64)},
    "big-endian": lambda a: {"nb": a["nb"].astype(">f8")},
    "two dimensions": lambda a: {"na": a["na"].reshape(-1, 1)},
    "one dimension for the table": lambda a: {"table": a["table"].ravel()},
    "not contiguous": lambda a: {"sb": np.repeat(a["sb"], 2)[::2]},
    "not contiguous output": lambda a: {"rel_out": np.zeros(2 * len(a["kind"]))[::2]},
    "too short": lambda a: {"numel_b": a["numel_b"][:-1]},
    "too long": lambda a: {"index": np.append(a["index"], np.uint32(0))},
    "shape offsets too short": lambda a: {"shape_off": a["shape_off"][:-1]},
    "factor too short": lambda a: {"factor": a["factor"][:3]},
    "extra too short": lambda a: {"extra": a["extra"][:3]},
    "unbounded too short": lambda a: {"unbounded": a["unbounded"][:0]},
    "row_base too short without a table": lambda a: {
        "use_table": False,
        "row_base": a["row_base"][:1],
    },
    "counts of another shape": lambda a: {
        "counts": np.zeros((2, len(a["starts"])), dtype=np.int64)
    },
    "first too short": lambda a: {"first": a["first"][:-1]},
    "cells not steps x orders": lambda a: {"g_best": a["g_best"][:-1]},
    "specials too short": lambda a: {"specials": a["specials"][:-1]},
    "read-only output": lambda a: {"bnd_out": np.frombuffer(a["bnd_out"].tobytes())},
    "n_orders 0": lambda a: {"n_orders": 0},
    "K negative": lambda a: {"K": -1},
    "copied_from negative": lambda a: {"copied_from": -3},
    "shape offset past the values": lambda a: {
        "shape_val": a["shape_val"][: int(a["shape_off"][5]) - 1]
    },
    "shape offset negative": lambda a: {"shape_off": a["shape_off"] - int(a["shape_off"][-1]) - 1},
    "order negative": lambda a: {
        "order": np.where(np.arange(len(a["order"])) == 4, -1, a["order"])
    },
    "order past n_orders": lambda a: {"order": np.full_like(a["order"], N_ORDERS)},
    "a row before the first step": lambda a: {"starts": a["starts"] + 1},
    "no steps": lambda a: {
        "starts": a["starts"][:0],
        "counts": np.zeros((3, 0), dtype=np.int64),
        "first": a["first"][:0],
        "g_best": a["g_best"][:0],
        "g_ratio": a["g_ratio"][:0],
    },
    "table with too few steps": lambda a: {"table": a["table"][:-1]},
    "table with too few orders": lambda a: {"table": np.ascontiguousarray(a["table"][:, :2])},
    "float32 sketch too short": lambda a: {
        "k32a": a["k32a"][: K * 3],
        "v64a": np.zeros(len(a["kind"]), dtype=bool),
    },
    "float64 sketch valid but empty": lambda a: {
        "v64b": np.ones(len(a["kind"]), dtype=bool),
        "k64b": np.empty(0),
    },
    "first not a row": lambda a: {"first": np.full_like(a["first"], len(a["kind"]))},
    "g_best not a row": lambda a: {"g_best": np.full_like(a["g_best"], 10**12)},
    "g_ratio not a row": lambda a: {"g_ratio": np.full_like(a["g_ratio"], len(a["kind"]))},
}


@needs_c
@pytest.mark.parametrize("what", list(BAD_COMPARE))
def test_compare_block_refuses(what):
    args = _valid()
    bad = _bad(args, **BAD_COMPARE[what](args))
    with pytest.raises(ValueError):
        C.compare_block(*bad)


@needs_c
def test_compare_block_takes_unaligned_inputs():
    """An input at an odd address (a buffer Arrow need not align) is read from an aligned copy: same bytes."""
    args = _valid()
    raw = np.zeros(len(args["sa"]) * 8 + 1, dtype=np.uint8)
    odd = raw[1:].view(np.float64)
    odd[:] = args["sa"]
    a, b = _copy(args), _copy(args)
    b["sa"] = odd
    C.compare_block(*a.values())
    C.compare_block(*b.values())
    for name in OUTPUTS:
        assert a[name].tobytes() == b[name].tobytes()


@needs_c
def test_compare_block_refuses_the_wrong_number_of_arguments_or_what_is_not_an_array():
    args = _valid()
    with pytest.raises(TypeError):
        C.compare_block(*list(args.values())[:-1])
    with pytest.raises(TypeError):
        C.compare_block(*_bad(args, order=args["order"].tolist()))


@needs_c
@pytest.mark.parametrize(
    "what",
    [
        "dtype",
        "short offsets",
        "past the data",
        "decreasing",
        "negative",
        "set past its data",
        "set decreasing",
        "out read-only",
        "out of another dtype",
    ],
)
def test_in_set_and_factors_refuse(what):
    rng = np.random.default_rng(3)
    off, data = _strings(rng, 30, WORDS)
    so, sd = block_summary._SET_OFFSETS.copy(), block_summary._SET_DATA.copy()
    out_b, out_f = np.zeros(30, dtype=bool), np.zeros(30)
    if what == "dtype":
        off = off.astype(np.int64)
    elif what == "short offsets":
        off = off[:-1]
    elif what == "past the data":
        data = data[:-1]
    elif what == "decreasing":
        off = off.copy()
        off[10] = off[11] + 1
    elif what == "negative":
        off = off - off[0] - 1
    elif what == "set past its data":
        sd = sd[:-1]
    elif what == "set decreasing":
        so[2] = so[3] + 1
    elif what == "out read-only":
        out_b.flags.writeable = out_f.flags.writeable = False
    elif what == "out of another dtype":
        out_b, out_f = out_b.view(np.uint8), out_f.astype(np.float32)
    set_only = what.startswith("set")
    with pytest.raises(ValueError):
        C.in_set(off, data, so, sd, out_b)
    if not set_only:
        with pytest.raises(ValueError):
            C.factors(off, data, block_summary._SQUARED_BYTES, out_f)


@needs_c
@pytest.mark.parametrize(
    "what", ["digest shape", "digest rows", "short column", "kind read-only", "wrong dtype"]
)
def test_classify_refuses(what):
    rng = np.random.default_rng(4)
    args = _classify_args(rng, 10) + [np.zeros(10, dtype=np.int8)]
    if what == "digest shape":
        args[0] = args[0][:, :8].copy()
    elif what == "digest rows":
        args[1] = args[1][:9]
    elif what == "short column":
        args[7] = args[7][:9]
    elif what == "kind read-only":
        args[12].flags.writeable = False
    elif what == "wrong dtype":
        args[9] = args[9].astype(np.float64)
    with pytest.raises(ValueError):
        C.classify(*args)


_CHOSEN = (
    "import sys; from disttrace.analysis import block_summary; m = block_summary.native_kernels(); "
    "print(m.__name__ if m else None, 'numba' in sys.modules)"
)


def _chosen(**env) -> str:
    e = {k: v for k, v in os.environ.items() if k != "DISTTRACE_NATIVE"}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", _CHOSEN],
        env={**e, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@needs_c
def test_the_c_module_is_chosen_and_numba_never_imported():
    assert _chosen() == "disttrace.native._compare False"
    assert _chosen(DISTTRACE_NATIVE="0") == "None False"  # numpy's path, the oracle


def test_a_refusal_of_the_c_kernels_falls_back_to_numpy_and_the_same_document(
    tmp_path, monkeypatch
):
    """Where the C comparison refuses its arguments (an index out of range, which no store we write has), the
    block is compared by numpy's path: the same `--json`, never an internal error."""
    import test_numeric_steps as steps

    if block_summary.native_kernels() is None:
        pytest.skip("the C extension is not built")
    a, b = steps._stores(tmp_path, 2, 5, 30)
    want = diff_runs(a, b, mode="numeric").to_json()
    refused = []

    class Refusing:
        def __getattr__(self, name):
            def refuse(*args):
                refused.append(name)
                raise ValueError("out of range")

            return refuse

    monkeypatch.setattr(block_summary, "native_kernels", lambda: Refusing())
    assert diff_runs(a, b, mode="numeric").to_json() == want
    assert refused  # the compiled pass was asked, and refused


def test_a_refusal_of_the_c_decoder_declines_to_pyarrow(tmp_path, monkeypatch):
    """Where a C decoder function refuses what it is handed (ValueError), the block declines and the pyarrow
    path decodes it: the same batch."""
    from disttrace.store import trajectory_decode

    blockdecode = pytest.importorskip("disttrace.store.blockdecode", exc_type=ImportError)
    import test_numeric_steps as steps

    a, _ = steps._stores(tmp_path, 1, 4, 30)
    path = a / "trajectory/rank-00000.arrows"
    lines = [
        orjson.loads(x) for x in (a / "trajectory/rank-00000.steps.jsonl").read_bytes().split()
    ]
    data = path.read_bytes()
    block = [(data[e["offset"] : e["offset"] + e["length"]], f"step {e['step']}") for e in lines]
    want, _ = trajectory_decode.decode_steps(path, block)

    def refuse(*args, **kw):
        raise ValueError("outside its buffer")

    monkeypatch.setattr(blockdecode, "_run", refuse)
    assert blockdecode.decode([d for d, _ in block]) is None
    got, _ = trajectory_decode.decode_steps(path, block)
    assert got.equals(want)
