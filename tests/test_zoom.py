"""Zooming into a step: depth recording (`record.depth`), `disttrace zoom A B` and `diff --zoom`
(docs/zoom.md)."""

from __future__ import annotations

import hashlib

import orjson
import pytest
from conftest import DEFAULT, cli

from disttrace.config.manifest import canonical_json, freeze
from disttrace.errors import EXIT_BAD_INPUT

DEPTH_OP = "record.depth={step = 2, level = 'op'}"


def test_a_manifest_without_depth_keeps_its_id():
    """The id is the sha256 of the canonical dump: an unset depth is left out of it, so every manifest
    frozen before the field existed keeps its id (and its stored runs still match it)."""
    frozen = freeze(None)
    assert "depth" not in frozen.manifest["record"]
    assert frozen.manifest_id == hashlib.sha256(canonical_json(frozen.manifest)).hexdigest()
    deep = freeze(None, [DEPTH_OP])
    assert deep.manifest["record"]["depth"] == {"level": "op", "step": 2}
    assert deep.manifest_id != frozen.manifest_id
    assert deep.model().record.depth.level == "op"
    # the dump without depth is the dump of the section's other fields, byte for byte
    rest = {k: v for k, v in deep.manifest["record"].items() if k != "depth"}
    assert orjson.dumps(rest) == orjson.dumps(frozen.manifest["record"])


@pytest.mark.parametrize(
    "setting, field",
    [
        ("record.depth={step = 0}", "record.depth.step"),
        ("record.depth={step = 2, level = 'kernel'}", "record.depth.level"),
        ("record.depth={step = 99}", "record.depth.step"),
        ("record.depth={step = 2, op = true}", "record.depth.op"),
    ],
)
def test_bad_depth_is_one_line_naming_file_and_field(setting, field):
    proc = cli("freeze", DEFAULT, "--set", setting)
    assert proc.returncode == EXIT_BAD_INPUT
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "default.toml" in line and field in line, line
