"""The manifest of a committed checkpoint: ``manifest.json`` holds the size and SHA-256 of every
file, so a checkpoint damaged or edited after it was committed is detected before it is loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Any

from allhands.errors import CheckpointError, first_line
from allhands.safefs import open_private

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


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
        with open_private(tmp, "w", encoding="utf-8") as f:
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
