"""Reading checkpoints without trusting them, and proving a worker holds the job's secret.

A DCP checkpoint is code as much as data: ``FileSystemReader.read_metadata`` runs ``pickle.load``
on ``<ckpt>/.metadata`` and ``DefaultLoadPlanner.load_bytes`` runs ``torch.load(...,
weights_only=False)`` on every non-tensor item, so a crafted checkpoint runs code on load.
:class:`SafeFileSystemReader` closes both: metadata goes through :class:`RestrictedUnpickler`
(only the classes ``dcp.save`` itself writes) and non-tensor items must pass
``torch.load(weights_only=True)`` first. Tensor items were already read with
``weights_only=True`` by torch.

A manifest (``manifest.json``: size and SHA-256 of every file) detects a checkpoint that was
damaged or edited after it was committed. The HMAC helpers let a worker prove it was started
by this job without sending the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pathlib
import pickle
import re
import secrets
import struct
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

__all__ = [
    "MANIFEST_NAME", "MANIFEST_VERSION", "RestrictedUnpickler", "SafeFileSystemReader",
    "checkpoint_error_from", "file_digest", "new_secret", "prove", "verify", "verify_manifest",
    "verify_metadata", "write_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


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
                f"refused to unpickle {module}.{name} from {self.source}: DCP never writes it, so "
                f"the checkpoint may be crafted; it was not loaded (use one written by dcp.save)")
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
            raise CheckpointError(f"{source} points at data {rel!r} outside the checkpoint or at a "
                                  f"bad offset; the checkpoint may be crafted and was not loaded")


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
        return super().read_data(plan, _WeightsOnlyBytes(planner, self))


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
            raise CheckpointError(f"refused non-tensor item {fqn!r} in {source}: {_refusal(e)}; "
                                  f"the checkpoint may be crafted and was not loaded") from None
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


# --------------------------------------------------------------------------- manifest


def _files(ckpt_dir: Path) -> dict[str, Path]:
    """Every entry under ``ckpt_dir`` that is not a directory (symlinks included, so that they
    are reported rather than followed), but the manifest, by POSIX relative path."""
    out = {}
    for p in ckpt_dir.rglob("*"):
        rel = p.relative_to(ckpt_dir).as_posix()
        if rel != MANIFEST_NAME and (p.is_symlink() or not p.is_dir()):
            out[rel] = p
    return out


def _plain(rel: str, p: Path, root: Path) -> Path:
    if p.is_symlink() or not p.is_file():
        raise CheckpointError(f"{rel!r} in checkpoint {str(root)!r} is not a plain file (DCP "
                              f"writes only plain files); remove it or use another checkpoint")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """Size and SHA-256 of one file, as ``write_manifest`` records them."""
    p = Path(path)
    return p.stat().st_size, _sha256(p)


def write_manifest(ckpt_dir: str | os.PathLike,
                   digests: dict[str, tuple[int, str]] | None = None) -> Path:
    """Record size and SHA-256 of every file of a finished checkpoint in ``manifest.json``.

    ``digests``: ``{relative path: (size, sha256)}`` already computed by ``file_digest`` (each
    rank hashes the files it wrote, right after writing them, so the hashing is spread over the
    ranks instead of all falling on the one that commits). Every file on disk is still listed:
    one without a digest, or whose size differs from its digest's, is hashed here, and a digest
    for a file that is not there is an error (the save is incomplete).

    Written to a temporary name, fsynced and renamed, so a manifest that exists is complete.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"cannot write a manifest: {str(root)!r} is not a directory; pass "
                              f"the checkpoint directory")
    digests = digests or {}
    on_disk = _files(root)
    missing = sorted(digests.keys() - on_disk.keys())
    if missing:
        raise CheckpointError(f"cannot write a manifest: {missing[0]!r} was written but is missing "
                              f"from {str(root)!r}; the save is incomplete, save again")
    files = []
    for rel, p in sorted(on_disk.items()):
        size = _plain(rel, p, root).stat().st_size
        known = digests.get(rel)
        sha = known[1] if known is not None and known[0] == size else _sha256(p)
        files.append({"path": rel, "size": size, "sha256": sha})
    body = json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1) + "\n"
    final = root / MANIFEST_NAME
    tmp = root / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {str(final)!r} ({e.strerror or e}); check free space "
                              f"and permissions") from e
    return final


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is missing: the checkpoint cannot be verified; "
                              f"re-save it, or write a manifest for one you trust") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({first_line(e)}); the "
                              f"checkpoint cannot be verified") from None
    bad = CheckpointError(f"{str(path)!r} is not a version {MANIFEST_VERSION} manifest; it may be "
                          f"damaged or edited, so the checkpoint cannot be verified")
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        raise bad
    entries = doc.get("files")
    if not isinstance(entries, list):
        raise bad
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                and type(e.get("size")) is int and isinstance(e.get("sha256"), str)
                and _SHA256_HEX.match(e["sha256"]) and e["path"] not in out):
            raise bad
        out[e["path"]] = e
    return out


def verify_manifest(ckpt_dir: str | os.PathLike) -> None:
    """Check the files of a checkpoint against its ``manifest.json``; the first difference by
    path (missing, extra, other size, other SHA-256) is a :class:`CheckpointError`.

    Only files found on disk are opened: paths in the manifest are compared, never followed.
    """
    root = Path(ckpt_dir)
    expected = _read_manifest(root / MANIFEST_NAME)
    actual = _files(root)
    where = f"checkpoint {str(root)!r}"
    for rel in sorted(expected.keys() | actual.keys()):
        if rel not in actual:
            raise CheckpointError(f"{rel!r} listed in the manifest is missing from {where}; it is "
                                  f"incomplete, use another checkpoint")
        if rel not in expected:
            raise CheckpointError(f"{rel!r} in {where} is not in its manifest; it was added after "
                                  f"the save, remove it or use another checkpoint")
        size = _plain(rel, actual[rel], root).stat().st_size
        if size != expected[rel]["size"]:
            raise CheckpointError(f"{rel!r} in {where} has {size} bytes, the manifest says "
                                  f"{expected[rel]['size']}; it was damaged or edited, use another "
                                  f"checkpoint")
        if not hmac.compare_digest(_sha256(actual[rel]), expected[rel]["sha256"]):
            raise CheckpointError(f"{rel!r} in {where} does not match its SHA-256 in the manifest; "
                                  f"it was damaged or edited, use another checkpoint")


# --------------------------------------------------------------------------- admission secret


def new_secret() -> bytes:
    """A fresh 256-bit job secret."""
    return secrets.token_bytes(32)


def _message(nonce: bytes, rank: int, context: bytes = b"") -> bytes:
    # Length-prefixed nonce and a fixed-width rank keep the fields unambiguous
    # (b"1" + 23 differs from b"12" + 3); the context (pid, address) comes last.
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**64:
        raise ValueError(f"rank must be an int in [0, 2**64), got {rank!r}")
    return struct.pack(">I", len(nonce)) + bytes(nonce) + struct.pack(">Q", rank) + bytes(context)


def prove(secret: bytes, nonce: bytes, rank: int, context: bytes = b"") -> str:
    """Hex HMAC-SHA256 of ``nonce, rank, context`` under the job secret: proves it, reveals
    nothing about it."""
    return hmac.new(secret, _message(nonce, rank, context), hashlib.sha256).hexdigest()


def verify(secret: bytes, nonce: bytes, rank: int, proof: str, context: bytes = b"") -> bool:
    """Whether ``proof`` is :func:`prove` of these inputs (constant-time comparison)."""
    if not isinstance(proof, str):
        return False
    try:
        given = proof.encode("ascii")
        expected = prove(secret, nonce, rank, context).encode("ascii")
    except (UnicodeEncodeError, ValueError):
        return False
    return hmac.compare_digest(given, expected)
