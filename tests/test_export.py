"""`disttrace show RUN records --jsonl`: the trajectory as JSON lines for the user's own tools."""

from __future__ import annotations

import orjson
from conftest import cli, raw_records


def test_records_export_is_every_record_once(runs):
    ref = runs.reference()
    out = cli("show", ref, "records", "--jsonl", check=0).stdout.splitlines()
    recs = [orjson.loads(line) for line in out]
    # the oracle: the raw Arrow streams, read by pyarrow's own stream reader, not disttrace's
    raw = raw_records(ref, 0) + raw_records(ref, 1)
    assert recs == raw and len(recs) > 100
    counts = orjson.loads(cli("show", ref, "records", "--json", check=0).stdout)
    assert counts["records"] == len(raw)
    files = sorted((ref / "trajectory").glob("rank-?????.arrows"))
    # the steps' bytes are the files less each stream's 8-byte end-of-stream marker
    assert counts["bytes"] == sum(f.stat().st_size - 8 for f in files) and len(files) == 2


def test_jsonl_is_refused_for_other_views(runs):
    proc = cli("show", runs.reference(), "topology", "--jsonl")
    assert (
        proc.returncode == 2
        and "--jsonl" in proc.stderr
        and len(proc.stderr.strip().splitlines()) == 1
    )
