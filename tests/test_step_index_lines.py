"""The step index read as plain lines (Run.step_index_lines, what diff reads) refuses exactly what the models'
reader (Run.step_index) refuses, with the same message, and accepts the same lines unchanged: the quick type
test in front of the models may only ever send a line on to them, never accept one they refuse. The oracle is
pydantic's own verdict on each line (StepIndexEntry, StepTimes)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrace.errors import BadInput
from disttrace.store.documents import StepTimes
from disttrace.store.records import StepIndexEntry
from disttrace.store.rundir import Run, _plain_index_line

# JSON values of every kind, the ones a field is easily confused with first (a bool for an int, a float for
# an int, a negative int, a string of digits)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "7", "ab" * 16]),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def _good(step: int) -> dict:
    return {
        "step": step,
        "offset": 10 * step,
        "length": 10,
        "records": 3,
        "digest": "d" * 32,
        "time": {"start": 1.5, "collective_issue": 2, "end": 3.25},
        "sha256": "e" * 64,
        "xxh3": "f" * 32,
        "chain": "c" * 64,
    }


_FIELDS = ("step", "offset", "length", "records", "digest", "time", "sha256", "xxh3", "chain")
_TIME = ("start", "collective_issue", "end", "spans")


@st.composite
def _lines(draw) -> dict:
    """A writer's line with some fields replaced, removed or added, at the top level or in its `time`."""
    line = _good(draw(st.integers(min_value=0, max_value=5)))
    for k in draw(st.lists(st.sampled_from(_FIELDS + ("extra",)), max_size=3)):
        if draw(st.booleans()):
            line.pop(k, None)
        else:
            line[k] = draw(_json)
    if isinstance(line.get("time"), dict):
        for k in draw(st.lists(st.sampled_from(_TIME + ("other",)), max_size=2)):
            line["time"][k] = draw(_json)
    return line


def _models_accept(line: dict) -> bool:
    try:
        StepIndexEntry.parse_line(line, "x", 1)
        StepTimes.parse_line(line.get("time") or {}, "x", 1)
    except BadInput:
        return False
    return True


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_lines())
def test_quick_test_accepts_only_what_the_models_accept(line):
    if _plain_index_line(line):
        assert _models_accept(line), line


def test_quick_test_takes_the_writers_lines():
    # what makes it quick: the lines a run's writer writes never go through a model
    assert _plain_index_line(_good(1))
    assert _plain_index_line({k: v for k, v in _good(1).items() if k != "time"})
    assert not _plain_index_line({**_good(1), "step": True})
    assert not _plain_index_line({**_good(1), "length": -1})
    assert not _plain_index_line({**_good(1), "time": {"end": False}})


def _run_with(tmp_path, lines: list[dict]) -> Run:
    traj = tmp_path / "run" / "trajectory"
    traj.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "manifest.lock.json").write_bytes(
        orjson.dumps({"manifest": {}, "manifest_id": "f" * 64})
    )
    (traj / "rank-00000.steps.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
    return Run(tmp_path / "run")


def _outcome(read) -> tuple:
    try:
        r = read()
    except BadInput as e:
        return ("refused", str(e))
    return ("read", [e if isinstance(e, dict) else e.as_read() for e in r.records], r.torn)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(_lines(), min_size=1, max_size=4))
def test_both_readers_agree(tmp_path, lines):
    run = _run_with(tmp_path, lines)
    models, plain = _outcome(lambda: run.step_index(0)), _outcome(lambda: run.step_index_lines(0))
    assert plain == models
    # the controls: each outcome is the one the models give line by line
    assert (models[0] == "read") == all(_models_accept(e) for e in lines)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"records": "3"}, "records"),
        ({"offset": 1.0}, "offset"),
        ({"time": {"start": "0"}}, "start"),
    ],
)
def test_a_bad_line_after_good_ones_is_named(tmp_path, bad, field):
    run = _run_with(tmp_path, [_good(1), _good(2), {**_good(3), **bad}])
    with pytest.raises(BadInput) as e:
        run.step_index_lines(0)
    assert "line 3" in str(e.value) and field in str(e.value)
