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
`disttrace.run.job.safeload` enforces the same `METADATA_GLOBALS` when it really loads a `.metadata`.

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

# what DeepSpeed 0.19's save_checkpoint stores beside the tensors (read from its files at ZeRO 0-3): plain
# records of its own (a fragment's address, the stage, the fp32 loss scaler's settings). Named, never loaded:
# DeepSpeed's load_checkpoint unpickles them in full, so `verify` is what says the bytes are the ones written
DEEPSPEED_GLOBALS = TENSOR_GLOBALS | {
    ("torch", "Tensor"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


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


# the most bytes of strings a pickle may make its loader hold, counting a memoized string once for each time it
# is fetched again (a 2-byte BINGET of a 1 MiB string costs 1 MiB more: DCP's PosixPath over a long string of
# '/' grew ~2 MiB per 2 bytes), beyond the pickle's own length
REFERENCED_LIMIT = 64 << 20


def scan(data) -> Scan:
    """Opcodes only: the globals a pickle would import, without importing or building anything. `data`: the
    pickle's bytes, or a binary file positioned at it (left after its STOP)."""
    out = Scan([], [], False)
    stack: list = []
    memo: dict = {}
    referenced = 0
    length = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
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
                stack.append(bytes(arg))
                continue
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
                got = memo.get(arg)
                if isinstance(got, (str, bytes)):
                    referenced += len(got)
                    if referenced > REFERENCED_LIMIT + length:
                        out.error = (
                            f"fetches {referenced} bytes of strings from its memo, more than a "
                            "checkpoint's pickle does (refused unread)"
                        )
                        return out
                stack.append(got)
            else:
                for kind in op.stack_after:
                    stack.append(_MARK if kind is pickletools.markobject else None)
    except Exception as e:  # noqa: BLE001  a truncated or garbled pickle: damage, never a crash
        out.error = f"not a readable pickle ({type(e).__name__}: {e})"
    return out


def _without_error(found: Scan) -> Scan:
    return Scan(found.globals, found.blobs, found.persistent_ids)


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


def pickles_in(data: bytes) -> list[Scan]:
    """Every pickle at the start of `data`, one after the other (torch's legacy format is several in a row),
    whatever its protocol (protocol 0 starts with an opcode such as '(' or 'c', not with b'\\x80'). The
    last one may hold an error: raw tensor bytes are no pickle, or a pickle is cut or garbled there (a
    loader would still have run what came before the error)."""
    out: list[Scan] = []
    f = io.BytesIO(data)
    while f.tell() < len(data):
        start = f.tell()
        found = scan(f)
        out.append(found)
        if found.error or f.tell() == start:
            break
    return out


def scan_torch_save(
    data: bytes, depth: int = 0, pickled: bool = False, allowed: frozenset = TENSOR_GLOBALS
) -> str | None:
    """A torch.save archive (or a bare pickle of any protocol): every pickle inside names only TENSOR_GLOBALS;
    byte strings that are themselves archives or pickles (an optimizer blob) are scanned too. `pickled`: the
    bytes are loaded by torch.load whatever they hold (a DCP bytes item), so bytes that are no pickle and no
    archive are refused too; otherwise (a tensor item) they may be raw tensor bytes."""
    if depth > 3:
        return "torch.save archives nested too deep"
    pickles: list[bytes] = []
    if _is_zip(data):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if info.file_size > len(
                        data
                    ):  # torch.save stores, never compresses: a zip bomb
                        return f"a member {info.filename!r} larger than its archive"
                    if info.filename.endswith(".pkl"):
                        pickles.append(z.read(info))
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            return f"not a readable torch.save archive ({e})"
        if not pickles:
            return "a torch.save archive without data.pkl"
        scans = [scan(p) for p in pickles]
    else:  # a bare pickle (torch's legacy format), of any protocol, or raw tensor bytes
        scans = pickles_in(data)
        if pickled and not data:
            return "an empty item where a pickle belongs"
    for i, found in enumerate(scans):
        # a pickle's error counts where a loader must unpickle these bytes (a bytes item's first pickle);
        # elsewhere the bytes after the pickles are raw storage (torch's legacy format) or a raw tensor, and
        # what counts is the globals named before the error: what a loader would have run by then
        strict = pickled and i == 0
        why = forbidden(
            found if strict or not found.error else _without_error(found), allowed, True
        )
        if why:
            return why
        for blob in found.blobs:
            why = scan_torch_save(blob, depth + 1, allowed=allowed)
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


def item_kinds(metadata: bytes) -> dict[str, str]:
    """fqn -> 'bytes' or 'tensor', from the metadata's state_dict_metadata: a bytes item is loaded with
    torch.load whatever its bytes are, so it is scanned as a pickle whatever its first byte."""
    meta = _StubUnpickler(metadata).obj
    state = getattr(meta, "state", None)
    if isinstance(state, tuple):
        state = state[0]
    table = state.get("state_dict_metadata") if isinstance(state, dict) else None
    if not isinstance(table, dict):
        return {}
    return {
        str(k): "bytes" if getattr(v, "_origin", "").endswith("BytesStorageMetadata") else "tensor"
        for k, v in table.items()
    }


def bare_name(name: str) -> bool:
    """A file name that stays in its directory: no separator, not '.' or '..', no NUL."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def scan_checkpoint(ckpt: Path, root: Path | None = None) -> Finding | None:
    """Every pickle of one DCP checkpoint directory, by opcodes: the first damage found, or None. Files are
    read inside `root` (by default the checkpoint's run) through store/safeio.py; .distcp files are mapped,
    and only the items are copied."""
    from disttrace.errors import BadInput
    from disttrace.store import safeio

    ckpt = Path(ckpt)
    root = ckpt.parent.parent if root is None else root
    meta_path = ckpt / ".metadata"
    try:
        meta = safeio.read_bytes(meta_path, root, "metadata")
    except BadInput as e:
        return Finding(meta_path, e.reason)
    why = forbidden(scan(meta), METADATA_GLOBALS)
    if why:
        return Finding(meta_path, why)
    try:
        items = storage_items(meta)
    except Exception as e:  # noqa: BLE001  a .metadata that scans clean but is not DCP's shape
        return Finding(meta_path, f"not a DCP metadata table ({type(e).__name__}: {e})")
    kinds = item_kinds(meta)
    files: dict = {}
    for rel, off, length, fqn in sorted(items):
        if not bare_name(rel):
            return Finding(
                meta_path, f"item {fqn} points at '{rel}', outside the checkpoint directory"
            )
        if rel not in files:
            p = ckpt / rel
            if p.is_symlink() or not safeio.is_regular(p, root):
                return Finding(p, "item file is missing or not a plain file")
            try:
                files[rel] = safeio.mapped(p, root)
            except BadInput as e:
                return Finding(p, e.reason)
        data = files[rel]
        if off + length > len(data):
            return Finding(ckpt / rel, f"item {fqn} lies past the end of the file", item=fqn)
        if length > safeio.LIMITS["item"]:
            return Finding(
                ckpt / rel, f"item {fqn} of {length} bytes is larger than an item may be"
            )
        why = scan_torch_save(data[off : off + length], pickled=kinds.get(fqn) == "bytes")
        if why:
            return Finding(ckpt / rel, why, item=fqn)
    return None


def scan_deepspeed_checkpoint(ckpt: Path, root: Path | None = None) -> Finding | None:
    """Every file of a DeepSpeed engine.save_checkpoint directory (torch.save archives), by opcodes, read
    inside `root` as scan_checkpoint reads: names only tensors and the plain records DeepSpeed stores beside
    them (DEEPSPEED_GLOBALS); nothing is loaded."""
    from disttrace.errors import BadInput
    from disttrace.store import safeio

    ckpt = Path(ckpt)
    root = ckpt.parent.parent if root is None else root
    for p in sorted(ckpt.iterdir()):
        if p.name == "INDEX.json" or not p.is_file():
            continue
        if p.is_symlink() or not safeio.is_regular(p, root):
            return Finding(p, "is missing or not a plain file")
        try:
            data = safeio.mapped(p, root)
        except BadInput as e:
            return Finding(p, e.reason)
        why = scan_torch_save(data, pickled=True, allowed=DEEPSPEED_GLOBALS)
        if why:
            return Finding(p, why)
    return None
