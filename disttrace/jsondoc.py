"""Typed results and their `--json` documents.

Analysis returns dataclasses; a command's `--json` prints `to_json()` of one. A document's keys are the
dataclass's fields in declaration order; a field declared with `omit_none()` is left out when it is None
(the documents have optional keys, and a reader tells "absent" from "null"). No torch, no rich.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import secrets
from collections.abc import Iterator
from typing import Any

import orjson

_OMIT = "omit_none"
_STORED = "as_read"
_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
_SPLICE: contextvars.ContextVar[list | None] = contextvars.ContextVar("streamed", default=None)


class Streamed:
    """A list in a document that `dumps` writes one item at a time, so that the plain forms of its items
    (dicts of dicts: far larger than a compact holder of the same values) are never all held at once. The
    text is what the list of the same items would print."""

    def stream(self) -> Iterator[Any]:
        raise NotImplementedError


def omit_none(default: Any = None) -> Any:
    """A dataclass field that the document leaves out while it is None."""
    return dataclasses.field(default=default, metadata={_OMIT: True})


def as_stored() -> Any:
    """A dataclass field holding a line of the run store (a model of store/records.py, events.py or
    documents.py), or a list of them, that the document echoes as the store holds it (`as_read()`: every
    key, in the file's order), not as the model would write it."""
    return dataclasses.field(metadata={_STORED: True})


def _as_read(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_read(v) for v in value]
    return value.as_read() if value is not None else None


def plain(value: Any) -> Any:
    """The JSON-ready form of a result: results by their `to_dict` (dataclasses, and the store's pydantic
    lines), enums by value, int keys as str; a `Streamed` list as a list, or, inside `dumps`, as a mark the
    text of its items replaces."""
    if isinstance(value, Streamed):
        spliced = _SPLICE.get()
        if spliced is None:
            return [plain(v) for v in value.stream()]
        spliced.append(value)
        return spliced[0] + str(len(spliced) - 2)  # its position among the Streamed lists
    if isinstance(value, JsonDoc) or callable(getattr(value, "to_dict", None)):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {(str(k) if isinstance(k, int) else k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def dumps(doc: Any) -> str:
    """One document as every `--json` prints it: indented by two, numpy scalars as numbers."""
    return "".join(_pieces(doc))


def write(doc: Any, out) -> None:
    """`dumps(doc)` written to `out` piece by piece: a Streamed list's items one at a time, so that the
    document is never held whole (a numeric diff's at 1,024 ranks x 100 steps is ~40 MB of text)."""
    for piece in _pieces(doc):
        out.write(piece)


def _pieces(doc: Any) -> Iterator[str]:
    # a mark no store's text can forge (a fresh nonce), then one per Streamed list, in order
    spliced: list = ["\x00streamed-" + secrets.token_hex(8) + "-"]
    token = _SPLICE.set(spliced)
    try:
        tree = plain(doc)
    finally:
        _SPLICE.reset(token)
    text = orjson.dumps(tree, option=_OPTIONS).decode()
    yield from _spliced(text, spliced)
    yield "\n"


def _spliced(text: str, spliced: list) -> Iterator[str]:
    """The text with each Streamed list's mark replaced by its items, each serialized alone and indented to
    where the list stands (orjson's indented text of a nested value is its own text, indented)."""
    at = 0
    mark = orjson.dumps(spliced[0]).decode()[
        :-1
    ]  # quoted and escaped as orjson writes it, less its end
    for i, streamed in enumerate(spliced[1:]):
        quoted = f'{mark}{i}"'
        pos = text.index(quoted, at)
        line = text.rfind("\n", 0, pos) + 1
        indent = " " * (len(text[line:pos]) - len(text[line:pos].lstrip(" ")))
        yield text[at:pos]
        sep = "[\n" + indent + "  "
        for v in streamed.stream():
            yield sep
            yield (
                orjson.dumps(plain(v), option=_OPTIONS).decode().replace("\n", "\n" + indent + "  ")
            )
            sep = ",\n" + indent + "  "
        yield "[]" if sep.startswith("[") else "\n" + indent + "]"
        at = pos + len(quoted)
    yield text[at:]


class JsonDoc:
    """Mixin for result dataclasses: `to_dict()` is the document, `to_json()` its text."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and f.metadata.get(_OMIT):
                continue
            if f.metadata.get(_STORED):
                v = _as_read(v)
            out[f.name] = plain(v)
        return out

    def to_json(self) -> str:
        return dumps(self)
