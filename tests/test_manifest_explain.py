"""Every manifest field says what it is, `disttrace freeze --explain` prints them from the models' schema,
and a description is schema, never part of what is hashed: no manifest id moves when the words do."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import orjson
from conftest import DEFAULT, ROOT, cli, run_snippet
from pydantic import BaseModel

from disttrace.config.attached import AttachedManifest
from disttrace.config.freezing import freeze
from disttrace.config.manifest import Manifest

MANIFESTS = [DEFAULT, *sorted((ROOT / "manifests" / "labs").glob("*.toml"))]


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (`DepthSpec | None`, `dict[str, TensorShape]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    """Every field of `model` and of the tables inside it, dotted, with its description."""
    out: dict[str, str | None] = {}
    for name, info in model.model_fields.items():
        out[prefix + name] = info.description
        for sub in _models(info.annotation):
            out.update(_fields(sub, f"{prefix}{name}."))
    return out


def test_every_manifest_field_has_a_one_line_description():
    for model in (Manifest, AttachedManifest):
        fields = _fields(model)
        missing = sorted(name for name, text in fields.items() if not text)
        assert not missing, f"{model.__name__}: fields without a description: {missing}"
        several = sorted(name for name, text in fields.items() if "\n" in text)
        assert not several, f"{model.__name__}: descriptions of more than one line: {several}"


def test_explain_lists_every_field_with_its_type_default_and_description():
    proc = cli("freeze", "--explain", "--json", check=0)
    doc = orjson.loads(proc.stdout)
    listed = {
        f"{s['name']}.{f['name']}": f for s in doc["sections"] for f in s["fields"] if s["fields"]
    }
    fields = {k: v for k, v in _fields(Manifest).items() if k.count(".") >= 1}
    assert set(listed) == set(fields)
    for name, f in listed.items():
        assert f["description"] == fields[name] and f["type"], name
    assert listed["parallelism.dp"]["required"] and listed["parallelism.dp"]["type"] == "int >= 1"
    assert listed["parallelism.tp"] == {
        "name": "tp",
        "type": "int >= 1",
        "required": False,
        "default": 1,
        "description": Manifest.model_fields["parallelism"]
        .annotation.model_fields["tp"]
        .description,
    }
    assert listed["record.depth.level"]["type"] == "module | op"
    assert [s["name"] for s in doc["sections"]] == list(Manifest.model_fields)

    human = cli("freeze", "--explain", check=0)
    assert human.stdout == ""  # a table for people goes to stderr
    for section in Manifest.model_fields:
        assert f"[{section}]" in human.stderr
    for name in listed:
        assert name.split(".", 1)[1] in human.stderr


def test_explain_takes_no_manifest():
    proc = cli("freeze", DEFAULT, "--explain", check=2)
    assert "--explain" in proc.stderr and proc.stdout == ""


def test_descriptions_are_not_part_of_any_manifest_id(tmp_path: Path):
    """The manifest id is the sha256 of the validated values' canonical JSON: the same ids, and the same
    lock bytes, with every description of every model removed."""
    here = {str(p): freeze(p).model_dump() for p in MANIFESTS}
    code = f"""
import json, typing
from pydantic import BaseModel
from disttrace.config import manifest as mf
from disttrace.config.freezing import freeze

def strip(model, seen):
    if model in seen:
        return
    seen.add(model)
    model.__doc__ = None
    for info in model.model_fields.values():
        info.description = None
        for arg in [info.annotation, *typing.get_args(info.annotation)]:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                strip(arg, seen)
    model.model_rebuild(force=True)

seen = set()
strip(mf.Manifest, seen)
for m in seen:
    m.model_rebuild(force=True)
mf.Manifest.model_rebuild(force=True)
assert not any(
    "description" in str(v) for v in [mf.Manifest.model_json_schema()["$defs"]["Parallelism"]]
)
paths = {json.dumps([str(p) for p in MANIFESTS])}
print(json.dumps({{p: freeze(p).model_dump() for p in paths}}))
"""
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr
    there = json.loads(proc.stdout)
    assert there == here
    assert len({d["manifest_id"] for d in here.values()}) == len(MANIFESTS)
