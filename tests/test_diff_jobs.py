"""diff spread over processes and machines (analysis/diff/parallel/, docs/scale.md): `--jobs N` and the merge of
`--ranks` / `--steps` partials give the one-process `--json` byte for byte, on stores with a planted
divergence (whose coordinates are the oracle) and on equal stores, bitwise, numeric and across topologies;
a partial never claims "equal"; partials of other runs or options, overlapping, incomplete or malformed
ones are refused (exit 2, naming the file and field).

The stores are written by the recorder's own writer (tests/test_diff_synthetic.py's builders)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import orjson
import pytest
from conftest import cli
from test_diff_synthetic import FORMAT, digest, gen_records, manifest, shard_records, write_run
from test_json_contract import DIFFS, ZERO1, _golden, _named

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.diff import parallel as partial
from disttrace.errors import EXIT_PARTIAL, BadInput

STEPS = 8
PLANT = (5, 2, "backward", 1)  # (step, rank, phase, index) of the planted value
PLANT_X = (6, 1, "optimizer", 2)  # across topologies: one shard on B's rank 1


def _planted(recs: dict, at, delta: float) -> dict:
    out = copy.deepcopy(recs)
    step, rank, phase, index = at
    for r in out[rank]:
        if (r["step"], r["phase"], r["index"], r["micro_batch"]) == (step, phase, index, 0):
            r["sum"] += delta
            r["digest"] = digest(r)
            return out
    raise KeyError(at)


def _noisy(recs: dict) -> dict:
    """Every value of every tensor but the data rounded differently (1e-12 relative): numerically equal,
    bitwise different from step 1 on."""
    out = copy.deepcopy(recs)
    for rs in out.values():
        for r in rs:
            if r["phase"] != "data":
                r["sum"] *= 1 + 1e-12
                r["norm"] *= 1 - 1e-12
                r["digest"] = digest(r)
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    m = manifest(**{"parallelism.dp": 4, "training.steps": STEPS})
    recs = gen_records(m, range(1, STEPS + 1))
    s = {
        "a": write_run(root / "a", m, recs),
        "same": write_run(root / "same", m, recs),
        "planted": write_run(root / "planted", m, _planted(recs, PLANT, 1.0)),
        "noisy": write_run(root / "noisy", m, _noisy(recs)),
    }
    # rank 3 stopped after step 6 (the job died): every rank holds steps 1..6 only, which a share of ranks
    # 1 and 2 alone cannot know
    short = {r: [x for x in v if r != 3 or x["step"] <= 6] for r, v in recs.items()}
    s["incomplete"] = write_run(root / "incomplete", m, short, kind="fault", complete=False)
    # rank 3 wrote no trajectory at all: its records are missing in A
    s["three"] = write_run(root / "three", m, {r: v for r, v in recs.items() if r != 3})
    FORMAT["suffix"] = (
        ".jsonl"  # the JSON lines of stores written before the Arrow stream: the record path
    )
    try:
        s["ja"] = write_run(root / "ja", m, recs)
        s["jplanted"] = write_run(root / "jplanted", m, _planted(recs, PLANT, 1.0))
    finally:
        FORMAT["suffix"] = ".arrows"
    ma = manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2, "training.steps": STEPS})
    mb = manifest(**{"parallelism.tp": 2, "training.steps": STEPS})
    halves = {0: 0, 1: 1, 2: 0, 3: 1}  # B: tp=2 x dp=2, optimizer state in halves

    def tamper(rank, r):
        if (rank, r["step"], r["index"]) == (PLANT_X[1], PLANT_X[0], PLANT_X[3]):
            r["sum"] += 3.0

    s["xa"] = write_run(root / "xa", ma, gen_records(ma, range(1, STEPS + 1)))
    s["xb"] = write_run(root / "xb", mb, shard_records(mb, range(1, STEPS + 1), halves))
    s["xc"] = write_run(root / "xc", mb, shard_records(mb, range(1, STEPS + 1), halves, tamper))
    return s


# (name, A, B, options, the planted first divergence (step, rank, phase) or None for equal runs)
CASES = [
    ("bitwise-equal", "a", "same", {}, None),
    ("bitwise-planted", "a", "planted", {}, PLANT[:3]),
    ("numeric-planted", "a", "planted", {"mode": "numeric"}, PLANT[:3]),
    ("numeric-equal", "a", "noisy", {"mode": "numeric"}, None),
    ("bitwise-incomplete", "a", "incomplete", {}, None),
    ("numeric-planted-jsonl", "ja", "jplanted", {"mode": "numeric"}, PLANT[:3]),
    ("bitwise-rank-missing", "three", "a", {}, (1, 3, "data")),
    ("cross-equal", "xa", "xb", {}, None),
    # the tampered half is rank 1's, but a logical tensor's divergence is B's lowest rank holding it
    ("cross-planted", "xa", "xc", {}, (PLANT_X[0], 0, PLANT_X[2])),
]
IDS = [c[0] for c in CASES]


def _oracle(result, planted) -> None:
    """Both directions: the planted divergence found where it was planted, none on equal runs."""
    if planted is None:
        assert result.equal and result.first_divergence is None
    else:
        f = result.first_divergence
        assert not result.equal and (f.step, f.rank, f.phase) == planted


def _shares(case: str) -> list[dict]:
    if case == "bitwise-rank-missing":  # a share of the rank A lacks, alone
        return [{"ranks": [0, 1, 2]}, {"ranks": [3]}]
    if case.endswith("-equal") and case != "bitwise-equal":  # --share K/N: ranks, or steps across
        return [{"share": (0, 2)}, {"share": (1, 2)}]
    if case.startswith("cross"):
        return [{"steps": [1, 2, 3]}, {"steps": list(range(4, STEPS + 1))}]
    return [{"ranks": [0, 3]}, {"ranks": [1, 2]}]  # interleaved: the merge puts ranks in order


@pytest.mark.parametrize("case,a,b,kw,planted", CASES, ids=IDS)
def test_jobs_and_merged_partials_print_the_one_process_document(
    stores, tmp_path, case, a, b, kw, planted
):
    one = diff_runs(stores[a], stores[b], **kw)
    _oracle(one, planted)
    want = one.to_json()
    assert diff_runs(stores[a], stores[b], jobs=2, **kw).to_json() == want
    files = []
    for n, share in enumerate(_shares(case)):
        p = partial.diff_partial(stores[a], stores[b], **share, **kw)
        doc = orjson.loads(p.to_json())
        # a partial is never a verdict: `equal` is null unless its share diverged (then false), and
        # its exit code is never 0
        assert doc["equal"] is (False if p.diverged else None)
        assert p.exit_code in (1, EXIT_PARTIAL)
        files.append(tmp_path / f"part-{n}.json")
        files[-1].write_text(p.to_json())
    assert partial.merge_partials(files[::-1]).to_json() == want


def test_a_share_that_holds_the_divergence_exits_1_and_the_others_4(stores):
    parts = {
        tuple(r): partial.diff_partial(stores["a"], stores["planted"], ranks=r)
        for r in ([0, 1], [2, 3])
    }
    assert parts[(2, 3)].exit_code == 1 and parts[(2, 3)].result.first_divergence.rank == 2
    assert parts[(0, 1)].exit_code == EXIT_PARTIAL and not parts[(0, 1)].diverged
    assert parts[(0, 1)].result.ranks == [0, 1]  # its grid draws only the ranks it read


def test_the_cli_merges_to_the_one_process_bytes(stores, tmp_path):
    a, b = str(stores["a"]), str(stores["planted"])
    one = cli("diff", a, b, "--json")
    assert one.returncode == 1
    jobs = cli("diff", a, b, "--json", "--jobs", "2")
    assert (jobs.returncode, jobs.stdout) == (1, one.stdout)
    files = []
    for n, spec in enumerate(("0-1", "2,3")):
        p = cli("diff", a, b, "--json", "--ranks", spec)
        assert p.returncode == (EXIT_PARTIAL, 1)[n], p.stderr
        files.append(tmp_path / f"p{n}.json")
        files[-1].write_text(p.stdout)
    merged = cli("diff", "--merge", *map(str, files), "--json")
    assert (merged.returncode, merged.stdout) == (1, one.stdout)
    human = cli("diff", a, b, "--ranks", "0-1")
    assert human.returncode == EXIT_PARTIAL and "EQUAL" not in human.stdout
    assert "NO DIVERGENCE in ranks 0..1" in human.stdout


@pytest.mark.parametrize(
    "spec,want",
    [("0-3", [0, 1, 2, 3]), ("0,2,4-7", [0, 2, 4, 5, 6, 7]), (" 3 , 1 ", [1, 3]), ("5-5", [5])],
)
def test_rank_specs(spec, want):
    assert partial.parse_spec(spec, "--ranks") == want


@pytest.mark.parametrize("spec", ["", "a", "1-", "-1", "3-1", "1,,2", "+1", "0-99999999999", "1.5"])
def test_a_bad_spec_is_one_line_naming_the_option(spec):
    with pytest.raises(BadInput, match=r"^--ranks: "):
        partial.parse_spec(spec, "--ranks")


def test_the_cli_refuses_a_bad_spec_in_one_line(stores):
    for args in (["--ranks=3-1"], ["--share", "2/2"]):
        p = cli("diff", str(stores["a"]), str(stores["same"]), *args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith(f"error: {args[0].split('=')[0]}: "), p.stderr


def test_ranks_across_topologies_are_refused(stores):
    with pytest.raises(BadInput, match="--ranks: a diff across topologies"):
        partial.diff_partial(stores["xa"], stores["xb"], ranks=[0])


def _write(tmp_path, name, p) -> str:
    f = tmp_path / name
    f.write_text(p if isinstance(p, str) else p.to_json())
    return str(f)


def _refused(files, match: str) -> None:
    with pytest.raises(BadInput, match=match):
        partial.merge_partials(files)


def test_the_merge_refuses_shares_of_other_comparisons(stores, tmp_path):
    a = stores["a"]
    p01 = _write(tmp_path, "p01.json", partial.diff_partial(a, stores["planted"], ranks=[0, 1]))
    p23 = _write(tmp_path, "p23.json", partial.diff_partial(a, stores["planted"], ranks=[2, 3]))
    # another B, other options, a B whose seal changed (its COMPLETE rewritten)
    other = _write(tmp_path, "o.json", partial.diff_partial(a, stores["noisy"], ranks=[2, 3]))
    _refused([p01, other], r"o\.json: partial\.sides\.b\.path: run B's path differs")
    numeric = partial.diff_partial(a, stores["planted"], ranks=[2, 3], mode="numeric")
    _refused([p01, _write(tmp_path, "n.json", numeric)], r"partial\.binding\.options")
    resealed = tmp_path / "resealed"
    shutil.copytree(stores["planted"], resealed)
    (resealed / "COMPLETE").write_bytes(b'{"seal": "another"}\n')
    moved = partial.diff_partial(a, resealed, ranks=[2, 3])
    _refused([p01, _write(tmp_path, "s.json", moved)], r"partial\.binding\.b")
    # every rank exactly once
    _refused([p01, p01], r"p01\.json: partial\.covers\.ranks: ranks 0\.\.1 are also covered")
    _refused([p01], r"--merge: ranks: no partial covers rank\(s\) 2\.\.3 of 0\.\.3")
    steps = _write(tmp_path, "st.json", partial.diff_partial(a, stores["planted"], steps=[1, 2]))
    _refused([p01, steps], r"st\.json: partial\.covers: splits by steps")
    _refused([steps], r"--merge: steps: no partial holds step\(s\) 3\.\.8")
    assert partial.merge_partials([p23, p01]).first_divergence.rank == PLANT[1]


def test_the_merge_refuses_malformed_documents(stores, tmp_path, monkeypatch):
    p = partial.diff_partial(stores["a"], stores["planted"], ranks=[0, 1])
    good = orjson.loads(p.to_json())
    whole = _write(tmp_path, "whole.json", diff_runs(stores["a"], stores["planted"]).to_json())
    _refused([whole], r"whole\.json: partial: not a partial diff document")
    _refused([_write(tmp_path, "t.json", "{")], r"t\.json: not a JSON document")
    _refused([str(tmp_path / "absent.json")], r"absent\.json: file not found")

    def forged(name: str, edit) -> str:
        doc = copy.deepcopy(good)
        edit(doc["partial"])
        return _write(tmp_path, name, orjson.dumps(doc).decode())

    def retype(doc):  # a count that is not a number
        doc["steps"][0]["equal"][0][2] = "many"

    _refused([forged("r.json", retype)], r"r\.json: partial\.steps\.0\.equal\.0\.2")

    def downward(doc):  # a span of ranks from high to low
        doc["steps"][0]["equal"][0][:2] = [1, 0]

    _refused([forged("d.json", downward)], r"d\.json: partial\.steps\.0\.equal: a span runs from 1")
    _refused(
        [forged("x.json", lambda d: d["run"].update(extra=1))], r"x\.json: partial\.run\.extra"
    )
    _refused([forged("f.json", lambda d: d.update(format="v0"))], r"f\.json: partial\.format")

    def other_rank(doc):  # results of a rank the document does not cover
        doc["steps"][0]["equal"].append([3, 3, 10])

    _refused([forged("o.json", other_rank)], r"o\.json: partial\.steps: holds results of ranks")
    monkeypatch.setattr(partial.merge, "MAX_PARTIAL_BYTES", 1000)  # where the reader reads it
    _refused([_write(tmp_path, "big.json", p)], r"big\.json: \d+ bytes, more than the 1000 bytes")
    bad = cli("diff", "--merge", whole)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "whole.json" in bad.stderr
    opt = cli("diff", "--merge", whole, "--rtol", "1e-3")
    assert opt.returncode == 2 and "--merge: takes partial documents only, not --rtol" in opt.stderr


# ---------------------------------------------------------------- real runs (the slow tier)

REAL = [d for d in DIFFS if d[0].startswith("diff-")]


@pytest.mark.slow
@pytest.mark.parametrize("name,a,b,kw", REAL, ids=[d[0] for d in REAL])
def test_real_runs_jobs_and_merged_shares_print_the_stored_document(runs, tmp_path, name, a, b, kw):
    """The golden documents of real runs (tests/golden/, test_json_contract.py), from `--jobs 2` and from
    a merge of two shares (ranks where the topologies agree, steps across them)."""
    named = {
        "<REF>": runs.reference(),
        "<FAULT>": runs.fault("bitflip-grad", 3, 1),
        "<ZERO1>": runs.reference(*ZERO1),
    }
    want = _golden(name)
    assert _named(diff_runs(named[a], named[b], jobs=2, **kw).to_json(), named) == want
    files = []
    for n in range(2):
        p = partial.diff_partial(named[a], named[b], share=(n, 2), **kw)
        files.append(_write(tmp_path, f"share-{n}.json", p))
    assert _named(partial.merge_partials(files).to_json(), named) == want


# ---------------------------------------------------------------- the partial document itself

PARTIALS = Path(__file__).parent / "golden" / "partial"


@pytest.mark.parametrize("case,a,b,kw,planted", CASES, ids=IDS)
def test_partial_documents_are_the_stored_ones(stores, case, a, b, kw, planted):
    """Each share's partial document byte for byte as stored in tests/golden/partial/ (written by the
    code before the partial's models became its data; DISTTRACE_WRITE_GOLDEN=1 rewrites them): the
    document another machine's merge reads does not change with the code that writes it."""
    root = str(stores["a"].parent)
    for n, share in enumerate(_shares(case)):
        got = partial.diff_partial(stores[a], stores[b], **share, **kw).to_json()
        got = got.replace(root, "<STORES>")
        path = PARTIALS / f"{case}-{n}.json"
        if os.environ.get("DISTTRACE_WRITE_GOLDEN"):
            path.parent.mkdir(exist_ok=True)
            path.write_text(got)
        assert got == path.read_text(), path.name
