"""The curriculum's labs: one manifest per topic under manifests/labs/, each stating in its header the
question it answers, the single fault it pairs with and the evidence that decides it."""

from __future__ import annotations

from pathlib import Path

from disttrace.config.manifest import manifests_dir
from disttrace.errors import BadInput
from disttrace.run import faults

LABS_DIR = manifests_dir() / "labs"


def header(path: Path) -> dict:
    out = {"lab": path.stem, "manifest": str(path)}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").strip()
        if text.startswith("lab "):
            out["topic"] = text.split(":")[0].removeprefix("lab ").strip()
        for key in ("question", "fault", "evidence"):
            if text.startswith(key + ":"):
                out[key] = text.split(":", 1)[1].strip()
    return out


def list_labs(directory: Path = LABS_DIR) -> list[dict]:
    from disttrace.config.freezing import freeze

    labs = []
    for path in sorted(directory.glob("*.toml")):
        lab = header(path)
        try:
            frozen = freeze(path)
            name, *rest = lab.get("fault", "").split()
            opts = dict(zip(rest[::2], rest[1::2]))
            faults.get(name).spec(
                int(opts.get("--step", 1)), int(opts.get("--rank", 0)), {}, frozen.model()
            )
            lab["status"] = "runnable"
        except BadInput as e:
            lab["status"] = "not runnable yet"
            lab["reason"] = e.reason
        name, *rest = lab.get("fault", "").split()
        lab["command"] = f"disttrace lab {path} --fault {name} {' '.join(rest)}" if name else None
        labs.append(lab)
    return labs
