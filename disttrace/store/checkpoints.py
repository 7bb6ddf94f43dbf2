"""Recovery checkpoints: torch.distributed.checkpoint (DCP) files plus our INDEX.json.

DCP has no content hash of its own. INDEX.json gives every file's sha256 and size, the step, the manifest
id and the world size, so a flipped byte, a truncated or missing file, or a checkpoint of another
experiment is refused before anything is loaded.

Publication is atomic: all ranks write into `step-NNNNNN.partial`, rank 0 hashes the files and writes the
INDEX, then renames the directory to `step-NNNNNN`. A crash leaves a `.partial` directory that no reader
takes for a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from disttrace.errors import BadInput
from disttrace.store import safeio
from disttrace.store.documents import CheckpointIndex, FileHash, parse_doc
from disttrace.store.jsonlines import read_json
from disttrace.store.pickles import bare_name, scan_checkpoint, scan_deepspeed_checkpoint
from disttrace.store.seal import file_hash
from disttrace.store.writers import write_json_atomic

INDEX = "INDEX.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def sha256_of(path: Path) -> str:
    return file_hash(path).sha256


def write_index(
    ckpt: Path, step: int, manifest_id: str, world_size: int, contents: list[str], fmt: str = "dcp"
) -> dict:
    files = {}
    for p in sorted(ckpt.iterdir()):
        if p.is_file() and p.name != INDEX:
            files[p.name] = FileHash(sha256=sha256_of(p), bytes=p.stat().st_size)
    index = CheckpointIndex(
        format=fmt,  # dcp, or deepspeed (an attached DeepSpeed engine's own save_checkpoint)
        step=step,
        manifest_id=manifest_id,
        world_size=world_size,
        contents=contents,
        files=files,
    )
    write_json_atomic(ckpt / INDEX, index.doc())
    return index.doc()


def verify(
    ckpt: Path | str, manifest_id: str | None = None, root: Path | str | None = None
) -> dict:
    """`verified_index`'s INDEX as stored (its callers read its free-form parts: contents, what an engine
    added)."""
    return verified_index(ckpt, manifest_id, root).as_read()


def verified_index(
    ckpt: Path | str, manifest_id: str | None = None, root: Path | str | None = None
) -> CheckpointIndex:
    """Read every byte and scan every pickle (opcodes only, nothing loaded); raise BadInput naming the first
    bad file. Returns the index. Every file is read inside `root` (by default the run the checkpoint is
    in, `<run>/checkpoints/step-N`): a checkpoint directory linked out of its run is refused."""
    ckpt = Path(ckpt)
    root = ckpt.parent.parent if root is None else Path(root)
    if not ckpt.is_dir():
        raise BadInput(ckpt, "checkpoint directory not found")
    safeio.confined(ckpt, root)
    doc = read_json(ckpt / INDEX, root)
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise BadInput(ckpt / INDEX, "not a checkpoint index", field="files")
    index = parse_doc(CheckpointIndex, doc, ckpt / INDEX)
    if manifest_id is not None and index.manifest_id != manifest_id:
        raise BadInput(
            ckpt / INDEX,
            f"written for manifest {str(index.manifest_id)[:12]}, not {manifest_id[:12]}",
            field="manifest_id",
        )
    fmt = index.format
    if fmt not in ("dcp", "deepspeed"):
        raise BadInput(ckpt / INDEX, f"unknown checkpoint format {fmt!r}", field="format")
    if fmt == "dcp" and ".metadata" not in index.files:
        raise BadInput(ckpt / INDEX, "lists no DCP .metadata file", field="files")
    for name, meta in sorted(index.files.items()):
        if not bare_name(
            name
        ):  # the INDEX comes from the run store: its names must stay in this directory
            raise BadInput(
                ckpt / INDEX, f"names '{name}', outside the checkpoint directory", field="files"
            )
        p = ckpt / name
        if p.is_symlink():
            raise BadInput(p, "is a symbolic link (a checkpoint holds plain files only)")
        if not safeio.present(p):
            raise BadInput(p, "checkpoint file is missing")
        size = safeio.size(p, root)  # a regular file, or BadInput naming what it is
        if size != meta.bytes:
            raise BadInput(
                p, f"size {size} differs from the index's {meta.bytes} (truncated or altered)"
            )
        if file_hash(p, root=root).sha256 != meta.sha256:
            raise BadInput(p, "sha256 differs from the index (corrupted)")
    extra = sorted(
        p.name
        for p in ckpt.iterdir()
        if p.is_file() and p.name != INDEX and p.name not in index.files
    )
    if extra:
        raise BadInput(ckpt / extra[0], "file not listed in the index")
    # the INDEX guards against accidents, not against its writer: also look at every pickle, unrun
    scanner = scan_checkpoint if fmt == "dcp" else scan_deepspeed_checkpoint
    finding = scanner(ckpt, root)
    if finding is not None:
        raise BadInput(
            finding.file, (f"item {finding.item}: " if finding.item else "") + finding.reason
        )
    return index


def status(ckpt: Path, manifest_id: str | None = None) -> tuple[bool, str]:
    try:
        index = verified_index(ckpt, manifest_id)
        n = len(index.files)
        size = sum(f.bytes for f in index.files.values())
        return True, f"ok ({n} files, {size} bytes, contents: {', '.join(index.contents)})"
    except BadInput as e:
        return False, str(e)


def read_index(ckpt: Path) -> dict:
    return read_json(Path(ckpt) / INDEX)


def final_checkpoint(run) -> Path:
    """The last published checkpoint of a run (what the gate evaluates); BadInput when there is none."""
    ckpts = run.checkpoint_dirs()
    if not ckpts:
        raise BadInput(run.path / "checkpoints", "the run wrote no checkpoint: nothing to evaluate")
    return ckpts[-1]
