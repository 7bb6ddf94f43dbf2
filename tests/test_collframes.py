"""The Flight Recorder's collective trace as compressed frames (store/collframes.py): a frame reads back as
the JSON lines it was made of, a torn end is left out and said, damage is refused; and a real run's readers
say the same of its frames as of the same lines stored as a JSON-lines file (a store written before frames)."""

from __future__ import annotations

import shutil

import orjson
import pytest
from conftest import cli

from disttrace.errors import BadInput
from disttrace.store import collframes
from disttrace.store.follow import collective_tail
from disttrace.store.rundir import Run


def _lines(k: int, n: int) -> bytes:
    return b"".join(
        orjson.dumps({"seq": i, "group": "0,1", "op": "allreduce_", "step": k, "bytes": 4 * i})
        + b"\n"
        for i in range(n)
    )


def _file(tmp_path, data: bytes):
    p = tmp_path / "collectives" / "rank-00000.frames"
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(data)
    return p


def test_frames_read_back_as_their_lines_and_a_torn_end_is_left_out(tmp_path):
    parts = [_lines(k, 50 + k) for k in range(3)]
    whole = b"".join(collframes.encode(x) for x in parts)
    assert len(whole) < len(b"".join(parts)) / 4  # repeated keys and values compress
    p = _file(tmp_path, whole)
    want = [orjson.loads(x) for x in b"".join(parts).splitlines()]
    assert list(collframes.records(p)) == want
    assert collframes.last_frame(p) == parts[-1]
    for cut in (1, 9, len(collframes.encode(parts[-1])) - 1):  # the last frame cut short: torn
        p.write_bytes(whole[:-cut])
        torn: list = []
        assert list(collframes.records(p, torn)) == want[: 50 + 51]
        assert len(torn) == 1 and "torn" in torn[0]
        with pytest.raises(BadInput, match="torn"):  # as iter_jsonl: no one to tell, refused
            list(collframes.records(p))
        assert collframes.last_frame(p) == parts[1]


def test_a_damaged_frame_is_refused(tmp_path):
    a, b = collframes.encode(_lines(0, 40)), collframes.encode(_lines(1, 40))
    p = _file(tmp_path, a[:-5] + b)  # cut short with a frame after it: damage, not a torn end
    with pytest.raises(BadInput, match="runs past the next one|does not decompress"):
        list(collframes.records(p))
    p.write_bytes(b"XXXX" + a[4:])
    with pytest.raises(BadInput, match="not a collective-trace frame"):
        list(collframes.records(p))
    flipped = bytearray(a)
    flipped[len(a) // 2] ^= 0xFF
    p.write_bytes(bytes(flipped))
    with pytest.raises(BadInput):
        list(collframes.records(p))


def test_readers_say_the_same_of_frames_and_of_the_json_lines_an_older_store_holds(runs, tmp_path):
    ref = runs.reference()
    frames = sorted((ref / "collectives").glob("rank-*.frames"))
    assert len(frames) == 2 and not list((ref / "collectives").glob("*.jsonl"))
    old = tmp_path / ref.parent.name / ref.name
    shutil.copytree(ref, old)
    for f in frames:  # the same lines, as the JSON-lines file the Flight Recorder trace used to be
        lines = b"".join(collframes.frames(f, f.read_bytes()))
        (old / "collectives" / f.name).unlink()
        (old / "collectives" / f.name.replace(".frames", ".jsonl")).write_bytes(lines)
    assert Run(old).ranks("collectives") == Run(ref).ranks("collectives") == [0, 1]
    for args in (["show", "{}", "collectives", "--json"], ["check", "{}", "--json"]):
        a = cli(*[str(ref) if x == "{}" else x for x in args], check=0)
        b = cli(*[str(old) if x == "{}" else x for x in args], check=0)
        assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
        assert a.stdout.replace(str(ref), "RUN") == b.stdout.replace(str(old), "RUN"), args
    for r in (0, 1):
        t_new = collective_tail(Run(ref).collectives_path(r))
        t_old = collective_tail(Run(old).collectives_path(r))
        assert t_new.last == t_old.last and t_new.last is not None
