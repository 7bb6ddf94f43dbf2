"""What `diff_runs` returns: `DiffResult` and its parts (docs/design.md, "Order", "Equality").

Each part's fields are its `diff --json` keys, in the document's order; `DiffResult.to_json()` is the
document (`disttrace/jsondoc.py`). Views, the gate and the lab read attributes.
"""

from __future__ import annotations

import bisect
import enum
import io
import itertools
import pickle
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disttrace.jsondoc import JsonDoc, Streamed, omit_none


class BoundKind(enum.StrEnum):
    """Where the bound a value is held to comes from."""

    BITWISE = "bitwise"  # no bound: digests must match
    USER = "user"  # explicit rtol / atol given by the caller
    CALIBRATED = "calibrated"  # measured run-to-run noise (`disttrace calibrate`)
    DERIVED = "derived"  # from the unit roundoff, reduction size and steps since agreement
    NONE = "none"  # no sound bound exists (a parameter under Adam): the error is reported, never judged

    @property
    def label(self) -> str:
        """How views name it next to a bound."""
        return {"bitwise": "bitwise", "user": "explicit"}.get(self.value, self.value)


@dataclass
class RecordStats(JsonDoc):
    """One side's record (or logical tensor) at a divergence: what its digest and statistics were."""

    digest: str | None = None
    sum: float | None = None
    norm: float | None = None
    sketch: list[float] | None = None
    nonfinite: int | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    numel: int | None = None

    @classmethod
    def of(cls, rec: dict) -> RecordStats:
        return cls(
            digest=rec.get("digest"),
            sum=rec.get("sum"),
            norm=rec.get("norm"),
            sketch=rec.get("sketch"),
            nonfinite=rec.get("nonfinite"),
            dtype=rec.get("dtype"),
            shape=rec.get("shape"),
            numel=rec.get("numel"),
        )


@dataclass(slots=True)
class Unit:
    """diff's comparison unit: one record (or logical tensor) of both runs at a step, compared. `a` and `b`
    are each side's statistics (`RecordStats`), None where that side lacks it; `rel_err` None where no relative error exists (missing, non-finite)."""

    step: int
    micro_batch: int
    phase: str
    rank: int
    tensor: str | None
    index: int
    a: RecordStats | None
    b: RecordStats | None
    rel_err: float | None
    bound: float | None
    diverged: bool
    missing_in: str | None  # "a" | "b"
    note: str | None


@dataclass
class Divergence(JsonDoc):
    """The first divergence: the smallest (step, micro_batch, phase, rank, index) whose records differ or
    exist on one side only."""

    step: int
    micro_batch: int
    phase: str
    rank: int
    tensor: str | None
    index: int
    a: RecordStats | None
    b: RecordStats | None
    rel_err: float | None
    bound: float | None
    missing_in: str | None  # "a" | "b" | None
    note: str | None
    bound_kind: BoundKind

    @classmethod
    def of_unit(cls, unit: Unit, kind: BoundKind) -> Divergence:
        """From diff's comparison unit."""
        return cls(
            step=unit.step,
            micro_batch=unit.micro_batch,
            phase=unit.phase,
            rank=unit.rank,
            tensor=unit.tensor,
            index=unit.index,
            a=unit.a,
            b=unit.b,
            rel_err=unit.rel_err,
            bound=unit.bound,
            missing_in=unit.missing_in,
            note=unit.note,
            bound_kind=BoundKind(kind),
        )


@dataclass
class RankEntry(JsonDoc):
    """What one rank showed at one step. The error fields exist only where some tensor was not bit-equal."""

    differing: int
    total: int
    max_rel_err_by_phase: dict[str, float] = field(default_factory=dict)
    inexact: int = 0  # not bit-equal (within or beyond the bound)
    max_rel_err: float | None = None
    max_ratio: float | None = None  # largest error / bound
    hard: int = 0  # divergent without a relative error: missing, non-finite, shape

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "differing": self.differing,
            "total": self.total,
            "max_rel_err_by_phase": dict(self.max_rel_err_by_phase),
        }
        if self.inexact:
            d.update(
                inexact=self.inexact,
                max_rel_err=self.max_rel_err,
                max_ratio=self.max_ratio,
                hard=self.hard,
            )
        return d


@dataclass
class StepEntry(JsonDoc):
    """One compared step: per rank what differed; in numeric mode the bound each phase was held to."""

    step: int
    equal: bool
    differing: int
    ranks: dict[int, RankEntry]
    bound_by_phase: dict[str, float | None] | None = omit_none()
    bound_kind_by_phase: dict[str, BoundKind] | None = omit_none()

    def rank(self, r: int) -> RankEntry | None:
        return self.ranks.get(r)


_I32 = 1 << 31


class StepTable(Streamed, Sequence):
    """Step entries held as columns (`numeric.by_step`: an entry per step before the first divergence with an
    inexact tensor, every rank's summary in it, the `--json` contract): ~70 bytes a rank-step and 9 a phase,
    where the `StepEntry`s with their `RankEntry`s took ~500 (tracemalloc). Reading one builds its `StepEntry`, whose
    `ranks` builds a `RankEntry` when read (`RankRows`); `--json` writes the entries one at a time
    (`jsondoc.Streamed`): the same bytes as the list of the entries. An entry whose values are not plain
    ints and floats (a numpy scalar) is kept whole, so nothing is ever printed otherwise than it was.

    What is held does not grow with the steps: once the steps appended since the last spill hold SPILL_ROWS
    rank rows, their columns (and each step's bounds) go to a temporary file as one chunk, and a chunk is read
    back, one at a time, when an entry of it is read (the views and `--json` read the steps in order: each
    chunk once)."""

    SPILL_ROWS = 1 << 15  # rank rows a chunk holds before it is written out (~3 MB as columns)

    def __init__(self, entries=()):
        self._names: list[str] = []
        self._code: dict[str, int] = {}
        self._tail = _Chunk(self._names)  # the steps appended since the last spill
        self._chunks: list[
            tuple[int, int, int]
        ] = []  # spilled: (first step's position, offset, length)
        self._spilled = 0  # steps in the spilled chunks
        self._file = None  # the temporary file the chunks go to (made at the first spill)
        self._cached: tuple[int, _Chunk] | None = None  # the chunk read back last, by its number
        for e in entries:
            self.append(e)

    def append(self, e: StepEntry) -> None:
        tail = self._tail
        if not self._packable(e.ranks):
            tail.head.append(e)
        else:
            tail.add(e, self._code)
        if len(tail.rank) >= self.SPILL_ROWS:
            self._spill()

    def _spill(self) -> None:
        import tempfile

        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="disttrace-by-step-")
        data = pickle.dumps(self._tail.state(), protocol=pickle.HIGHEST_PROTOCOL)
        f = self._file
        f.seek(0, 2)
        self._chunks.append((self._spilled, f.tell(), len(data)))
        f.write(data)
        self._spilled += len(self._tail.head)
        self._tail = _Chunk(self._names)

    def _chunk(self, k: int) -> tuple[_Chunk, int]:
        """The chunk that holds the k-th step, and the step's position in it."""
        if k >= self._spilled:
            return self._tail, k - self._spilled
        i = bisect.bisect_right(self._chunks, k, key=lambda c: c[0]) - 1
        first, offset, length = self._chunks[i]
        if self._cached is None or self._cached[0] != i:
            self._file.seek(offset)
            state = _ChunkUnpickler(io.BytesIO(self._file.read(length))).load()
            self._cached = (i, _Chunk.of_state(self._names, state))
        return self._cached[1], k - first

    def _packable(self, ranks) -> bool:
        """Would one step's ranks come back from the columns as they are (ranks ascending, plain ints and
        floats)? Their phases get codes."""
        if type(ranks) is not dict:
            return False
        last = None
        for r, x in ranks.items():
            if type(r) is not int or (last is not None and r <= last) or type(x) is not RankEntry:
                return False
            last = r
            if not -_I32 <= r < _I32 or type(x.max_rel_err_by_phase) is not dict:
                return False
            for v in (
                x.differing,
                x.total,
                x.inexact,
                x.hard,
            ):  # a loop, not any(): ~2x a rank-step
                if type(v) is not int or not -_I32 <= v < _I32:
                    return False
            for v in (x.max_rel_err, x.max_ratio):
                if v is not None and type(v) is not float:
                    return False
            for name, v in x.max_rel_err_by_phase.items():
                if type(name) is not str or type(v) is not float:
                    return False
                if name not in self._code:
                    if len(self._names) == 255:
                        return False
                    self._code[name] = len(self._names)
                    self._names.append(name)
        return True

    def _entry(self, k: int) -> StepEntry:
        chunk, j = self._chunk(k)
        return chunk.entry(j)

    def __len__(self) -> int:
        return self._spilled + len(self._tail.head)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self._entry(j) for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        return self._entry(k)

    def __iter__(self) -> Iterator[StepEntry]:
        return (self._entry(k) for k in range(len(self)))

    def stream(self) -> Iterator[StepEntry]:
        return iter(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __reduce__(self):  # a copy holds its entries, not this process's temporary file
        return (StepTable, (list(self),))

    def __repr__(self) -> str:
        return f"StepTable({len(self)} steps, {len(self._chunks)} chunks written out)"


class _ChunkUnpickler(pickle.Unpickler):
    """Reads back a chunk this process wrote (its own temporary file, never a run store's bytes), and even so
    builds nothing but what a chunk holds: arrays, this module's entries, numpy scalars of an entry kept
    whole."""

    _ALLOWED = {
        ("array", "array"),
        ("array", "_array_reconstructor"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):
        if module == __name__ or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a by_step chunk holds no {module}.{name}")


class _Chunk:
    """Consecutive steps of a `StepTable` as columns: per step its head (step, equal, differing, bounds,
    kinds, first row), or a `StepEntry` kept whole; per rank row its rank, four ints, two floats, which of
    them are None, and where its phases lie in the phase columns."""

    __slots__ = ("names", "head", "rank", "ints", "floats", "none", "at", "phase", "value")

    def __init__(self, names: list[str]):
        self.names = names  # the table's, shared: a code into it
        self.head: list = []
        self.rank = array("i")
        self.ints = array("i")  # differing, total, inexact, hard: four a row
        self.floats = array("d")  # max_rel_err, max_ratio: two a row (flags say which are None)
        self.none = array("B")  # bit 0: max_rel_err is None, bit 1: max_ratio is None
        self.at = array("q", [0])  # each row's first phase in phase / value
        self.phase = array("B")  # a code into names
        self.value = array("d")

    def state(self) -> tuple:
        return tuple(getattr(self, k) for k in self.__slots__[1:])

    @classmethod
    def of_state(cls, names: list[str], state: tuple) -> _Chunk:
        c = cls.__new__(cls)
        c.names = names
        for k, v in zip(cls.__slots__[1:], state):
            setattr(c, k, v)
        return c

    def add(self, e: StepEntry, code: dict[str, int]) -> None:
        """A packable entry's columns (`code`: the table's, which has given its phases theirs)."""
        self.head.append(
            (e.step, e.equal, e.differing, e.bound_by_phase, e.bound_kind_by_phase, len(self.rank))
        )
        for r, x in e.ranks.items():
            self.rank.append(r)
            self.ints.extend((x.differing, x.total, x.inexact, x.hard))
            self.floats.append(0.0 if x.max_rel_err is None else x.max_rel_err)
            self.floats.append(0.0 if x.max_ratio is None else x.max_ratio)
            self.none.append((x.max_rel_err is None) | (x.max_ratio is None) << 1)
            for name, v in x.max_rel_err_by_phase.items():
                self.phase.append(code[name])
                self.value.append(v)
            self.at.append(len(self.phase))

    def rank_entry(self, row: int) -> RankEntry:
        d, t, i, h = self.ints[4 * row : 4 * row + 4]
        none = self.none[row]
        a, z = self.at[row], self.at[row + 1]
        names = self.names
        return RankEntry(
            d,
            t,
            {names[c]: v for c, v in zip(self.phase[a:z], self.value[a:z])},
            inexact=i,
            max_rel_err=None if none & 1 else self.floats[2 * row],
            max_ratio=None if none & 2 else self.floats[2 * row + 1],
            hard=h,
        )

    def entry(self, j: int) -> StepEntry:
        head = self.head[j]
        if isinstance(head, StepEntry):
            return head
        step, equal, differing, bounds, kinds, first = head
        end = next(
            (
                h[5]
                for h in itertools.islice(self.head, j + 1, None)
                if not isinstance(h, StepEntry)
            ),
            len(self.rank),
        )
        return StepEntry(step, equal, differing, RankRows(self, first, end), bounds, kinds)


class RankRows(Mapping):
    """One step's ranks of a `StepTable` (rows first..end of a chunk, ranks ascending) as `StepEntry.ranks`
    reads them: a `RankEntry` built when one is read."""

    __slots__ = ("_t", "_a", "_z")

    def __init__(self, chunk: _Chunk, first: int, end: int):
        self._t, self._a, self._z = chunk, first, end

    def __getitem__(self, r) -> RankEntry:
        i = bisect.bisect_left(self._t.rank, r, self._a, self._z)
        if i == self._z or self._t.rank[i] != r:
            raise KeyError(r)
        return self._t.rank_entry(i)

    def __iter__(self) -> Iterator[int]:
        return iter(self._t.rank[self._a : self._z])

    def __len__(self) -> int:
        return self._z - self._a

    def to_dict(self) -> dict[str, Any]:
        """As `jsondoc.plain` writes a dict of int keys."""
        return {str(r): self._t.rank_entry(self._a + j).to_dict() for j, r in enumerate(self)}


@dataclass
class SideSummary(JsonDoc):
    """One run as diff read it."""

    path: str
    kind: str | None  # reference | fault | recovered (None: run.json does not say)
    complete: bool
    manifest_id: str | None
    resume_step: int | None
    ranks: list[int]
    steps: list[int] | None  # [first, last] of the steps every rank holds


@dataclass
class TopologyComparison(JsonDoc):
    same: bool
    differs: list[str]  # the topology fields that differ


@dataclass
class ComparedSteps(JsonDoc):
    first: int
    last: int
    count: int
    why: str  # why these steps (every gap and cut explained)
    full: bool  # every step of the manifest's training


@dataclass
class Tolerance(JsonDoc):
    """What the comparison was held to. `derivation` holds the bound's ingredients (analysis/tolerance.py's
    `explain`: formula, u, c, T, d, per_step) for derived and calibrated bounds."""

    kind: BoundKind
    bound: float | None = None  # bitwise: 0
    rtol: float | None = None  # user
    atol: float | None = None  # user
    file: str | None = None  # calibrated: the calibration file
    safety: Any = None  # calibrated: its safety factor
    manifest_id: str | None = None  # calibrated: the manifest it calibrates
    elsewhere: str | None = None  # calibrated: what holds where it measured nothing ("derived")
    since_step: int | None = None  # derived, calibrated: the step the runs last agreed at
    derivation: dict[str, Any] = field(default_factory=dict)
    # derived, calibrated: what a relative error is relative to: "magnitudes" (the ||X|| ||dY|| behind each
    # gradient, when both runs recorded them) or "norm" (each record's own norm)
    scale: str | None = None
    found: bool | None = None  # calibrated: the calibration was found beside the run (not named)
    # derived, calibrated: per phase, the classes of records held to another figure than the phase's bound (a
    # factor on it, or "none": analysis/diff/sensitivity.py's `classes`); shown in `numeric.sensitivity`
    sensitivity_classes: dict[str, dict[str, float | str]] | None = None

    @property
    def per_step(self) -> float | None:
        return self.derivation.get("per_step")

    def to_dict(self) -> dict[str, Any]:
        k = self.kind
        if k is BoundKind.BITWISE:
            return {"kind": k.value, "bound": self.bound}
        if k is BoundKind.USER:
            return {"kind": k.value, "rtol": self.rtol, "atol": self.atol}
        d: dict[str, Any] = {"kind": k.value}
        if k is BoundKind.CALIBRATED:
            d.update(
                file=self.file,
                safety=self.safety,
                manifest_id=self.manifest_id,
                elsewhere=self.elsewhere,
            )
            if self.found is not None:
                d["found"] = self.found
        d["since_step"] = self.since_step
        if self.scale is not None:
            d["scale"] = self.scale
        d.update(self.derivation)
        return d


@dataclass
class WorstRatio(JsonDoc):
    step: int
    rank: int
    rel_err: float
    bound: float


@dataclass
class PhaseWorst(JsonDoc):
    """Numeric mode, one phase: the largest relative error seen (and its bound), and the largest error to
    bound ratio (where it was)."""

    max_rel_err: float = -1.0
    bound: float | None = None
    ratio: float | None = None
    step: int = 0
    rank: int = 0
    bound_kind: BoundKind = BoundKind.DERIVED
    max_ratio: float | None = omit_none()
    max_ratio_at: WorstRatio | None = omit_none()


@dataclass
class PhaseSensitivity(JsonDoc):
    """Numeric mode, one phase: the smallest relative change diff would have flagged there, i.e. the bound its
    rel_err was held to (docs/tolerance.md, "Sensitivity"), over the steps whose records there were held to
    one (some record not bit-equal)."""

    bound_kind: BoundKind  # where the largest bound came from
    max: (
        float | None
    )  # the largest bound (None: a user's atol, which depends on each record's scale)
    median: float | None
    step: int  # where the largest was
    steps: int  # steps held to a bound
    # the classes of records whose figure is not the phase's: a number (exp_avg_sq: twice it) or "none" (no
    # sound bound: the diff could not have seen a change of theirs here)
    classes: dict[str, float | str] | None = omit_none()


@dataclass
class NumericSummary(JsonDoc):
    by_phase: dict[str, PhaseWorst]
    sensitivity: dict[str, PhaseSensitivity]
    by_step: Sequence[
        StepEntry
    ]  # steps before the first divergence with some inexact tensor (StepTable)


@dataclass
class DiffStats(JsonDoc):
    tensors_compared: int
    bit_equal: int
    steps_read: int  # (step, rank) pairs read; the others were skipped by their index digest
    index: bool
    steps_hash_checked: int


@dataclass
class RecordsRead(JsonDoc):
    a: int
    b: int


@dataclass
class DiffResult(JsonDoc):
    """The comparison of run B against run A (the `diff --json` document)."""

    equal: bool
    mode: str  # bitwise | numeric
    a: SideSummary
    b: SideSummary
    topology: TopologyComparison
    compared_steps: ComparedSteps
    ranks: list[int]  # the grid's rows: across topologies values are attributed to B's ranks
    first_divergence: Divergence | None
    propagation: list[StepEntry]  # from the first divergent step on
    recovered_steps: list[int]  # steps after the first divergence where everything is equal again
    tolerance: Tolerance
    stats: DiffStats
    records_read: RecordsRead  # records parsed, each side
    warnings: list[str]
    compared_phases: list[str] | None = omit_none()  # across topologies
    numeric: NumericSummary | None = omit_none()

    @property
    def divergent_steps(self) -> int:
        return len(self.propagation) - len(self.recovered_steps)

    def step_entries(self) -> dict[int, StepEntry]:
        """Every step the result holds an entry for (numeric steps before the divergence, then propagation)."""
        out = {e.step: e for e in (self.numeric.by_step if self.numeric else [])}
        out.update((e.step, e) for e in self.propagation)
        return out
