"""Typed results and their `--json` documents.

Analysis returns dataclasses; a command's `--json` prints `to_json()` of one. A document's keys are the
dataclass's fields in declaration order; a field declared with `omit_none()` is left out when it is None
(the documents have optional keys, and a reader tells "absent" from "null"). No torch, no rich.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import orjson

_OMIT = "omit_none"
_STORED = "as_read"


def omit_none(default: Any = None) -> Any:
    """A dataclass field that the document leaves out while it is None."""
    return dataclasses.field(default=default, metadata={_OMIT: True})


def as_stored() -> Any:
    """A dataclass field holding a line of the run store (a store/records.py model), or a list of them, that
    the document echoes as the store holds it (`as_read()`: every key, in the file's order), not as the
    model would write it."""
    return dataclasses.field(metadata={_STORED: True})


def _as_read(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_read(v) for v in value]
    return value.as_read() if value is not None else None


def plain(value: Any) -> Any:
    """The JSON-ready form of a result: results by their `to_dict` (dataclasses, and the store's pydantic
    lines), enums by value, int keys as str."""
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
    return (
        orjson.dumps(plain(doc), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
        + "\n"
    )


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
