"""Loading a DCP checkpoint that someone else may have written, without running any of their code.

torch.distributed.checkpoint reads `.metadata` with a plain `pickle.load`, and its default load planner reads
every non-tensor item with a full (not weights-only) `torch.load`: a crafted checkpoint runs whatever its pickles
name. Every checkpoint load of ours (worker resume, the gate's evaluation, so recover and lab too) goes
through `load` below instead:

- `SafeReader.read_metadata` unpickles with a `find_class` that admits only the globals DCP's `Metadata`
  is made of (`disttrace.store.pickles.METADATA_GLOBALS`, learnt by scanning every strategy's checkpoints)
  and checks that every item's file is a bare name inside the checkpoint directory;
- `SafePlanner.load_bytes` reads non-tensor items with `torch.load(weights_only=True)` (tensors DCP already
  reads that way).

Anything else is BadInput (exit 2) naming the file and the global, raised before the pickle builds anything.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from disttrace.errors import BadInput
from disttrace.store.pickles import METADATA_GLOBALS, bare_name


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: Path):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise BadInput(
                self.where,
                f"names the global {module}.{name}, which a DCP checkpoint's metadata "
                "never holds (refused before loading anything)",
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise BadInput(
            self.where, "uses a persistent id, which a DCP checkpoint's metadata never does"
        )


def read_metadata_file(path: Path) -> Metadata:
    """The allowlisting load of one `.metadata` file."""
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except BadInput:
        raise
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror})") from None
    except Exception as e:  # noqa: BLE001  truncated or garbled: bad input, one line
        raise BadInput(path, f"not a DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "storage_data", None), dict):
        raise BadInput(path, f"holds a {type(meta).__name__}, not DCP's Metadata")
    for index, info in meta.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not bare_name(rel):
            raise BadInput(
                path,
                f"item {getattr(index, 'fqn', '?')} points at {rel!r}, outside the checkpoint "
                "directory",
                field="storage_data",
            )
    return meta


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata load is an allowlisting unpickler."""

    def __init__(self, path: Path | str):
        super().__init__(str(path))
        self.ckpt = Path(path)

    refused: BadInput | None = (
        None  # set when the metadata was refused: DCP's fallbacks must not hide it
    )

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if (
            self.refused is not None
        ):  # DCP retries a rank-local file after any failure: keep the refusal
            raise self.refused
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            meta = read_metadata_file(self.ckpt / name)
        except BadInput as e:
            self.refused = e
            raise
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items load with weights_only=True."""

    def __init__(self, ckpt: Path, **kwargs):
        super().__init__(**kwargs)
        self.ckpt = Path(ckpt)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001  the weights-only unpickler names the global it refused
            lines = str(e).strip().splitlines()
            why = next(
                (ln for ln in lines if "global" in ln.lower()),
                lines[0] if lines else type(e).__name__,
            )
            raise BadInput(
                self._file_of(read_item),
                f"item {fqn} is not plain data ({why.strip()}); refused unread",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _file_of(self, read_item) -> Path:
        """The .distcp file the item lies in (the checkpoint directory when the metadata does not say)."""
        try:
            rel = self.metadata.storage_data[read_item.storage_index].relative_path
        except (AttributeError, KeyError, TypeError):
            return self.ckpt
        return self.ckpt / rel if isinstance(rel, str) and "/" not in rel else self.ckpt


def _bad_input_inside(e: BaseException) -> BadInput | None:
    """DCP wraps a rank's exception in a CheckpointException; find ours inside it."""
    failures = getattr(e, "failures", None) or {}
    for exc_pair in failures.values():
        exc = exc_pair[0] if isinstance(exc_pair, tuple) else exc_pair
        if isinstance(exc, BadInput):
            return exc
    return None


def load(state: dict, ckpt: Path | str, no_dist: bool = False) -> None:
    """dcp.load through our reader and planner; our refusals come out as BadInput, unwrapped."""
    import torch.distributed.checkpoint as dcp

    ckpt = Path(ckpt)
    reader = SafeReader(ckpt)
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(ckpt), no_dist=no_dist)
    except BadInput:
        raise
    except BaseException as e:  # CheckpointException derives from BaseException
        ours = reader.refused or _bad_input_inside(e)
        if ours is not None:
            raise ours from None
        raise
