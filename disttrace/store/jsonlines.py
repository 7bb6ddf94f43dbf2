"""Reading the store's JSON and JSON-lines files: every line parsed or BadInput naming the file and line; a
torn last line (a crash mid-write) reported to the caller that asks, never read as data."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from disttrace.errors import BadInput
from disttrace.store import safeio


def read_json(path: Path | str, root: Path | str | None = None) -> Any:
    """One JSON document of a run store, through store/safeio.py: a regular file inside `root` (the run
    directory; by default the file's own directory), at most LIMITS['json'] bytes."""
    path = Path(path)
    data = safeio.read_bytes(path, path.parent if root is None else root, "json")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise BadInput(path, f"not valid JSON ({e.msg} at line {e.lineno})") from None


@dataclass
class JsonlRead:
    records: list
    torn: str | None  # a description of a torn/unparseable line, if any


def iter_jsonl(
    path: Path | str, torn: list | None = None, root: Path | str | None = None
) -> Iterator[dict]:
    """Yield objects line by line (streamed, each line at most LIMITS['line'] bytes, the file confined to
    `root`, by default its own run directory). A torn last line (a crash mid-write) is reported through
    `torn`, not raised; a bad line in the middle is bad input."""
    path = Path(path)
    prev = None
    lineno = 0
    for lineno, raw in safeio.lines(path, path.parent.parent if root is None else root):
        if prev is not None:
            yield _parse_line(path, prev, lineno - 1, torn, last=False)
        prev = raw
    if prev is not None:
        obj = _parse_line(path, prev, lineno, torn, last=True)
        if obj is not None:
            yield obj


def _parse_line(path: Path, raw: bytes, lineno: int, torn: list | None, last: bool):
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        if last and torn is not None:
            torn.append(f"{path}: line {lineno} is torn (incomplete write), ignored")
            return None
        raise BadInput(path, f"line {lineno} is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BadInput(path, f"line {lineno} is not a JSON object")
    return obj


def read_jsonl(path: Path | str, root: Path | str | None = None) -> JsonlRead:
    path = Path(path)
    base = path.parent.parent if root is None else root
    kind = "events" if path.name == "events.jsonl" else "jsonl"
    if safeio.size(path, base) > safeio.LIMITS[kind]:
        raise BadInput(
            path,
            f"more than the {safeio.LIMITS[kind]} bytes a file of its kind may hold; refused unread",
        )
    torn: list = []
    recs = list(iter_jsonl(path, torn, base))
    return JsonlRead(recs, torn[0] if torn else None)
