"""Freezing a manifest: the TOML read with its --set overrides and validated, its data and tokenizer
resolved and hash-checked, the canonical JSON whose sha256 is the manifest id; the lock read back."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from disttrace.config.identity import get_field
from disttrace.config.manifest import DEFAULT_MANIFEST, Manifest
from disttrace.config.support import _not_supported_yet
from disttrace.errors import BadInput


def parse_override(text: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section','key'], value). The value is read as a TOML value when it
    parses as one (2, 1e-3, true, "x"), else taken as a plain string."""
    if "=" not in text:
        raise BadInput("--set", f"'{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise BadInput("--set", f"'{key}' must be section.key", field=key)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_overrides(doc: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        (section, key), value = parse_override(text)
        if section not in Manifest.model_fields:
            raise BadInput("--set", f"unknown section '{section}'", field=f"{section}.{key}")
        sec = doc.setdefault(section, {})
        if not isinstance(sec, dict):
            raise BadInput("--set", f"'{section}' is not a table", field=section)
        sec[key] = value
    return doc


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file the user named (`what`: "manifest", "DeepSpeed config"), or BadInput saying why not."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(path, f"{what} file not found") from None
    except IsADirectoryError:
        raise BadInput(path, f"is a directory, not a {what} file") from None
    except UnicodeDecodeError:
        raise BadInput(path, "not UTF-8 text") from None
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror})") from None


def read_toml(path: Path) -> dict:
    text = read_text_file(path, "manifest")
    try:
        return tomllib.loads(text)
    except (
        ValueError,
        RecursionError,
    ) as e:  # TOMLDecodeError; an int past Python's digit limit; deep nesting
        raise BadInput(path, f"invalid TOML ({e})") from None


def validate(doc: dict, where: str | Path) -> Manifest:
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r})"
        msg = msg.removeprefix("Value error, ")
        raise BadInput(where, msg, field=field) from None


def canonical_json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Frozen(BaseModel):
    """What `freeze` produces and `manifest.lock.json` holds."""

    manifest: dict
    manifest_id: str
    source: str
    overrides: list[str]
    resolved: dict  # absolute paths of data and tokenizer on the machine that froze it

    def model(self) -> Manifest:
        return Manifest.model_validate(self.manifest)

    @property
    def data_path(self) -> str | None:
        """The data file, resolved on the machine that froze it (None: the lock names none)."""
        return self.resolved.get("data_path")

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer file, resolved likewise (None for the byte tokenizer, which has none)."""
        return self.resolved.get("tokenizer_path")


def freeze(path: Path | str | None, overrides: list[str] | None = None) -> Frozen:
    """Load, override, validate, resolve and check hashes; refuse anything that cannot run."""
    path = Path(path) if path else DEFAULT_MANIFEST
    return freeze_doc(read_toml(path), path, overrides)


def parse_lock(path: Path | str) -> Frozen:
    """A lock's shape alone (`Frozen`), for a job whose launcher already checked the rest with read_lock:
    its ranks re-read it without hashing the data again. Bad JSON or another shape is refused, naming the
    lock and the field."""
    path = Path(path)
    try:
        doc = orjson.loads(read_text_file(path, "lock"))
    except orjson.JSONDecodeError as e:
        raise BadInput(path, f"not valid JSON ({e})") from None
    try:
        return Frozen.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadInput(path, err["msg"], field=".".join(map(str, err["loc"])) or None) from None


def read_lock(path: Path | str) -> Frozen:
    """A lock `freeze -o` wrote (e.g. from `--from-deepspeed`), as the harness would run it: its manifest
    validated, its id recomputed, its data and tokenizer files (the paths it resolved) hashed against it and
    the features it needs supported. Refused, naming the lock and the field, where any of these fails: a lock
    is run exactly as frozen, or not at all."""
    path = Path(path)
    frozen = parse_lock(path)
    m = validate(frozen.manifest, path)
    canonical = orjson.loads(canonical_json(m.model_dump(mode="json")))
    if canonical != frozen.manifest:
        raise BadInput(path, "not in the canonical form freeze writes", field="manifest")
    if hashlib.sha256(canonical_json(canonical)).hexdigest() != frozen.manifest_id:
        raise BadInput(path, "is not the sha256 of the lock's manifest", field="manifest_id")
    for key, what, stated in (
        ("data_path", "data", m.data.sha256),
        ("tokenizer_path", "tokenizer", m.tokenizer.sha256),
    ):
        file = frozen.resolved.get(key)
        if file is None and what == "tokenizer" and m.tokenizer.kind == "byte":
            continue
        if not isinstance(file, str) or not Path(file).is_file():
            raise BadInput(path, f"{what} file not found: {file}", field=f"resolved.{key}")
        if what == "data":
            actual = sha256_file(Path(file))
        else:
            from disttrace.data.tokenizer import load_tokenizer

            actual = load_tokenizer(m.tokenizer.kind, file).sha256
        if actual != stated:
            raise BadInput(
                path,
                f"{file} has sha256 {actual[:12]}..., not the lock's {str(stated)[:12]}...",
                field=f"manifest.{what}.sha256",
            )
    unsupported = _not_supported_yet(m)
    if unsupported:
        raise BadInput(path, unsupported[1], field=f"manifest.{unsupported[0]}")
    return frozen


def _resolve_data(m: Manifest, path: Path, base: Path) -> Path:
    """The data file, found beside the manifest, its sha256 checked against the stated one and recorded."""
    data_path = (base / m.data.path).resolve()
    if not data_path.is_file():
        raise BadInput(path, f"data file not found: {data_path}", field="data.path")
    data_sha = sha256_file(data_path)
    if m.data.sha256 and m.data.sha256 != data_sha:
        raise BadInput(
            path,
            f"stated sha256 {m.data.sha256[:12]}... does not match the file's {data_sha[:12]}...",
            field="data.sha256",
        )
    m.data.sha256 = data_sha
    return data_path


def _resolve_tokenizer(m: Manifest, path: Path, base: Path) -> Path | None:
    """The tokenizer (its file, for a 'bpe' one), its sha256 checked and recorded, its vocabulary checked
    against the model's."""
    from disttrace.data.tokenizer import load_tokenizer  # tokenizers is light; no torch here

    tok_path = None
    if m.tokenizer.kind == "bpe":
        if not m.tokenizer.path:
            raise BadInput(path, "a 'bpe' tokenizer needs a path", field="tokenizer.path")
        tok_path = (base / m.tokenizer.path).resolve()
        if not tok_path.is_file():
            raise BadInput(path, f"tokenizer file not found: {tok_path}", field="tokenizer.path")
    tok = load_tokenizer(m.tokenizer.kind, str(tok_path) if tok_path else None)
    if m.tokenizer.sha256 and m.tokenizer.sha256 != tok.sha256:
        raise BadInput(
            path,
            f"stated sha256 {m.tokenizer.sha256[:12]}... does not match the tokenizer's "
            f"{tok.sha256[:12]}...",
            field="tokenizer.sha256",
        )
    m.tokenizer.sha256 = tok.sha256
    if tok.vocab_size > m.model.vocab_size:
        raise BadInput(
            path,
            f"{m.model.vocab_size} is smaller than the tokenizer's vocabulary ({tok.vocab_size})",
            field="model.vocab_size",
        )
    return tok_path


def freeze_doc(doc: dict, where: Path | str, overrides: list[str] | None = None) -> Frozen:
    """`freeze` after the TOML is read: `doc` is a manifest document in the TOML's shape (e.g. built from a
    DeepSpeed config), `where` the manifest file it stands for (errors name it; data and tokenizer paths
    resolve against its folder)."""
    path = Path(where)
    doc = apply_overrides(doc, overrides or [])
    m = validate(doc, path)
    base = path.resolve().parent

    data_path = _resolve_data(m, path, base)
    tok_path = _resolve_tokenizer(m, path, base)

    if m.parallelism.dp < 1 or m.world_size > 4096:
        raise BadInput(path, f"world size {m.world_size} is out of range", field="parallelism.dp")
    unsupported = _not_supported_yet(m)
    if unsupported:
        raise BadInput(path, unsupported[1], field=unsupported[0])

    canonical = orjson.loads(canonical_json(m.model_dump(mode="json")))
    manifest_id = hashlib.sha256(canonical_json(canonical)).hexdigest()
    return Frozen(
        manifest=canonical,
        manifest_id=manifest_id,
        source=str(path),
        overrides=list(overrides or []),
        resolved={
            "data_path": str(data_path),
            "tokenizer_path": str(tok_path) if tok_path else None,
        },
    )


def verified_data(source) -> tuple[str, str | None]:
    """The data and tokenizer paths `source`'s lock resolved (`source` a store's `Run`), each hash-checked against its manifest's
    `data.sha256` / `tokenizer.sha256` (BadInput naming the file otherwise)."""
    from disttrace.data.tokenizer import load_tokenizer

    resolved = source.lock_info.resolved
    lock = source.path / "manifest.lock.json"
    if not isinstance(resolved, dict) or not isinstance(resolved.get("data_path"), str):
        raise BadInput(lock, "names no data file", field="resolved.data_path")
    data_path, tok_path = resolved["data_path"], resolved.get("tokenizer_path")
    want = get_field(source.manifest_doc, "data.sha256")
    try:
        got = sha256_file(Path(data_path))
    except OSError as e:
        raise BadInput(data_path, f"cannot read ({e.strerror})") from None
    if not isinstance(want, str) or got != want:
        raise BadInput(
            data_path,
            f"sha256 {got[:12]}... is not the {want!s:.12}... {lock} states",
            field="data.sha256",
        )
    kind = get_field(source.manifest_doc, "tokenizer.kind")
    tok = load_tokenizer(kind, tok_path)
    if tok.sha256 != get_field(source.manifest_doc, "tokenizer.sha256"):
        raise BadInput(
            tok_path or lock,
            f"tokenizer sha256 {tok.sha256[:12]}... is not the one {lock} states",
            field="tokenizer.sha256",
        )
    return data_path, tok_path


def checkpoint_identity(manifest) -> str:
    """The manifest id a checkpoint loaded by this job must carry: the manifest's own, computed without
    `record.depth` (what is recorded at depth is not what is computed: a replay recording step S at depth
    resumes from the checkpoint of the run it replays)."""
    doc = manifest.model_dump(mode="json")
    doc["record"].pop("depth", None)
    return hashlib.sha256(canonical_json(doc)).hexdigest()
