"""Pickles in a run store, looked at and never run.

A run store may come from elsewhere (a fork's pull request, a colleague's cluster): its writer controls every
byte, the INDEX hashes included. Two pickle kinds live in a DCP checkpoint: the `.metadata` file
(`pickle.dump` of DCP's `Metadata`) and, inside the `.distcp` files, one `torch.save` archive per item (a
tensor, a plain value, an optimizer blob). A pickle runs code only through the globals it names (a
`GLOBAL`/`STACK_GLOBAL`/`INST` opcode puts a callable on the stack for `REDUCE`, `NEWOBJ`, `BUILD`), so
naming only known, harmless globals is the property to check.

This module checks it with `pickletools` opcodes: the stack is simulated just far enough to know the two
strings a `STACK_GLOBAL` takes, and nothing is ever constructed from the file. The allowlists were learnt
by scanning the checkpoints every strategy writes (DDP, ZeRO-1/2/3, TP, PP, dp x pp, parameter server);
`disttrace.run.safeload` enforces the same `METADATA_GLOBALS` when it really loads a `.metadata`.

No torch here: `disttrace verify` runs on a laptop without it.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path

# torch dtypes pickle as the global torch.<name>
TORCH_DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint16",
        "uint32",
        "uint64",
    }
)
_DCP = "torch.distributed.checkpoint"

# everything DCP's Metadata is made of, as pickle.dump writes it (found by scanning; see the module doc)
METADATA_GLOBALS = frozenset(
    {
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum: called with its value
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a dict lookup of torch's own layouts by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("torch", "Size"),
        *(("torch", d) for d in TORCH_DTYPES),
    }
)

# what a torch.save of a tensor or a plain value names (torch.load(weights_only=True) reads it)
_STORAGES = (
    "Float",
    "Double",
    "Half",
    "BFloat16",
    "Long",
    "Int",
    "Short",
    "Char",
    "Byte",
    "Bool",
    "ComplexFloat",
    "ComplexDouble",
)
TENSOR_GLOBALS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch.storage", "UntypedStorage"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        (
            "_codecs",
            "encode",
        ),  # protocol 2 pickles bytes as _codecs.encode(str, "latin1") (an optimizer blob)
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),
        # a DTensor in an optimizer blob (pipeline stages sharded by FSDP2 over dp): torch's own weights-only list
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch._utils", "_rebuild_wrapper_subclass"),
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
        ("torch.distributed._mesh_layout", "_FlatLayout"),
        ("torch.distributed._mesh_layout", "_MeshLayout"),
        ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
        ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
        ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        *(
            ("torch.distributed.tensor.placement_types", n)
            for n in ("Shard", "Replicate", "Partial", "_StridedShard")
        ),
        *(("torch", f"{s}Storage") for s in _STORAGES),
        *(("torch", d) for d in TORCH_DTYPES),
    }
)


@dataclass(frozen=True)
class Finding:
    """Damage in a pickle: `file` (and `item`, where the pickle sits inside a .distcp), and why."""

    file: Path
    reason: str
    item: str | None = None

    def __str__(self) -> str:
        return f"{self.file}{f' ({self.item})' if self.item else ''}: {self.reason}"


class _Mark:
    pass


_MARK = _Mark()
_STRINGS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_BYTES = {"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"}


@dataclass
class Scan:
    """What one pickle names: its globals in order, the byte strings it holds, whether it uses persistent ids."""

    globals: list[tuple[str, str]]
    blobs: list[bytes]
    persistent_ids: bool
    error: str | None = None  # not a pickle we can read opcode by opcode


def scan(data: bytes) -> Scan:
    """Opcodes only: the globals a pickle would import, without importing or building anything."""
    out = Scan([], [], False)
    stack: list = []
    memo: dict = {}
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                out.globals.append((module, attr))
            elif name == "STACK_GLOBAL":
                attr, module = (
                    (stack[-1] if stack else None),
                    (stack[-2] if len(stack) > 1 else None),
                )
                if not (isinstance(module, str) and isinstance(attr, str)):
                    out.globals.append(("?", f"a computed global at byte {pos}"))
                else:
                    out.globals.append((module, attr))
            elif name in ("EXT1", "EXT2", "EXT4"):
                out.globals.append(("copyreg", f"extension code {arg}"))
            elif name in ("PERSID", "BINPERSID"):
                out.persistent_ids = True
            elif name in _BYTES and isinstance(arg, (bytes, bytearray)):
                out.blobs.append(bytes(arg))
            # the stack, just far enough to know what STACK_GLOBAL and the memo see
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
                continue
            if name in _PUTS:
                memo[arg] = stack[-1] if stack else None
                continue
            before = op.stack_before
            if pickletools.markobject in before:
                while stack and stack[-1] is not _MARK:
                    stack.pop()
                if stack:
                    stack.pop()
                del stack[len(stack) - before.index(pickletools.markobject) :]
            elif before:
                del stack[max(0, len(stack) - len(before)) :]
            if name in _STRINGS:
                text = str(arg) if not isinstance(arg, bytes) else arg.decode("latin-1")
                if (
                    text[:4] == "PK\x03\x04" or text[:1] == "\x80"
                ):  # bytes as protocol 2 writes them
                    try:
                        out.blobs.append(text.encode("latin-1"))
                    except UnicodeEncodeError:
                        pass
                stack.append(text)
            elif name in _GETS:
                stack.append(memo.get(arg))
            else:
                for kind in op.stack_after:
                    stack.append(_MARK if kind is pickletools.markobject else None)
    except Exception as e:  # noqa: BLE001  a truncated or garbled pickle: damage, never a crash
        out.error = f"not a readable pickle ({type(e).__name__}: {e})"
    return out


def forbidden(found: Scan, allowed: frozenset, persistent_ids: bool = False) -> str | None:
    """The first reason this pickle must not be loaded, or None."""
    if found.error:
        return found.error
    for module, attr in found.globals:
        if (module, attr) not in allowed:
            return f"names the global {module}.{attr}, which no checkpoint of ours holds (refused unread)"
    if found.persistent_ids and not persistent_ids:
        return "uses persistent ids, which a DCP .metadata never does (refused unread)"
    return None


def _is_zip(data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04"


def scan_torch_save(data: bytes, depth: int = 0) -> str | None:
    """A torch.save archive (or a bare pickle): every data.pkl inside names only TENSOR_GLOBALS; byte strings
    that are themselves torch.save archives (an optimizer blob) are scanned too."""
    if depth > 3:
        return "torch.save archives nested too deep"
    pickles: list[bytes] = []
    if _is_zip(data):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if info.filename.endswith(".pkl"):
                        pickles.append(z.read(info))
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            return f"not a readable torch.save archive ({e})"
        if not pickles:
            return "a torch.save archive without data.pkl"
    elif data[:1] == b"\x80":  # a bare pickle (torch's legacy format)
        pickles.append(data)
    else:
        return None  # raw tensor bytes (DCP's non-torch.save format): nothing to unpickle
    for p in pickles:
        found = scan(p)
        why = forbidden(found, TENSOR_GLOBALS, persistent_ids=True)
        if why:
            return why
        for blob in found.blobs:
            if _is_zip(blob) or blob[:1] == b"\x80":
                why = scan_torch_save(blob, depth + 1)
                if why:
                    return f"an embedded archive {why}"
    return None


# ---------------------------------------------------------------- a DCP checkpoint directory


class _Stub:
    """Stands in for an allowlisted class while the item table is read: holds its arguments and state."""

    _origin = "?"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.state = None

    def __setstate__(self, state):
        self.state = state


class _StubUnpickler:
    """Reads `.metadata` with every global replaced by a _Stub class: no code of torch or of the file runs.
    Only called after `scan` found nothing but METADATA_GLOBALS."""

    def __init__(self, data: bytes):
        import pickle

        stubs: dict = {}

        class U(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) not in METADATA_GLOBALS:
                    raise pickle.UnpicklingError(f"global {module}.{name} not allowed")
                return stubs.setdefault(
                    (module, name), type(name, (_Stub,), {"_origin": f"{module}.{name}"})
                )

            def persistent_load(self, pid):
                raise pickle.UnpicklingError("persistent ids are not allowed")

        self.obj = U(io.BytesIO(data)).load()


def storage_items(metadata: bytes) -> list[tuple[str, int, int, str]]:
    """(relative_path, offset, length, item name) of every item the metadata places in a .distcp file."""
    meta = _StubUnpickler(metadata).obj
    state = getattr(meta, "state", None)
    if isinstance(state, tuple):  # (dict state, slot state)
        state = state[0]
    storage = state.get("storage_data") if isinstance(state, dict) else None
    if not isinstance(storage, dict):
        raise ValueError("no storage_data table")
    out = []
    for key, info in storage.items():
        st = getattr(info, "state", None)
        if isinstance(st, tuple):
            st = st[0]
        if not isinstance(st, dict):
            raise ValueError("a storage entry without fields")
        rel, off, length = st.get("relative_path"), st.get("offset"), st.get("length")
        if (
            not (isinstance(rel, str) and isinstance(off, int) and isinstance(length, int))
            or off < 0
            or length < 0
        ):
            raise ValueError("a storage entry with a bad relative_path/offset/length")
        kst = getattr(key, "state", None)
        kst = kst[0] if isinstance(kst, tuple) else kst
        fqn = kst.get("fqn") if isinstance(kst, dict) else None
        out.append((rel, off, length, str(fqn)))
    return out


def bare_name(name: str) -> bool:
    """A file name that stays in its directory: no separator, not '.' or '..', no NUL."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def scan_checkpoint(ckpt: Path) -> Finding | None:
    """Every pickle of one DCP checkpoint directory, by opcodes: the first damage found, or None."""
    ckpt = Path(ckpt)
    meta_path = ckpt / ".metadata"
    try:
        meta = meta_path.read_bytes()
    except OSError as e:
        return Finding(meta_path, f"cannot read ({e.strerror})")
    why = forbidden(scan(meta), METADATA_GLOBALS)
    if why:
        return Finding(meta_path, why)
    try:
        items = storage_items(meta)
    except Exception as e:  # noqa: BLE001  a .metadata that scans clean but is not DCP's shape
        return Finding(meta_path, f"not a DCP metadata table ({type(e).__name__}: {e})")
    files: dict[str, bytes] = {}
    for rel, off, length, fqn in sorted(items):
        if not bare_name(rel):
            return Finding(
                meta_path, f"item {fqn} points at '{rel}', outside the checkpoint directory"
            )
        if rel not in files:
            p = ckpt / rel
            if p.is_symlink() or not p.is_file():
                return Finding(p, "item file is missing or not a plain file")
            files[rel] = p.read_bytes()
        data = files[rel]
        if off + length > len(data):
            return Finding(ckpt / rel, f"item {fqn} lies past the end of the file", item=fqn)
        why = scan_torch_save(data[off : off + length])
        if why:
            return Finding(ckpt / rel, why, item=fqn)
    return None
