"""Property-based fuzzing of what disttrace reads: manifest TOML, manifest.lock.json, run.json, the JSONL
trajectory, step-index and event files. Driven through the real CLI in-process (typer's CliRunner), so the
whole path from bytes on disk to the exit code and the stderr line is exercised.

The contract under test (README, "Exit codes"): never a traceback; exit 0, 1 or 2; exit 2 is bad input,
reported as exactly one stderr line naming the file (and the field where there is one) -- the very
`BadInput` the reading function raises, printed as `error: <file>: <field>: <reason>`; with --json, stdout
is exactly one JSON document whenever a result is reported (exit 0 or 1).

Deterministic by default (hypothesis derandomize); DISTTRACE_FUZZ_SEED=random explores new inputs,
DISTTRACE_FUZZ_SCALE=4 tries four times as many, DISTTRACE_FUZZ_SHRINK=1 shrinks a failing input (slow),
DISTTRACE_FUZZ_COLLECT=1 keeps going after a failure and lists one input per distinct failure at the end.
`pytest -s tests/test_fuzz.py` prints how many inputs were generated and how the commands answered them.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import re
import shutil
import struct
import traceback
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import xxhash
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from disttrace.analysis import facts as run_facts
from disttrace.analysis.consistency import check_run
from disttrace.analysis.diff import diff_runs
from disttrace.analysis.timeline import build_trace
from disttrace.cli.shared import app
from disttrace.config.freezing import freeze
from disttrace.config.manifest import DEFAULT_MANIFEST
from disttrace.errors import BadInput
from disttrace.fmt import visible
from disttrace.gate import verdict as gate_verdict
from disttrace.report import build_report
from disttrace.store import collframes, trajectory_decode, trajectory_read
from disttrace.store.follow import Follower
from disttrace.store.rundir import Run
from disttrace.store.trajectory import END_OF_STREAM, SCHEMA, SUFFIX
from disttrace.store.trajectory_write import TrajectoryWriter
from disttrace.store.verify import verify_run

SCALE = float(os.environ.get("DISTTRACE_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("DISTTRACE_FUZZ_SEED") == "random"
# DISTTRACE_FUZZ_COLLECT=1: do not stop at the first failing case; gather one example per distinct failure
# (exception type and the innermost disttrace frame, or the broken rule) and fail once at the end with all
COLLECT = os.environ.get("DISTTRACE_FUZZ_COLLECT") == "1"
FAILURES: dict[str, str] = {}


# shrinking a failure to its smallest input can take minutes; DISTTRACE_FUZZ_SHRINK=1 turns it on
PHASES = [
    ph for ph in Phase if ph is not Phase.shrink or os.environ.get("DISTTRACE_FUZZ_SHRINK") == "1"
]


# the CI sample: each test's own count. `make fuzz` selects the long profile with DISTTRACE_FUZZ_EXAMPLES=N:
# every test scales by N / CI_TOTAL (5% over, as a test whose inputs run out stops early), and the file
# then generates at least N inputs (test_zz_no_collected_failures checks it when the whole file ran)
CI_TOTAL = 1528  # the sum of the @fuzz(n) counts below (test_ci_total_is_the_sum_of_the_counts)
LONG = int(os.environ.get("DISTTRACE_FUZZ_EXAMPLES") or 0)
DECLARED: list[int] = []


def fuzz(n: int):
    DECLARED.append(n)
    count = math.ceil(n * LONG * 1.05 / CI_TOTAL) if LONG else max(1, int(n * SCALE))
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        phases=PHASES,
    )


COUNTS: Counter = Counter()  # (input kind, outcome) -> CLI invocations
EXAMPLES: Counter = Counter()  # test -> hypothesis examples (generated inputs)


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    if COUNTS:
        tests = sorted({t for t, _ in COUNTS})
        print(
            f"\nfuzz inputs generated: {sum(EXAMPLES.values())} ({dict(sorted(EXAMPLES.items()))})"
        )
        print(
            "calls on them (the CLI in-process; freeze_from_deepspeed directly), by input kind and outcome:"
        )
        for t in tests:
            outcomes = {o: n for (tt, o), n in sorted(COUNTS.items()) if tt == t}
            print(f"  {t}: {sum(outcomes.values())}, {outcomes}")
        print(f"  total: {sum(COUNTS.values())} calls")
        if EXAMPLES_BY_OP:
            print(
                f"Arrow trajectory inputs by (first) mutation: {dict(sorted(EXAMPLES_BY_OP.items()))}"
            )
    if FAILURES:
        print(f"\n{len(FAILURES)} distinct failures:")
        for sig, case in FAILURES.items():
            print(f"\n=== {sig}\n{case}")


runner = CliRunner()


def invoke(args: list) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"NO_COLOR": "1", "COLUMNS": "200"})


def crash_report(result, args) -> str:
    tb = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
    return f"disttrace {' '.join(map(str, args))} -> exit {result.exit_code}\n{tb}\nstderr: {result.stderr[-2000:]}"


def signature(result, message: str) -> str:
    if result.exc_info and not isinstance(result.exception, SystemExit):
        frames = [
            f for f in traceback.extract_tb(result.exc_info[2]) if "/disttrace/" in f.filename
        ]
        where = (
            f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}"
            if frames
            else "?"
        )
        return f"{type(result.exception).__name__} at {where}"
    return message.split("\n", 1)[0][:60]


def check_contract(
    test: str, args: list, result, expected_error, allowed: set[int], case: str = ""
) -> None:
    try:
        _check_contract(test, args, result, expected_error, allowed)
    except AssertionError as e:
        if not COLLECT:
            raise
        sig = signature(result, str(e))
        COUNTS[(test, "FAILED")] += 1
        FAILURES.setdefault(sig, f"{case}\n{e}"[:6000])


def _check_contract(test: str, args: list, result, expected_error, allowed: set[int]) -> None:
    """The exit-code contract. `expected_error()` calls the reading function itself and returns the
    BadInput it raises (or None), to compare with what the command printed."""
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), crash_report(result, args)
    code = result.exit_code
    COUNTS[(test, f"exit {code}")] += 1
    assert code in allowed, crash_report(result, args)
    if code == 2:
        lines = result.stderr.strip("\n").split(
            "\n"
        )  # "\n" only: what a terminal or `grep` calls a line
        assert len(lines) == 1, (
            f"exit 2 must print one line, printed {len(lines)}:\n{result.stderr}\n{args}"
        )
        e = expected_error()
        assert isinstance(e, BadInput), (
            f"the command said bad input, the reader did not raise: {lines[0]}"
        )
        # the CLI makes the message visible before rich prints it: every control character escaped
        want = visible(f"error: {e}")
        assert lines[0] == want, f"printed {lines[0]!r}\nraised  {want!r}"
        named = f"{e.where}: {e.field}: " if e.field else f"{e.where}: "
        assert visible(named) in lines[0]  # the file, and the field where there is one
    elif "--json" in args:
        try:
            orjson.loads(result.stdout)
        except orjson.JSONDecodeError:
            raise AssertionError(
                f"--json printed no single JSON document:\n{result.stdout[:2000]}"
            ) from None


def raised(fn):
    def call():
        try:
            fn()
        except BadInput as e:
            return e
        return None

    return call


# ---------------------------------------------------------------- value pools

# strings that have broken CLIs before: markup, emoji codes, newlines, paths, format specs
NASTY = [
    "[/x]",
    "[bold]",
    "[red]x[/red]",
    ":smile:",
    "a\nb",
    "\r",
    "\t",
    "%s",
    "{0}",
    "",
    " ",
    "..",
    "../../x",
    "data/corpus.jsonl",
    "data/tokenizer.json",
    "byte",
    "bpe",
    "nan",
    "\x00",
    "\u202e",
    "\U0001f600",
    "reference",
    "fault_fired",
    "job_failed",
    "rank_failed",
    "loss",
    "backward",
    "trajectory",
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(NASTY),
)
json_values = st.recursive(
    json_scalars,
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(
                [
                    "step",
                    "offset",
                    "length",
                    "records",
                    "digest",
                    "time",
                    "rank",
                    "phase",
                    "event",
                    "manifest",
                    "manifest_id",
                    "path",
                    "resume",
                ]
            ),
            c,
            max_size=4,
        )
    ),
    max_leaves=10,
)


def dumps(v) -> str:
    return json.dumps(
        v, allow_nan=True, ensure_ascii=False
    )  # NaN/Infinity/2**70 on purpose: not orjson's JSON


def toml_str(s: str) -> str:
    out = []
    for c in s:
        o = ord(c)
        if c in '"\\' or o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, str):
        return toml_str(v)
    if v is None:
        return '""'  # TOML has no null
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{ " + ", ".join(f"{toml_str(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"


toml_values = st.one_of(
    json_values.map(toml_value),
    st.sampled_from(
        [
            "1979-05-27T07:32:00Z",
            "1979-05-27",
            "07:32:00",
            "0x10",
            "0o7",
            "0b1",
            "1_000",
            "-0",
            "+inf",
            "1e400",
            "'literal'",
            "'''multi\nline'''",
            '"""a\nb"""',
            "[1, 'a', [2]]",
            "{ a = { b = 1 } }",
            "1" * 5000,
            "[" * 3000 + "]" * 3000,
            "",
            "=",
            "[",
            '"unterminated',
            "tru",
            "1.",
            ".5",
        ]
    ),
)

# ---------------------------------------------------------------- manifest TOML

DEFAULT_TEXT = DEFAULT_MANIFEST.read_text(encoding="utf-8")
KEY_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


@st.composite
def mutated_toml(draw) -> str:
    lines = DEFAULT_TEXT.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(
            st.sampled_from(
                [
                    "delete_line",
                    "duplicate_line",
                    "swap_lines",
                    "char",
                    "insert",
                    "cut",
                    "value",
                    "value",
                    "value",
                    "rename_key",
                    "new_key",
                    "new_table",
                ]
            )
        )
        i = draw(st.integers(0, len(lines) - 1)) if lines else 0
        keyed = [n for n, ln in enumerate(lines) if KEY_LINE.match(ln)]
        if op == "delete_line" and lines:
            del lines[i]
        elif op == "duplicate_line" and lines:
            lines.insert(i, lines[i])
        elif op == "swap_lines" and lines:
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op in ("char", "insert", "cut"):
            text = "\n".join(lines)
            pos = draw(st.integers(0, len(text)))
            if op == "char" and text:
                pos = min(pos, len(text) - 1)
                text = text[:pos] + draw(st.characters()) + text[pos + 1 :]
            elif op == "insert":
                text = text[:pos] + draw(st.text(max_size=12) | st.sampled_from(NASTY)) + text[pos:]
            else:
                text = text[:pos] + text[pos + draw(st.integers(1, 40)) :]
            lines = text.split("\n")
        elif op == "value" and keyed:
            n = draw(st.sampled_from(keyed))
            key = KEY_LINE.match(lines[n]).group(1)
            lines[n] = f"{key} = {draw(toml_values)}"
        elif op == "rename_key" and keyed:
            n = draw(st.sampled_from(keyed))
            new = draw(st.sampled_from(["bogus", '"[/x]"', '"a.b"', '"a\\nb"', "seed", "dp"]))
            # a function, so that `new` is taken literally (no backslash escapes)
            lines[n] = KEY_LINE.sub(lambda _, new=new: f"{new} =", lines[n], count=1)
        elif op == "new_key":
            key = draw(
                st.sampled_from(
                    [
                        "extra",
                        "max_grad_norm",
                        "world_size",
                        "zero_stage",
                        '"a\\nb"',
                        '"[/x]"',
                        '"[bold]k"',
                        '"a\\u0007b"',
                        '":smile:"',
                    ]
                )
            )
            lines.insert(i, f"{key} = {draw(toml_values)}")
        elif op == "new_table":
            lines.insert(
                i,
                draw(
                    st.sampled_from(
                        ["[bogus]", "[training]", "[[experiment]]", "[model.sub]", "[]"]
                    )
                ),
            )
    return "\n".join(lines) + "\n"


@st.composite
def random_manifest_doc(draw) -> str:
    """A manifest-shaped document whose values are drawn at random, written as TOML."""
    from disttrace.config.freezing import read_toml

    doc = read_toml(DEFAULT_MANIFEST)
    out = []
    for section, table in doc.items():
        if draw(st.integers(0, 9)) == 0:
            continue  # a section left out
        out.append(f"[{section}]")
        for key, value in table.items():
            r = draw(st.integers(0, 5))
            if r == 0:
                continue
            out.append(f"{key} = {toml_value(value) if r > 2 else draw(toml_values)}")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("manifests")
    (d / "data").symlink_to(
        DEFAULT_MANIFEST.parent / "data"
    )  # so a surviving data.path still resolves
    return d


def _freeze_case(test: str, path: Path, data: bytes) -> None:
    path.write_bytes(data)
    args = ["freeze", path, "--json"]
    check_contract(
        test,
        args,
        invoke(args),
        raised(lambda: freeze(path)),
        allowed={0, 2},
        case=f"{path.name} := {data[:3000]!r}",
    )


def _default_with(old: str, new: str) -> str:
    assert old in DEFAULT_TEXT
    return DEFAULT_TEXT.replace(old, new, 1)


# inputs that broke the contract once: always tried first (hypothesis @example), whatever is generated
TOML_REGRESSIONS = [
    _default_with(
        "seed = 1234", 'seed = 1234\n"a\\nb" = 1'
    ),  # a newline in a key: a two-line error
    _default_with("seed = 1234", 'seed = "[/x]"'),  # rich markup in the message: MarkupError
    _default_with("seed = 1234", 'seed = 1234\n"[bold]k" = 1'),  # markup eaten: the key vanishes
    _default_with("dim = 64", "dim = " + "1" * 5000),  # int past Python's digit limit (fixed)
    _default_with(
        "dim = 64", "dim = " + "[" * 3000 + "]" * 3000
    ),  # nesting past the recursion limit (fixed)
]


@fuzz(300)
@given(text=mutated_toml())
@example(text=TOML_REGRESSIONS[0])
@example(text=TOML_REGRESSIONS[1])
@example(text=TOML_REGRESSIONS[2])
@example(text=TOML_REGRESSIONS[3])
@example(text=TOML_REGRESSIONS[4])
def test_fuzz_mutated_manifest(manifest_dir, text):
    EXAMPLES["mutated_manifest"] += 1
    _freeze_case(
        "mutated manifest TOML", manifest_dir / "m.toml", text.encode("utf-8", "surrogatepass")
    )


@fuzz(120)
@given(text=random_manifest_doc())
def test_fuzz_random_manifest_values(manifest_dir, text):
    EXAMPLES["random_manifest_values"] += 1
    _freeze_case(
        "random-valued manifest TOML",
        manifest_dir / "r.toml",
        text.encode("utf-8", "surrogatepass"),
    )


@fuzz(100)
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(max_size=50).map(lambda b: DEFAULT_TEXT.encode()[:400] + b),
    )
)
def test_fuzz_random_bytes_as_manifest(manifest_dir, data):
    EXAMPLES["random_bytes_as_manifest"] += 1
    _freeze_case("random bytes as manifest", manifest_dir / "b.toml", data)


# ---------------------------------------------------------------- a run directory to mutate

PARAMS = [("tok_embeddings.weight", [512, 64]), ("norm.weight", [64])]


def _digest(r: dict) -> str:
    return xxhash.xxh3_128_hexdigest(orjson.dumps([r["tensor"], r["shape"], r["sum"], r["norm"]]))


def _rec(step, mb, phase, rank, index, tensor, shape, value, **extra) -> dict:
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
        "sum": value,
        "norm": abs(value) + 1.0,
        "nonfinite": 0,
        **extra,
    }
    r["digest"] = _digest(r)
    return r


ARROW, LEGACY = (
    "arrow",
    "jsonl",
)  # the recorder's format; JSON lines, as stores written before it hold


def write_trajectory(path: Path, rank: int, steps: dict[int, list[dict]], fmt: str = ARROW) -> None:
    """One rank's trajectory and step index. ARROW: through the recorder's own writer (TrajectoryWriter), one
    record batch per step; LEGACY: one JSON line per record. Index lines without hashes (a store whose seal a
    writer rewrote is read the same way), so the readers decode every mutated byte."""
    index = bytearray()
    if fmt == ARROW:
        writer = TrajectoryWriter(path / f"trajectory/rank-{rank:05d}{SUFFIX}")
        for step, recs in steps.items():
            offset = writer.offset
            index += _index_line(step, offset, len(writer.write_step(recs)), recs)
        writer.close()
    else:
        data = bytearray()
        for step, recs in steps.items():
            lines = b"".join(orjson.dumps(r) + b"\n" for r in recs)
            index += _index_line(step, len(data), len(lines), recs)
            data += lines
        (path / f"trajectory/rank-{rank:05d}.jsonl").write_bytes(bytes(data))
    (path / f"trajectory/rank-{rank:05d}.steps.jsonl").write_bytes(bytes(index))


def digest_of_digests(digests: list[str]) -> str:
    h = xxhash.xxh3_128()  # run/record/digest.py's, without importing torch
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def _index_line(step: int, offset: int, length: int, recs: list[dict]) -> bytes:
    return (
        orjson.dumps(
            {
                "step": step,
                "offset": offset,
                "length": length,
                "records": len(recs),
                "digest": digest_of_digests([r["digest"] for r in recs]),
                "time": {"start": 0.0, "collective_issue": 0.01, "end": 0.02},
            }
        )
        + b"\n"
    )


def build_run(path: Path, lock: dict, fmt: str = ARROW) -> Path:
    """A complete two-rank, two-step reference run in the recorder's layout (fmt: the trajectory's format)."""
    path.mkdir(parents=True)
    (path / "manifest.lock.json").write_bytes(orjson.dumps(lock, option=orjson.OPT_INDENT_2))
    (path / "run.json").write_bytes(
        orjson.dumps({"path": "reference", "fault": None, "resume": None})
    )
    (path / "trajectory").mkdir()
    accum = lock["manifest"]["training"]["grad_accum_steps"]
    world = lock["manifest"]["parallelism"]["world_size"]
    for rank in range(world):
        steps = {}
        for step in (1, 2):
            recs = []
            for mb in range(accum):
                recs.append(_rec(step, mb, "data", rank, 0, "inputs", [4, 64], step + mb + rank))
                recs.append(
                    _rec(
                        step,
                        mb,
                        "loss",
                        rank,
                        0,
                        "loss",
                        [],
                        6.0 - step / 10 + rank / 100,
                        tokens=256,
                    )
                )
                recs += [
                    _rec(step, mb, "backward", rank, i, n, s, 0.1 * (i + mb + rank))
                    for i, (n, s) in enumerate(PARAMS)
                ]
            recs += [
                _rec(step, accum - 1, "reduce", rank, i, n, s, 0.2 * i)
                for i, (n, s) in enumerate(PARAMS)
            ]
            recs += [
                _rec(step, accum - 1, "optimizer", rank, i, n, s, 0.3 * i + step)
                for i, (n, s) in enumerate(PARAMS)
            ]
            steps[step] = recs
        write_trajectory(path, rank, steps, fmt)
    # a replica map, so that `check` has something to check (reduced gradients agree across dp)
    (path / "replicas.json").write_bytes(
        orjson.dumps(
            {
                "groups": {"dp": [list(range(world))]},
                "rules": [{"phase": "reduce", "tensors": "*", "dim": "dp", "relation": "agree"}],
            }
        )
    )
    events = [
        {"event": "run_started", "time": 1.0},
        {"event": "checkpoint_saved", "time": 2.0, "step": 2},
        {"event": "run_complete", "time": 3.0},
    ]
    (path / "events.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    (path / "COMPLETE").write_bytes(orjson.dumps({"completed": 3.0, "steps": 2}) + b"\n")
    return path


def _pristine_and_work(root: Path, fmt: str) -> tuple[Path, Path]:
    ref = build_run(root / "reference", freeze(None).model_dump(), fmt)
    work = root / "work"
    shutil.copytree(ref, work)
    return ref, work


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(pristine reference, a copy that each case mutates and restores): the Arrow trajectory."""
    return _pristine_and_work(tmp_path_factory.mktemp("runs"), ARROW)


@pytest.fixture(scope="module")
def legacy_runs(tmp_path_factory):
    """The same run with a JSON-lines trajectory, as stores written before the Arrow format hold it."""
    return _pristine_and_work(tmp_path_factory.mktemp("legacy_runs"), LEGACY)


def _run_cases(test: str, ref: Path, work: Path, case: str = "") -> None:
    cases = [
        (["show", work, "--json"], raised(lambda: run_facts.gather(work, "summary")), {0, 2}),
        (
            ["show", work, "events", "--json"],
            raised(lambda: run_facts.gather(work, "events")),
            {0, 2},
        ),
        (["diff", ref, work, "--json"], raised(lambda: diff_runs(ref, work)), {0, 1, 2}),
        (["diff", work, ref, "--json"], raised(lambda: diff_runs(work, ref)), {0, 1, 2}),
    ]
    for args, expected, allowed in cases:
        check_contract(test, args, invoke(args), expected, allowed, case)


class Mutated:
    """Write mutated bytes over one file of the working run for one case, then put the original back."""

    def __init__(self, ref: Path, work: Path, rel: str):
        self.ref, self.work, self.rel = ref, work, rel

    def __enter__(self):
        return self.work / self.rel

    def __exit__(self, *exc):
        target, orig = self.work / self.rel, self.ref / self.rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        if orig.exists():
            shutil.copyfile(orig, target)
        return False


@pytest.mark.parametrize("fmt", [ARROW, LEGACY])
def test_pristine_run_is_read_cleanly(runs, legacy_runs, fmt):
    ref, work = runs if fmt == ARROW else legacy_runs
    assert (work / "trajectory" / f"rank-00000{SUFFIX if fmt == ARROW else '.jsonl'}").is_file()
    for args in (["show", work, "--json"], ["diff", ref, work, "--json"]):
        r = invoke(args)
        assert r.exit_code == 0, crash_report(r, args)
        assert orjson.loads(r.stdout)


# -- manifest.lock.json and run.json: random JSON, mutated documents, mutated bytes


def _paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, prefix + (i,))


@st.composite
def mutated_json(draw, doc) -> bytes:
    kind = draw(st.sampled_from(["random", "replace", "replace", "replace", "delete", "bytes"]))
    if kind == "random":
        return dumps(draw(json_values)).encode("utf-8", "surrogatepass")
    if kind == "bytes":
        raw = bytearray(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        for _ in range(draw(st.integers(1, 3))):
            pos = draw(st.integers(0, len(raw) - 1))
            op = draw(st.sampled_from(["set", "delete", "insert", "truncate"]))
            if op == "set":
                raw[pos] = draw(st.integers(0, 255))
            elif op == "delete":
                del raw[pos : pos + draw(st.integers(1, 20))]
            elif op == "insert":
                raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
            else:
                del raw[pos:]
            if not raw:
                break
        return bytes(raw)
    doc = json.loads(json.dumps(doc))
    paths = [p for p in _paths(doc) if p]
    for _ in range(draw(st.integers(1, 3))):
        p = draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in p[:-1]:
                parent = parent[k]
            if kind == "delete" and isinstance(parent, dict):
                parent.pop(p[-1], None)
            else:
                parent[p[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation changed the shape under this path
    return dumps(doc).encode("utf-8", "surrogatepass")


LOCK_DOC = None


def _lock_doc():
    global LOCK_DOC
    if LOCK_DOC is None:
        LOCK_DOC = freeze(None).model_dump()
    return LOCK_DOC


@fuzz(200)
@given(data=st.data())
def test_fuzz_lock_json(runs, data):
    EXAMPLES["lock_json"] += 1
    ref, work = runs
    raw = data.draw(mutated_json(_lock_doc()))
    with Mutated(ref, work, "manifest.lock.json") as target:
        target.write_bytes(raw)
        _run_cases("manifest.lock.json", ref, work, f"manifest.lock.json := {raw[:3000]!r}")


@fuzz(100)
@given(data=st.data())
def test_fuzz_run_json(runs, data):
    EXAMPLES["run_json"] += 1
    ref, work = runs
    raw = data.draw(
        mutated_json({"path": "reference", "fault": None, "resume": {"checkpoint": "c", "step": 2}})
    )
    with Mutated(ref, work, "run.json") as target:
        target.write_bytes(raw)
        _run_cases("run.json", ref, work, f"run.json := {raw[:3000]!r}")


# -- the JSONL files

JSONL_FILES = [
    "trajectory/rank-00000.jsonl",
    "trajectory/rank-00001.jsonl",
    "trajectory/rank-00000.steps.jsonl",
    "trajectory/rank-00001.steps.jsonl",
    "events.jsonl",
]
LEGACY_TRAJECTORIES = ("trajectory/rank-00000.jsonl", "trajectory/rank-00001.jsonl")
ARROW_FILES = ["trajectory/rank-00000.arrows", "trajectory/rank-00001.arrows"]


def _store_for(rel: str, runs, legacy_runs, other: bool = False):
    """The store a file belongs in: a JSON-lines trajectory in the legacy one; the step index and events in
    either (`other`: the legacy one)."""
    return legacy_runs if rel in LEGACY_TRAJECTORIES or other else runs


@st.composite
def mutated_jsonl(draw, raw: bytes) -> bytes:
    lines = raw.split(b"\n")[:-1]
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            lines = [b""]
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(
            st.sampled_from(
                [
                    "field",
                    "field",
                    "field",
                    "drop_field",
                    "line",
                    "delete",
                    "duplicate",
                    "swap",
                    "bytes",
                    "blank",
                ]
            )
        )
        if op in ("field", "drop_field"):
            try:
                obj = json.loads(lines[i])
            except ValueError:
                continue
            if isinstance(obj, dict) and obj:
                key = draw(st.sampled_from(sorted(obj)))
                if op == "drop_field":
                    del obj[key]
                else:
                    obj[key] = draw(
                        json_values | st.sampled_from([-1, 0, 10**9, 2**63, "1", [], {}])
                    )
                lines[i] = dumps(obj).encode("utf-8", "surrogatepass")
        elif op == "line":
            lines[i] = dumps(draw(json_values)).encode("utf-8", "surrogatepass")
        elif op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "bytes":
            b = bytearray(lines[i])
            pos = draw(st.integers(0, len(b)))
            b[pos : pos + draw(st.integers(0, 4))] = draw(st.binary(max_size=4))
            lines[i] = bytes(b)
        else:
            lines.insert(i, b"")
    out = b"\n".join(lines) + b"\n"
    if draw(st.integers(0, 5)) == 0:
        out = out[: draw(st.integers(0, len(out)))]  # torn: a crash mid-write
    return out


@fuzz(350)
@given(data=st.data())
def test_fuzz_jsonl_files(runs, legacy_runs, data):
    EXAMPLES["jsonl_files"] += 1
    rel = data.draw(st.sampled_from(JSONL_FILES))
    ref, work = _store_for(rel, runs, legacy_runs, other=data.draw(st.booleans()))
    raw = data.draw(mutated_jsonl((ref / rel).read_bytes()))
    with Mutated(ref, work, rel) as target:
        target.write_bytes(raw)
        _run_cases(rel, ref, work, f"{rel} := {raw[:3000]!r}")


# -- the Arrow trajectory: its bytes mutated where the format keeps lengths, schemas and steps, then read by
# every command that reads a trajectory (with the step index, and without it: readers then scan the stream)

FORGED = [2**31 - 1, 2**31, 2**32 - 8, 2**40, 2**62, 2**63 - 1, -1, -8, -(2**63), 0, 1, 7, 9, 4096]


@dataclasses.dataclass(frozen=True)
class Message:
    """Where one IPC message of the pristine stream lies: the 0xFFFFFFFF continuation and int32 metadata
    length at `start`, the flatbuffer metadata, then the body."""

    start: int
    meta_start: int
    body_start: int
    end: int
    kind: str


def arrow_messages(raw: bytes) -> list[Message]:
    r, out = pa.BufferReader(raw), []
    while True:
        start = r.tell()
        try:
            m = ipc.read_message(r)
        except (pa.ArrowException, EOFError, StopIteration, OSError):
            return out  # the end-of-stream marker
        if m is None:
            return out
        body = m.body.size if m.body is not None else 0
        out.append(Message(start, start + 8, r.tell() - body, r.tell(), m.type))


LZ4_MAGIC = b'\x04"M\x18'  # an LZ4 frame's first bytes; Arrow puts the buffer's uncompressed length before it


def lz4_frames(data: bytes) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(LZ4_MAGIC), data) if m.start() >= 8]


def _steps_of(index: bytes) -> list[tuple[int, int]]:
    return [(e["offset"], e["offset"] + e["length"]) for e in map(orjson.loads, index.splitlines())]


def _foreign_stream(draw) -> bytes:
    """An Arrow stream (or file) that is not a trajectory: another schema, or ours with other types."""
    kind = draw(
        st.sampled_from(["other", "renamed", "retyped", "file", "dictionary", "schema_only"])
    )
    n = draw(st.integers(0, 5))
    if kind == "other":
        t = pa.table({"x": pa.array(range(n), pa.int64()), "name": [str(i) for i in range(n)]})
    elif kind == "dictionary":
        t = pa.table({"tensor": pa.array([f"t{i % 2}" for i in range(n)]).dictionary_encode()})
    else:
        fields = list(SCHEMA)
        if kind == "retyped":  # the same names, every column an int64 or a string
            fields = [
                pa.field(f.name, draw(st.sampled_from([pa.int64(), pa.string(), pa.binary(16)])))
                for f in fields
            ]
        elif kind == "renamed":
            fields = [f.with_name(f.name + "_") for f in fields]
        schema = pa.schema(fields)
        t = pa.table({f.name: pa.nulls(n, f.type) for f in schema}, schema=schema)
    sink = io.BytesIO()
    opts = ipc.IpcWriteOptions(compression=draw(st.sampled_from([None, "lz4", "zstd"])))
    with (ipc.new_file if kind == "file" else ipc.new_stream)(sink, t.schema, options=opts) as w:
        if kind != "schema_only":
            w.write_table(t)
    return sink.getvalue()


def _int64_slots(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo // 8, max(lo // 8, hi // 8 - 1)).map(lambda i: i * 8)


@st.composite
def mutated_arrow(draw, raw: bytes, index: bytes) -> tuple[str, bytes]:
    """(what was done, the trajectory's new bytes). Lengths forged huge must neither allocate gigabytes nor
    hang; a step's bytes edited must be refused with the file and step named, never decoded as something else."""
    msgs, steps = arrow_messages(raw), _steps_of(index)
    whole = draw(st.integers(0, 9))
    if whole == 0:
        kind = draw(
            st.sampled_from(["empty", "random", "foreign", "foreign", "eos only", "schema only"])
        )
        if kind == "empty":
            return kind, b""
        if kind == "random":
            return kind, draw(st.binary(min_size=1, max_size=600))
        if kind == "eos only":
            return kind, END_OF_STREAM
        if kind == "schema only":
            return kind, raw[: msgs[0].end]
        return kind, _foreign_stream(draw)
    b, did = bytearray(raw), []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(
            st.sampled_from(
                [
                    "flip",
                    "overwrite",
                    "schema",
                    "length_prefix",
                    "body_length",
                    "int64",
                    "lz4_size",
                    "truncate",
                    "duplicate",
                    "reorder",
                    "foreign_step",
                    "tail",
                ]
            )
        )
        m = draw(st.sampled_from(msgs))
        lo, hi = draw(st.sampled_from(steps))
        hi = min(hi, len(b))  # an earlier op may have cut the file short
        if lo >= hi or msgs[0].end > len(b):
            op = "truncate"
        if op == "flip":
            pos = draw(st.integers(lo, hi - 1))
            b[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "overwrite":
            pos = draw(st.integers(lo, hi - 1))
            b[pos : pos + 8] = draw(st.binary(min_size=1, max_size=8))[: hi - pos].ljust(
                min(8, hi - pos), b"\0"
            )
        elif op == "schema":  # the first step's schema message: the one readers must not trust
            pos = draw(st.integers(msgs[0].start, msgs[0].end - 1))
            b[pos] = draw(st.integers(0, 255))
        elif op == "length_prefix":  # the continuation marker or the int32 metadata length
            pos = m.start + draw(st.sampled_from([0, 4]))
            b[pos : pos + 4] = struct.pack(
                "<i" if pos == m.start + 4 else "<I",
                draw(
                    st.sampled_from(
                        [2**31 - 1, 2**30, 0, 8, -1, -8, m.body_start - m.meta_start + 8]
                    )
                )
                if pos == m.start + 4
                else draw(st.sampled_from([0, 2**32 - 1, 2**31])),
            )
        elif (
            op == "body_length"
        ):  # the Message table's bodyLength: the int64 equal to the body's size
            size = struct.pack("<q", m.end - m.body_start)
            at = bytes(b[m.meta_start : m.body_start]).find(size) if m.end > m.body_start else -1
            if at >= 0:
                b[m.meta_start + at : m.meta_start + at + 8] = struct.pack(
                    "<q", draw(st.sampled_from(FORGED))
                )
        elif (
            op == "int64"
        ):  # row counts, buffer offsets and lengths, LZ4's uncompressed-length prefixes
            pos = draw(_int64_slots(m.meta_start, m.end))
            if pos + 8 <= len(b):
                b[pos : pos + 8] = struct.pack("<q", draw(st.sampled_from(FORGED)))
        elif (
            op == "lz4_size"
        ):  # the uncompressed length Arrow allocates before it decompresses a buffer
            frames = lz4_frames(bytes(b[lo:hi]))
            if frames:
                pos = lo + draw(st.sampled_from(frames)) - 8
                b[pos : pos + 8] = struct.pack("<q", draw(st.sampled_from(FORGED)))
        elif op == "truncate":
            del b[draw(st.integers(0, len(b))) :]
        elif op == "duplicate":
            at = draw(st.sampled_from([hi, len(b)]))
            b[at:at] = raw[lo:hi]
        elif (
            op == "reorder" and len(msgs) >= 3
        ):  # the record batches swapped, the schema left first
            x, y = msgs[1], msgs[2]
            b[x.start : y.end] = raw[y.start : y.end] + raw[x.start : x.end]
        elif op == "foreign_step":  # a step's bytes replaced by a foreign stream's batch
            f = _foreign_stream(draw)
            fm = arrow_messages(f)
            if len(fm) > 1:
                b[lo:hi] = (
                    f[fm[1].start : fm[1].end]
                    if lo
                    else raw[: msgs[0].end] + f[fm[1].start : fm[1].end]
                )
        elif op == "tail":
            b += draw(
                st.sampled_from(
                    [END_OF_STREAM, b"\xff\xff\xff\xff", raw[msgs[0].start : msgs[0].end]]
                )
            )
        did.append(op)
        if not b:
            break
    return "+".join(did) or "nothing", bytes(b)


def _check_case(test: str, args: list, result, run: Path, case: str) -> None:
    """check: exit 2 is also its "nothing to check" (a reason in the JSON document, not an error) when no
    rule has two ranks' records to compare."""
    if result.exit_code == 2 and (
        result.exception is None or isinstance(result.exception, SystemExit)
    ):
        try:
            res = check_run(Run(run))
        except BadInput:
            res = None
        if res is not None and res.consistent is None:
            COUNTS[(test, "exit 2 (nothing to check)")] += 1
            try:
                assert orjson.loads(result.stdout) == orjson.loads(res.to_json()), crash_report(
                    result, args
                )
            except (AssertionError, orjson.JSONDecodeError) as e:
                if not COLLECT:
                    raise AssertionError(f"{case}\n{e}") from None
                FAILURES.setdefault(signature(result, f"check: {e}"), f"{case}\n{e}"[:6000])
            return
    check_contract(test, args, result, raised(lambda: check_run(Run(run))), {0, 1, 2}, case)


def _run_readers(test: str, ref: Path, work: Path, case: str = "") -> None:
    """Every command that reads a trajectory, on the mutated run (and the pristine one beside it)."""
    out = work.parent / "report.html"
    cases = [
        (["show", work, "--json"], raised(lambda: run_facts.gather(work, "summary")), {0, 2}),
        (
            ["show", work, "records", "--jsonl"],
            raised(lambda: run_facts.export_records(Run(work), io.BytesIO())),
            {0, 2},
        ),
        (["diff", ref, work, "--json"], raised(lambda: diff_runs(ref, work)), {0, 1, 2}),
        (["diff", work, ref, "--json"], raised(lambda: diff_runs(work, ref)), {0, 1, 2}),
        (
            ["diff", ref, work, "--mode", "numeric", "--json"],
            raised(lambda: diff_runs(ref, work, mode="numeric")),
            {0, 1, 2},
        ),
        (["verify", work, "--json"], raised(lambda: verify_run(work)), {0, 1, 2}),
        (
            ["gate", work, "--reference", ref, "--json"],
            raised(lambda: gate_verdict.gate(work, ref)),
            {0, 1, 2},
        ),
        (["report", ref, work, "-o", out], raised(lambda: build_report([ref, work], out)), {0, 2}),
        (["watch", work, "--timeout", "5"], raised(lambda: Follower(work).poll()), {0, 2}),
    ]
    for args, expected, allowed in cases:
        result = invoke(args)
        check_contract(test, args, result, expected, allowed, case)
        if (
            "internal error" in result.stderr
        ):  # handled() turns a bug of ours into exit 3 with this line
            check_contract(test, args, result, expected, set(), case)
    args = ["check", work, "--json"]
    _check_case(test, args, invoke(args), work, case)


class MutatedFiles:
    """Mutated (above) over several files of the working run: each put back from the pristine one after."""

    def __init__(self, ref: Path, work: Path, rels: list[str]):
        self.parts = [Mutated(ref, work, rel) for rel in rels]

    def __enter__(self):
        return [p.__enter__() for p in self.parts]

    def __exit__(self, *exc):
        for p in self.parts:
            p.__exit__(*exc)
        return False


def _arrow_case(test: str, runs, data, without_index: bool) -> None:
    ref, _ = runs
    rel = data.draw(st.sampled_from(ARROW_FILES))
    index_rel = rel.replace(SUFFIX, ".steps.jsonl")
    what, raw = data.draw(mutated_arrow((ref / rel).read_bytes(), (ref / index_rel).read_bytes()))
    EXAMPLES_BY_OP[what.split("+")[0]] += 1
    _read_mutated(test, runs, rel, raw, what, without_index)


def _read_mutated(test: str, runs, rel: str, raw: bytes, what: str, without_index: bool) -> None:
    ref, work = runs
    before = pa.default_memory_pool().max_memory()
    with MutatedFiles(ref, work, [rel, rel.replace(SUFFIX, ".steps.jsonl")]) as (target, index):
        target.write_bytes(raw)
        if without_index:
            index.unlink()
        _run_readers(
            test,
            ref,
            work,
            f"{rel} ({what}{', no step index' if without_index else ''}) := {raw[:400]!r}...",
        )
    grew = (
        pa.default_memory_pool().max_memory() - before
    )  # the pool's peak only grows: what this case added
    assert grew < ARROW_PEAK_BYTES, (
        f"Arrow's memory pool peaked {grew} bytes higher: {what} on {rel}"
    )


EXAMPLES_BY_OP: Counter = Counter()
ARROW_PEAK_BYTES = (
    1 << 30
)  # the whole file's peak: a forged length that allocated gigabytes once shows here


@fuzz(60)
@given(data=st.data())
def test_fuzz_arrow_trajectory(runs, data):
    EXAMPLES["arrow_trajectory"] += 1
    _arrow_case("Arrow trajectory", runs, data, without_index=False)


@fuzz(40)
@given(data=st.data())
def test_fuzz_arrow_trajectory_without_index(runs, data):
    EXAMPLES["arrow_trajectory_without_index"] += 1
    _arrow_case("Arrow trajectory, no step index", runs, data, without_index=True)


# -- Arrow inputs that broke the contract once (the fuzzing above finds them at random)


def _forged_lz4_size(raw: bytes) -> bytes:
    """The first compressed buffer of step 1 says it holds 1 TiB (Arrow allocated it before decompressing)."""
    b = bytearray(raw)
    pos = lz4_frames(raw[arrow_messages(raw)[1].start :])[0] + arrow_messages(raw)[1].start - 8
    b[pos : pos + 8] = struct.pack("<q", 2**40)
    return bytes(b)


def _renamed_stream(raw: bytes) -> bytes:
    """Another writer's stream: our column types under other names, every value null. Its batch decoded under
    our SCHEMA validated, and a null digest crashed the readers (AttributeError in to_records)."""
    schema = pa.schema([f.with_name(f.name + "_") for f in SCHEMA])
    sink = io.BytesIO()
    with ipc.new_stream(sink, schema, options=ipc.IpcWriteOptions(compression="lz4")) as w:
        w.write_table(pa.table({f.name: pa.nulls(3, f.type) for f in schema}, schema=schema))
    return sink.getvalue()


def _foreign_schema(raw: bytes) -> bytes:
    """Step 1's schema message replaced by another stream's (the batches are still ours)."""
    f = _renamed_stream(raw)
    return f[: arrow_messages(f)[0].end] + raw[arrow_messages(raw)[0].end :]


ARROW_REGRESSIONS = {
    "LZ4 size forged to 1 TiB": _forged_lz4_size,
    "a renamed stream, all null": _renamed_stream,
    "a foreign schema message": _foreign_schema,
}


@pytest.mark.parametrize("without_index", [False, True])
@pytest.mark.parametrize("name", list(ARROW_REGRESSIONS))
def test_arrow_regressions(runs, name, without_index):
    ref, _ = runs
    rel = ARROW_FILES[0]
    raw = ARROW_REGRESSIONS[name]((ref / rel).read_bytes())
    _read_mutated("Arrow regression inputs", runs, rel, raw, name, without_index)
    first_step = raw[: arrow_messages(raw)[1].end]  # the schema message and the first record batch
    with pytest.raises(BadInput, match="not a trajectory record batch"):
        trajectory_decode.decode_step(ref / rel, first_step, "step 1")


def test_a_restarted_jobs_steps_after_the_end_of_stream_marker_are_read(tmp_path):
    """A job restarted into its run directory appends to the stream its first writer closed: the steps after
    that end-of-stream marker are the run's too (scan once stopped at the marker, losing them)."""
    path = tmp_path / f"rank-00000{SUFFIX}"
    for step in (1, 2):
        w = TrajectoryWriter(path)
        w.write_step([_rec(step, 0, "loss", 0, 0, "loss", [], 6.0 - step, tokens=8)])
        w.close()
    torn: list = []
    assert [trajectory_read.step_of(b) for _, _, b in trajectory_read.scan(path, torn)] == [
        1,
        2,
    ] and not torn


# -- files missing, empty, or replaced by a directory


@fuzz(24)
@given(
    rel=st.sampled_from(["manifest.lock.json", "run.json", "COMPLETE", *JSONL_FILES, *ARROW_FILES]),
    how=st.sampled_from(["missing", "empty", "directory"]),
)
def test_fuzz_run_files_missing_or_odd(runs, legacy_runs, rel, how):
    EXAMPLES["run_files_missing_or_odd"] += 1
    ref, work = _store_for(rel, runs, legacy_runs)
    with Mutated(ref, work, rel) as target:
        target.unlink()
        if how == "empty":
            target.write_bytes(b"")
        elif how == "directory":
            target.mkdir()
        _run_cases(f"{how} file", ref, work, f"{rel}: {how}")


# -- run-store inputs that broke the contract once, one test each (the fuzzing above finds them at random)


def _lock_with(path: str, value, delete: bool = False) -> bytes:
    doc = json.loads(json.dumps(_lock_doc()))
    *parents, last = path.split(".")
    cur = doc
    for k in parents:
        cur = cur[k]
    if delete:
        del cur[last]
    else:
        cur[last] = value
    return dumps(doc).encode()


DROP = object()


def _steps_with(**fields) -> bytes:
    """One step-index line, fields replaced (or DROPped)."""
    entry = {
        "step": 1,
        "offset": 0,
        "length": 1,
        "records": 1,
        "digest": "0" * 32,
        "time": {"start": 0.0, "collective_issue": 0.01, "end": 0.02},
    }
    entry.update(fields)
    return dumps({k: v for k, v in entry.items() if v is not DROP}).encode() + b"\n"


def _run_json(**fields) -> bytes:
    return dumps({"path": "recovered", "fault": None, "resume": None, **fields}).encode()


RUN_REGRESSIONS = {
    "lock: parallelism without dp": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.parallelism.dp", 0, True),
    ),
    "lock: parallelism.dp an object": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.parallelism.dp", {}),
    ),
    "lock: training a list": ("manifest.lock.json", lambda: _lock_with("manifest.training", [])),
    "lock: experiment null": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.experiment", None),
    ),
    "lock: experiment without name": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.experiment.name", 0, True),
    ),
    "lock: experiment name with markup": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.experiment.name", "[/x]"),
    ),
    "lock: model key with markup": (
        "manifest.lock.json",
        lambda: _lock_with("manifest.model.[/x]", 1),
    ),
    "run.json: a list": ("run.json", lambda: b"[]"),
    "run.json: resume without step": ("run.json", lambda: _run_json(resume={"checkpoint": "c"})),
    "run.json: resume a list": ("run.json", lambda: _run_json(resume=[1])),
    "run.json: resume step an object": (
        "run.json",
        lambda: _run_json(resume={"checkpoint": "c", "step": {"a": 1}}),
    ),
    "run.json: resume checkpoint with markup": (
        "run.json",
        lambda: _run_json(resume={"checkpoint": "[/x]", "step": 1}),
    ),
    "run.json: fault without name": (
        "run.json",
        lambda: _run_json(path="fault", fault={"step": 1}),
    ),
    "steps.jsonl: entry without records": (
        "trajectory/rank-00000.steps.jsonl",
        lambda: _steps_with(records=DROP),
    ),
    "steps.jsonl: records a list": (
        "trajectory/rank-00000.steps.jsonl",
        lambda: _steps_with(records=[]),
    ),
    "steps.jsonl: step a string": (
        "trajectory/rank-00000.steps.jsonl",
        lambda: _steps_with(step="1") + _steps_with(step=2),
    ),
    "steps.jsonl: step a list": ("trajectory/rank-00000.steps.jsonl", lambda: _steps_with(step=[])),
    "steps.jsonl: entry without step": (
        "trajectory/rank-00000.steps.jsonl",
        lambda: _steps_with(step=DROP),
    ),
    "steps.jsonl: sketch version a string": (
        "trajectory/rank-00000.steps.jsonl",
        lambda: _steps_with(sketch="2"),
    ),
    "trajectory: loss record with a list step": (
        "trajectory/rank-00000.jsonl",
        lambda: (
            dumps(
                {
                    "step": [1],
                    "micro_batch": 0,
                    "phase": "loss",
                    "rank": 0,
                    "index": 0,
                    "tensor": "loss",
                    "sum": 1.0,
                }
            ).encode()
            + b"\n"
        ),
    ),
    "trajectory: a directory": ("trajectory/rank-00000.jsonl", None),
    "arrow trajectory: a directory": ("trajectory/rank-00000.arrows", None),
    "events.jsonl: a directory": ("events.jsonl", None),
}


@pytest.mark.parametrize("name", list(RUN_REGRESSIONS))
def test_run_store_regressions(runs, legacy_runs, name):
    rel, make = RUN_REGRESSIONS[name]
    ref, work = _store_for(rel, runs, legacy_runs)
    with Mutated(ref, work, rel) as target:
        target.unlink()
        if make is None:
            target.mkdir()
        else:
            target.write_bytes(make())
        _run_cases("regression inputs", ref, work, name)


# -- a DeepSpeed config read into a manifest (freeze --from-deepspeed): BadInput or a frozen manifest, never
# anything else; the error names the DeepSpeed file (or the base manifest, or --set / --world-size)

DS_EXAMPLE = DEFAULT_MANIFEST.parent / "deepspeed" / "ds_config.json"


@fuzz(150)
@given(data=st.data(), world=st.one_of(st.none(), st.integers(-1, 9)))
def test_fuzz_deepspeed_config(manifest_dir, data, world):
    from disttrace.config.deepspeed import freeze_from_deepspeed

    EXAMPLES["deepspeed_config"] += 1
    raw = data.draw(mutated_json(json.loads(DS_EXAMPLE.read_text())))
    path = manifest_dir / "ds.json"
    path.write_bytes(raw)
    try:
        frozen, warnings = freeze_from_deepspeed(path, None, world)
    except BadInput as e:
        COUNTS[("DeepSpeed config", "BadInput")] += 1
        assert e.where in (str(path), str(DEFAULT_MANIFEST), "--world-size", "--set"), str(e)
        assert "\n" not in str(e), str(e)
        return
    COUNTS[("DeepSpeed config", "frozen")] += 1
    assert all(isinstance(w, str) and "\n" not in w for w in warnings)
    m = frozen.model()
    cfg = json.loads(raw)
    if isinstance(cfg.get("train_batch_size"), int):
        assert (
            cfg["train_batch_size"] == m.global_batch
        )  # DeepSpeed's identity holds in what was frozen


# ---------------------------------------------------------------- human output: text from the run store
# The human (non --json) output of check, gate, show, diff, report and lab prints strings read from the run store:
# tensor names, host names, fault names, failure reasons. Whatever they hold, the command answers with its
# verdict (never "internal error", exit 3) and prints them as written: rich markup ("[bold]", "[/x]") and
# emoji codes (":smile:") stay literal, and the HTML report escapes them.

import html  # noqa: E402

from disttrace.analysis import lab as lab_types  # noqa: E402
from disttrace.analysis.result import BoundKind, Divergence  # noqa: E402
from disttrace.cli import shared as cli_shared  # noqa: E402
from disttrace.views.lab import render as render_lab  # noqa: E402

MARKUP = [
    "[/x]",
    "[bold]",
    "[red]x[/red]",
    ":smile:",
    "[/]",
    "[link=x]y",
    "\\[b]",
    "x\\",
    "\\",
    "[[",
    "]",
    "[bold",
    "<b>&amp;",
    "</p><script>",
    "%s{0}",
]
# printable ASCII without spaces: text that must appear verbatim in the output
literal_text = st.one_of(
    st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12
    ),
    st.sampled_from(MARKUP),
    st.tuples(st.sampled_from(MARKUP), st.text(alphabet="[]/\\:ab", min_size=1, max_size=6)).map(
        "".join
    ),
)
HUMAN_PARAMS = [("tok_embeddings.weight", [512, 64]), ("norm.weight", [64])]


def _human_run(
    path: Path, lock: dict, name: str, host: str, reason: str, planted: bool, fmt: str = ARROW
) -> Path:
    """Two ranks, two steps; tensor `name` beside two ordinary ones. planted: rank 1's reduced `name` at
    step 2 differs (a replica that must agree does not; diff finds it too)."""
    if path.exists():
        shutil.rmtree(path)
    (path / "trajectory").mkdir(parents=True)
    (path / "manifest.lock.json").write_bytes(orjson.dumps(lock))
    fault = (
        {"name": name, "step": 2, "rank": 1, "params": {}, "point": "reduce", "expect": name}
        if planted
        else None
    )
    (path / "run.json").write_bytes(
        orjson.dumps({"path": "fault" if planted else "reference", "fault": fault, "resume": None})
    )
    params = HUMAN_PARAMS + [(name, [8])]
    for rank in (0, 1):
        steps = {}
        for step in (1, 2):
            recs = [_rec(step, 0, "loss", rank, 0, "loss", [], 6.0 - step / 10, tokens=256)]
            for phase, k in (("reduce", 0.2), ("optimizer", 0.3)):
                for i, (n, shape) in enumerate(params):
                    odd = planted and rank == 1 and step == 2 and phase == "reduce" and n == name
                    recs.append(
                        _rec(
                            step,
                            1,
                            phase,
                            rank,
                            i,
                            n,
                            shape,
                            k * (i + step) + (7.0 if odd else 0.0),
                        )
                    )
            steps[step] = recs
        write_trajectory(path, rank, steps, fmt)
    (path / "replicas.json").write_bytes(
        orjson.dumps(
            {
                "groups": {"dp": [[0, 1]]},
                "rules": [{"phase": "reduce", "tensors": "*", "dim": "dp", "relation": "agree"}],
            }
        )
    )
    (path / "topology.json").write_bytes(
        orjson.dumps(
            {
                "mesh_shape": {"pp": 1, "dp": 2, "tp": 1},
                "mesh_dims": ["dp"],
                "groups": {"dp": [[0, 1]]},
                "ranks": [
                    {
                        "rank": r,
                        "host": host,
                        "node_rank": 0,
                        "local_rank": r,
                        "coords": {"pp": 0, "dp": r, "tp": 0},
                    }
                    for r in (0, 1)
                ],
            }
        )
    )
    events = [{"event": "run_started", "time": 1.0}]
    if planted:
        events += [
            {"event": "fault_fired", "time": 1.5, "fault": name, "step": 2, "rank": 1},
            {"event": "rank_failed", "time": 2.0, "rank": 1, "reason": reason},
        ]
    (path / "events.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    (path / "COMPLETE").write_bytes(orjson.dumps({"completed": 3.0, "steps": 2}) + b"\n")
    return path


@pytest.fixture(scope="module")
def human(tmp_path_factory):
    """A wide console for the CLI's human output, so that a line is a line (the check is that text is
    printed as written, not how rich wraps it)."""
    root = tmp_path_factory.mktemp("human")
    saved = cli_shared.err
    cli_shared.err = Console(stderr=True, width=1000, no_color=True, highlight=False, emoji=False)
    yield root, freeze(None).model_dump()
    cli_shared.err = saved


def _lab_result(name: str, ref: Path, work: Path):
    """What `lab` hands its renderer, with the fuzzed text wherever a run store's text goes."""
    first = Divergence(
        step=2,
        micro_batch=1,
        phase="reduce",
        rank=1,
        tensor=name,
        index=0,
        a=None,
        b=None,
        rel_err=None,
        bound=None,
        missing_in=None,
        note=None,
        bound_kind=BoundKind.BITWISE,
    )

    def path(**kw):
        return lab_types.PathOutcome(
            run_dir=str(work),
            exit=0,
            final_loss=5.9,
            first_divergence=first,
            gate=False,
            gate_failed=[name],
            **kw,
        )

    return lab_types.LabResult(
        manifest_id="0" * 64,
        fault={"name": name, "step": 2, "rank": 1},
        paths=lab_types.LabPaths(
            reference=lab_types.PathOutcome(run_dir=str(ref), final_loss=5.9, gate=True),
            fault=path(),
            recovered=path(resumed_from_step=1, equal_to_reference=False),
        ),
        expected_signature=lab_types.Signature(
            expect=name, observed=f"first divergence at step 2 {name}", held=False
        ),
        prediction=lab_types.Prediction(
            held=False,
            missed=[f"phase: predicted {name}, observed reduce"],
            predicted={"phase": name},
            observed=None,
        ),
        accepted=False,
        diffs=None,  # the renderer never reads them
    )


def _human_case(
    root: Path, lock: dict, name: str, host: str, reason: str, literal: bool, fmt: str = ARROW
) -> None:
    ref = _human_run(root / "reference", lock, name, host, reason, planted=False, fmt=fmt)
    work = _human_run(root / "fault", lock, name, host, reason, planted=True, fmt=fmt)
    case = f"{fmt} store: tensor/fault name {name!r}, host {host!r}, reason {reason!r}"
    out = root / "report.html"
    for args, allowed, expect in (
        (["check", work], {1}, [f"tensor {name}:"]),
        (["gate", work, "--reference", ref], {1}, [f"tensor {name}", f"reduce {name}:"]),
        (
            ["show", work],
            {0},
            [f"fault: {name} at step 2", f"expected first divergence: {name}", reason, host],
        ),
        (["show", work, "topology"], {0}, [host]),
        (["show", work, "events"], {0}, []),
        (["diff", ref, work], {1}, []),
        (["report", ref, work, "-o", out], {0}, []),
    ):
        result = runner.invoke(cli_shared.app, [str(a) for a in args], env={"NO_COLOR": "1"})
        COUNTS[("human output", f"{args[0]} exit {result.exit_code}")] += 1
        try:
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                crash_report(result, args)
            )
            assert result.exit_code in allowed, crash_report(result, args)
            for text in expect if literal else []:
                assert text in result.stderr, (
                    f"{text!r} not printed as written:\n{result.stderr[-3000:]}"
                )
            if args[0] == "report" and literal:
                page = out.read_text(encoding="utf-8")
                assert html.escape(name) in page and "<script>" not in page, (
                    f"{name!r} not escaped in the report"
                )
        except AssertionError as e:
            if not COLLECT:
                raise AssertionError(f"{case}\n{e}") from None
            FAILURES.setdefault(signature(result, str(e)), f"{case}\n{e}"[:6000])
    con = Console(file=io.StringIO(), width=1000, no_color=True, emoji=False)
    try:
        render_lab(_lab_result(name, ref, work), con)
    except Exception:
        raise AssertionError(f"{case}\nlab's renderer failed:\n{traceback.format_exc()}") from None
    printed = con.file.getvalue()
    COUNTS[("human output", "lab render")] += 1
    for text in (
        [f"expected signature ({name})", f"FAIL {name}", f"predicted {name}, observed"]
        if literal
        else []
    ):
        assert text in printed, f"{case}\n{text!r} not printed as written by lab:\n{printed}"


@fuzz(60)
@given(data=st.data())
def test_fuzz_human_output_prints_run_store_text_as_written(human, data):
    EXAMPLES["human_output"] += 1
    root, lock = human
    literal = data.draw(st.booleans())
    text = literal_text if literal else st.text(min_size=1, max_size=16)
    name, host, reason = data.draw(text), data.draw(text), data.draw(text)
    _human_case(
        root, lock, name, host, reason, literal, data.draw(st.sampled_from([ARROW, ARROW, LEGACY]))
    )


@pytest.mark.parametrize("fmt", [ARROW, LEGACY])
@pytest.mark.parametrize("name", ["w[/x]", "[bold]", ":smile:", "x\\", "<b>&amp;"])
def test_markup_in_a_tensor_name_prints_literally(human, name, fmt):
    root, lock = human
    _human_case(root, lock, name, f"host{name}", f"died: {name}", literal=True, fmt=fmt)


def test_ci_total_is_the_sum_of_the_counts():
    assert sum(DECLARED) == CI_TOTAL, (sum(DECLARED), CI_TOTAL)


# last in the file, so it runs after every fuzz test (DISTTRACE_FUZZ_COLLECT=1)


def test_zz_no_collected_failures():
    assert not FAILURES, f"{len(FAILURES)} distinct failures: " + "; ".join(FAILURES)
    if LONG and len(EXAMPLES) == len(DECLARED):  # the long run's promise, when every fuzz test ran
        assert sum(EXAMPLES.values()) >= LONG, dict(EXAMPLES)


# -- shape edits of every JSON and JSON-lines file kind of a real run store (written by a real job): each
# edit keeps the syntax and changes what a field holds (another type, a missing key, a container where a
# scalar was), and every command that reads the file must answer it with its exit code, never a crash

SHAPE_FILES = [
    "manifest.lock.json",
    "run.json",
    "env.json",
    "topology.json",
    "replicas.json",
    "COMPLETE",
    "checkpoints/step-000002/INDEX.json",
    "events.jsonl",
    "trajectory/rank-00000.steps.jsonl",
    "collectives/rank-00000.frames",
    "memory/rank-00000.jsonl",
    "steps/rank-00000.jsonl",
]
# each drawn value a fresh object (sampled_from hands out the same list each time: an edit into it must not
# change what later examples draw)
SHAPE_VALUES = st.one_of(
    json_values,
    st.sampled_from([None, True, -1, 0, 2**63, 1.5, "", "x", [], {}, [1], {"a": 1}, "../../x"]),
).map(copy.deepcopy)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(a real reference run of four steps, a copy that each case edits and restores)."""
    from conftest import DEFAULT, SHORT, cli, last_line

    root = tmp_path_factory.mktemp("real")
    ref = last_line(cli("run", DEFAULT, *SHORT, "--out", root / "runs", "--quiet", check=0))
    work = root / "work" / ref.parent.name / ref.name
    shutil.copytree(ref, work)
    return ref, work


def _shape_edit(draw, doc):
    """One to three shape edits of a JSON document: a value replaced by one of another kind, a key removed, a
    container emptied or replaced by a scalar."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            return draw(SHAPE_VALUES)
        p = draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in p[:-1]:
                parent = parent[k]
            op = draw(st.sampled_from(["replace", "replace", "delete", "empty"]))
            if op == "delete" and isinstance(parent, dict):
                parent.pop(p[-1], None)
            elif op == "empty" and isinstance(parent[p[-1]], (dict, list)):
                parent[p[-1]] = type(parent[p[-1]])()
            else:
                parent[p[-1]] = draw(SHAPE_VALUES)
        except (KeyError, IndexError, TypeError):
            pass
    return doc


@st.composite
def shape_edited(draw, rel: str, raw: bytes) -> bytes:
    if rel.endswith(".json") or rel == "COMPLETE":
        return dumps(_shape_edit(draw, json.loads(raw))).encode("utf-8", "surrogatepass")
    # the Flight Recorder's trace: its lines edited, then framed again
    framed = rel.endswith(collframes.SUFFIX)
    if framed:
        raw = b"".join(collframes.frames(Path(rel), raw))
    lines = raw.split(b"\n")[:-1]
    for _ in range(draw(st.integers(1, 2))):
        i = draw(st.integers(0, len(lines) - 1))
        line = json.loads(lines[i].decode("utf-8", "surrogatepass"))
        lines[i] = dumps(_shape_edit(draw, line)).encode("utf-8", "surrogatepass")
    out = b"\n".join(lines) + b"\n"
    return collframes.encode(out) if framed else out


def _summary_and_topology(work: Path) -> None:
    """What `show RUN` reads: the summary's facts, then topology.json for the human part."""
    run_facts.gather(work, "summary")
    Run(work).topology()


def _shape_readers(test: str, ref: Path, work: Path, case: str) -> None:
    trace_out = work.parent / "trace.json"
    cases = [
        (["show", work, "--json"], raised(lambda: _summary_and_topology(work)), {0, 2}),
        *(
            (["show", work, view], raised(lambda v=view: run_facts.gather(work, v)), {0, 1, 2})
            for view in ("checkpoints", "topology", "collectives", "memory", "events")
        ),
        (["diff", ref, work, "--json"], raised(lambda: diff_runs(ref, work)), {0, 1, 2}),
        (["verify", work, "--json"], raised(lambda: verify_run(work)), {0, 1, 2}),
        (
            ["trace", work, "-o", trace_out],
            raised(lambda: build_trace(Run(work))),
            {0, 2},
        ),
    ]
    for args, expected, allowed in cases:
        result = invoke(args)
        if "internal error" in result.stderr:
            check_contract(test, args, result, expected, set(), case)
        check_contract(test, args, result, expected, allowed, case)
    args = ["check", work, "--json"]
    _check_case(test, args, invoke(args), work, case)


@fuzz(24)
@given(data=st.data())
def test_fuzz_shape_edits_of_every_file_kind(real, data):
    EXAMPLES["shape_edits"] += 1
    ref, work = real
    rel = data.draw(st.sampled_from(SHAPE_FILES))
    raw = data.draw(shape_edited(rel, (ref / rel).read_bytes()))
    with Mutated(ref, work, rel) as target:
        target.write_bytes(raw)
        _shape_readers(rel, ref, work, f"{rel} := {raw[:3000]!r}")
