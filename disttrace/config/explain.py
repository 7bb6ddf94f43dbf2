"""The manifest's reference, read from the models' own JSON schema: every section and field with its type,
default and description (`disttrace freeze --explain`). The schema is the one source, so a field added to
`Manifest` appears here with no second list to keep; `views/manifest.py` renders it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from disttrace.jsondoc import JsonDoc


@dataclass
class FieldDoc(JsonDoc):
    """One key of a manifest table."""

    name: str  # dotted below its section: "depth.step"
    type: str  # the TOML value it takes, with its bounds: "int >= 1", "gpipe | 1f1b"
    required: bool
    default: (
        Any  # the value a manifest that leaves the key out gets (null: none, or derived at freeze)
    )
    description: str


@dataclass
class SectionDoc(JsonDoc):
    """One table of the manifest: `[name]`."""

    name: str
    required: bool
    description: str
    fields: list[FieldDoc] = field(default_factory=list)


@dataclass
class ManifestFields(JsonDoc):
    """What `freeze --explain --json` prints."""

    sections: list[SectionDoc]


_SCALAR = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "None"}


def _ref(schema: dict, node: dict) -> dict | None:
    """The model a `$ref` names, or None for a plain value."""
    ref = node.get("$ref")
    return schema["$defs"][ref.rsplit("/", 1)[-1]] if ref else None


def _type(schema: dict, node: dict) -> str:
    """A property's JSON schema as the value a TOML file states: its kind, then its bounds."""
    if "anyOf" in node:
        return " | ".join(_type(schema, n) for n in node["anyOf"])
    if "enum" in node:
        return " | ".join(str(v) for v in node["enum"])
    if "$ref" in node:
        return "table"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list[{_type(schema, node.get('items', {}))}]"
    if kind == "object":
        return (
            f"table of {_type(schema, node['additionalProperties'])}"
            if isinstance(node.get("additionalProperties"), dict)
            else "table"
        )
    text = _SCALAR.get(kind, kind)
    bounds = [
        f"{op} {node[key]:g}"
        for key, op in (
            ("exclusiveMinimum", ">"),
            ("minimum", ">="),
            ("exclusiveMaximum", "<"),
            ("maximum", "<="),
        )
        if key in node
    ]
    return " ".join([text, ", ".join(bounds)]) if bounds else text


def _fields(schema: dict, model: dict, prefix: str = "") -> list[FieldDoc]:
    """A model's properties in declaration order; a nested table's keys follow it, dotted."""
    out: list[FieldDoc] = []
    required = set(model.get("required", ()))
    for name, node in model.get("properties", {}).items():
        out.append(
            FieldDoc(
                name=prefix + name,
                type=_type(schema, node),
                required=name in required,
                default=node.get("default"),
                description=node.get("description", ""),
            )
        )
        nested = [_ref(schema, n) for n in node.get("anyOf", [node])]
        for sub in filter(None, nested):
            out.extend(_fields(schema, sub, f"{prefix}{name}."))
    return out


def explain(model: type[BaseModel]) -> ManifestFields:
    """Every table of `model` (the harness's `Manifest`) and every key in it, from its JSON schema."""
    schema = model.model_json_schema()
    required = set(schema.get("required", ()))
    sections = []
    for name, node in schema["properties"].items():
        section = _ref(schema, node)
        if section is None:
            continue  # not a table (the harness's manifest has none)
        sections.append(
            SectionDoc(
                name=name,
                required=name in required,
                description=" ".join(
                    (section.get("description") or node.get("description", "")).split()
                ),
                fields=_fields(schema, section),
            )
        )
    return ManifestFields(sections=sections)
