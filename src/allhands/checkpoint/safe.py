"""Reading checkpoints without trusting them.

A DCP checkpoint is code as much as data: ``FileSystemReader.read_metadata`` runs ``pickle.load``
on ``<ckpt>/.metadata`` and ``DefaultLoadPlanner.load_bytes`` runs ``torch.load(...,
weights_only=False)`` on every non-tensor item, so a crafted checkpoint runs code on load.
:class:`SafeFileSystemReader` closes both: metadata goes through :class:`RestrictedUnpickler`
(only the classes ``dcp.save`` itself writes) and non-tensor items must pass
``torch.load(weights_only=True)`` first. Tensor items were already read with
``weights_only=True`` by torch.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from allhands.errors import CheckpointError, first_line


# --------------------------------------------------------------------------- DCP metadata

# Every global that torch 2.13's ``dcp.save`` puts into ``.metadata``, recorded from saves of
# plain and ``get_state_dict`` model + AdamW state (nested dicts, ints, strings, bytes, tensors of
# several dtypes, channels-last and empty tensors, one and many files per rank, FSDP2 DTensors).
# Containers, str/bytes/int/float/bool/None use pickle opcodes and need no global at all.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_dcp_md.__name__, cls.__name__): cls
    for cls in (
        _dcp_md.Metadata, _dcp_md.StorageMeta, _dcp_md.MetadataIndex,
        _dcp_md.TensorStorageMetadata, _dcp_md.BytesStorageMetadata,
        _dcp_md.ChunkStorageMetadata, _dcp_md.TensorProperties,
        _dcp_md._MEM_FORMAT_ENCODING,  # TensorProperties.__getstate__ encodes memory_format
    )
}
_ALLOWED[(_dcp_fs.__name__, "_StorageInfo")] = _dcp_fs._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
# torch.layout pickles as torch.serialization._get_layout("torch.strided"): a dict lookup.
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# StorageMeta.checkpoint_id is the writer's Path. Python 3.13 defines it in pathlib._local.
for _mod in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "WindowsPath"):
        _ALLOWED[(_mod, _name)] = getattr(pathlib, _name)


def _allowed(module: str, name: str) -> Any | None:
    found = _ALLOWED.get((module, name))
    if found is None and module == "torch":  # dtypes pickle as torch.<name>, e.g. torch.float32
        value = torch.__dict__.get(name)  # no getattr: torch imports some names lazily
        if isinstance(value, torch.dtype):
            found = value
    return found


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals DCP writes into ``.metadata``.

    Pickle reaches a callable only through ``find_class``, so a crafted file can call nothing
    but the constructors of DCP's inert metadata dataclasses, ``torch.Size``, paths and the
    layout lookup (its BUILD opcode can still set attributes on those objects: that can corrupt
    what is loaded, not run other code). Persistent ids are refused by the base class.
    """

    def __init__(self, file: IO[bytes], *, source: str = "<stream>"):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise CheckpointError(
                f"{self.source}: refused (unsafe): refused to unpickle {module}.{name}, which DCP "
                f"never writes, so the checkpoint may be crafted; it was not loaded (use one "
                f"written by dcp.save)")
        return found


def _load_metadata(path: str | os.PathLike, stream: IO[bytes] | None = None) -> Metadata:
    """Unpickle one ``.metadata`` file with :class:`RestrictedUnpickler`; every failure is a
    one-line :class:`CheckpointError`."""
    source = str(path)
    try:
        if stream is None:
            with open(path, "rb") as f:
                metadata = RestrictedUnpickler(f, source=source).load()
        else:
            metadata = RestrictedUnpickler(stream, source=source).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{source} does not exist: not a committed DCP checkpoint (or its "
                              f"save did not finish); pass a committed step directory") from None
    except Exception as e:
        raise CheckpointError(f"cannot read {source} ({first_line(e)}); the checkpoint is damaged "
                              f"or was not written by dcp.save; use another checkpoint") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP Metadata; the "
                              f"checkpoint may be crafted and was not loaded")
    _check_storage(metadata, source)
    return metadata


def _check_storage(metadata: Metadata, source: str) -> None:
    """Every data file the metadata names lies inside the checkpoint directory, so a crafted
    ``relative_path`` cannot make the reader open files elsewhere."""
    data = metadata.storage_data
    if not isinstance(data, dict):
        raise CheckpointError(f"{source} has no storage table (storage_data is "
                              f"{type(data).__name__}); the checkpoint is damaged or crafted")
    for info in data.values():
        rel = getattr(info, "relative_path", None)
        if not (isinstance(info, _dcp_fs._StorageInfo) and isinstance(rel, str) and rel
                and not rel.startswith(("/", "\\")) and ":" not in rel
                and ".." not in re.split(r"[\\/]", rel)
                and type(info.offset) is int and type(info.length) is int
                and info.offset >= 0 and info.length >= 0):
            raise CheckpointError(f"{source}: refused (unsafe): it points at data {rel!r} outside "
                                  f"the checkpoint or at a bad offset; the checkpoint may be "
                                  f"crafted and was not loaded")


def verify_metadata(ckpt_dir: str | os.PathLike) -> None:
    """Check that ``ckpt_dir/.metadata`` unpickles with only DCP's own classes, without running
    anything else it may contain."""
    _load_metadata(Path(ckpt_dir) / ".metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never runs code from the checkpoint.

    ``read_metadata`` uses :class:`RestrictedUnpickler` instead of ``pickle.load``. Non-tensor
    ("bytes") items are deserialised by the *planner* (torch 2.13 ``DefaultLoadPlanner.load_bytes``
    calls ``torch.load(value, weights_only=False)``), which a reader cannot change; so
    ``read_data`` hands the planner a wrapper that first loads each item with
    ``torch.load(weights_only=True)`` and refuses it on failure. Only a pickle that the
    weights-only unpickler accepted (allowlisted globals and calls) reaches the planner's
    unrestricted load. Use as ``dcp.load(state, storage_reader=SafeFileSystemReader(path))``.
    """

    refusal: CheckpointError | None = None
    """Why the last ``read_metadata`` refused the checkpoint. ``dcp.load`` catches that error,
    tries the rank-local ``__<rank>.metadata`` and reports only its text in an AssertionError;
    :func:`checkpoint_error_from` takes the reader to recover it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Same as torch 2.13 FileSystemReader.read_metadata, with the unpickler swapped.
        rank = kwargs.get("rank")
        if rank is None:
            self.refusal = None
        elif self.refusal is not None:
            raise self.refusal  # fail closed: no fallback past a checkpoint judged crafted
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as metadata_file:
            try:
                metadata = _load_metadata(path, metadata_file)
            except CheckpointError as e:
                self.refusal = e
                raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.refusal = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Tensor items torch reads itself with torch.load(weights_only=True): a crafted one fails
        # there with torch's advice to pass weights_only=False. The item being read is noted on
        # its way through the load-stream transforms, so its refusal can name it instead.
        self.transforms = _NoteItem(self.transforms, self)
        try:
            return super().read_data(plan, _WeightsOnlyBytes(planner, self))
        except pickle.UnpicklingError as e:
            req = self._reading
            fqn = req.storage_index.fqn if req is not None else "?"
            info = self.storage_data.get(req.storage_index) if req is not None else None
            source = os.path.join(str(self.path), info.relative_path if info else "?")
            raise _unsafe_item(fqn, source, e) from None
        finally:
            self.transforms = self.transforms._inner

    _reading: ReadItem | None = None


class _NoteItem:
    """DCP's load-stream transforms, noting which item is being read (for its refusal)."""

    def __init__(self, inner: Any, reader: SafeFileSystemReader):
        self._inner, self._reader = inner, reader

    def transform_load_stream(self, req: ReadItem, *args: Any, **kwargs: Any):
        self._reader._reading = req
        return self._inner.transform_load_stream(req, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _unsafe_item(fqn: str, source: str, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint item {fqn!r} in {source}: refused (unsafe): {_refusal(e)}; "
                           f"the checkpoint may be crafted and was not loaded")


class _WeightsOnlyBytes:
    """A load planner seen through a filter: ``load_bytes`` admits only weights-only pickles."""

    def __init__(self, planner: LoadPlanner, reader: SafeFileSystemReader):
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        info = self._reader.storage_data.get(read_item.storage_index)
        source = os.path.join(str(self._reader.path), info.relative_path if info else "?")
        fqn = read_item.storage_index.fqn
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise _unsafe_item(fqn, source, e) from None
        except Exception as e:
            raise CheckpointError(f"cannot read non-tensor item {fqn!r} in {source} "
                                  f"({first_line(e)}); the checkpoint is damaged") from e
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def _refusal(e: BaseException) -> str:
    """One clause from torch's multi-paragraph weights-only error: the refused global if named."""
    text = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it unpickles {m.group(1)}, which torch.load(weights_only=True) refuses"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


def checkpoint_error_from(exc: BaseException,
                          reader: SafeFileSystemReader | None = None) -> CheckpointError | None:
    """Our :class:`CheckpointError` behind a failed ``dcp.load``, so a caller can show its one
    line instead of DCP's ``CheckpointException`` dump; ``None`` if the failure was not ours.

    Data refusals arrive wrapped in the exception's per-rank ``failures``; metadata refusals
    only as text (DCP catches them), so pass the reader used for the load.
    """
    if isinstance(exc, CheckpointError):
        return exc
    for wrapped in (getattr(exc, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, CheckpointError):
            return inner
    cause = exc.__cause__ or exc.__context__
    found = checkpoint_error_from(cause) if cause is not None else None
    return found or (reader.refusal if reader is not None else None)
