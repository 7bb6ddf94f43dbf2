"""`disttrace show RUN records --jsonl`: the trajectory as JSON lines for the user's own tools."""

from __future__ import annotations

import orjson

from conftest import cli


def test_records_export_is_every_record_once(runs):
    ref = runs.reference()
    out = cli("show", ref, "records", "--jsonl", check=0).stdout.splitlines()
    recs = [orjson.loads(line) for line in out]
    # the oracle: the raw trajectory files, line by line, read without disttrace's readers
    raw = []
    for f in sorted((ref / "trajectory").glob("rank-*.jsonl")):
        if not f.name.endswith(".steps.jsonl"):
            raw += [orjson.loads(line) for line in f.read_bytes().splitlines() if line.strip()]
    assert recs == raw and len(recs) > 100
    counts = orjson.loads(cli("show", ref, "records", "--json", check=0).stdout)
    assert counts["records"] == len(raw)
    assert counts["bytes"] == sum(f.stat().st_size for f in (ref / "trajectory").glob("rank-?????.jsonl"))


def test_jsonl_is_refused_for_other_views(runs):
    proc = cli("show", runs.reference(), "topology", "--jsonl")
    assert proc.returncode == 2 and "--jsonl" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
