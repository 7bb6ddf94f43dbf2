"""`disttrace freeze --explain`: the manifest's reference (config/explain.py's `ManifestFields`), one table
a section, on a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from disttrace.config.explain import FieldDoc, ManifestFields


def _default(f: FieldDoc) -> str:
    """The default as a TOML file would state it; a required key has none."""
    if f.required:
        return "required"
    if f.default is None:
        return "unset"
    if isinstance(f.default, dict):
        return "table"  # a nested table's defaults are its own keys' rows
    return orjson.dumps(f.default).decode()


def render_manifest_fields(doc: ManifestFields, console: Console) -> None:
    """Each section as `[name]`, its purpose, then a row per key: name, type, default, description."""
    for section in doc.sections:
        title = Text(f"[{section.name}]", style="bold")
        if not section.required:
            title.append("  (optional table)", style="dim")
        console.print(title)
        console.print(Text(section.description, style="dim"))
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
        table.add_column("field", no_wrap=True)
        table.add_column("type")
        table.add_column("default")
        table.add_column("description", ratio=1)
        for f in section.fields:
            table.add_row(Text(f.name), Text(f.type), Text(_default(f)), Text(f.description))
        console.print(table)
        console.print()
    console.print(
        Text(
            "Set a key in the manifest's TOML table, or on the command line with "
            "--set section.key=value; `disttrace freeze` prints the manifest id.",
            style="dim",
        )
    )
