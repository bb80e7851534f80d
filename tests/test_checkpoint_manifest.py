"""The commit's manifest from the ranks' own digests, and the checkpoint writer without torch.save's
zip CRC-32 (which torch.load never checks; the manifest's SHA-256 is the check). One process."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile

import pytest
import torch

import allhands.checkpoint.manifest as manifest
from allhands.checkpoint import Checkpointer, ModelOptimState, TrainState
from allhands.checkpoint.writer import IN_WRITER
from allhands.errors import CheckpointError
from allhands.checkpoint.manifest import MANIFEST_NAME, file_digest, verify_manifest, write_manifest


def _crcs(data: bytes) -> list[int]:
    return [i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist()]


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_only_the_checkpoint_writer_thread_skips_the_zip_crc():
    t = torch.arange(1000.0)
    assert all(_crcs(_saved(t))), "torch.save outside a writer must keep its CRC-32"
    seen = {}

    def writer():
        IN_WRITER.active = True
        try:
            seen["writer"] = _saved(t)
            seen["other"] = None
            done.wait(60)  # another thread saves while this one is still a writer
        finally:
            IN_WRITER.active = False

    done = threading.Event()
    th = threading.Thread(target=writer)
    th.start()
    while "other" not in seen:
        pass
    other = _saved(t)
    done.set()
    th.join()
    assert not any(_crcs(seen["writer"])) and all(_crcs(other))
    assert torch.equal(torch.load(io.BytesIO(seen["writer"]), weights_only=True), t)
    assert torch.serialization.get_crc32_options() is True


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"model": ModelOptimState(model, opt), "train": TrainState()}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_commit_takes_the_writers_digests_and_still_covers_every_file(tmp_path, monkeypatch, mode):
    hashed = []
    real = manifest._sha256
    monkeypatch.setattr(manifest, "_sha256", lambda p: (hashed.append(p.name), real(p))[1])
    ckpt = Checkpointer(tmp_path, rank=0, mode=mode)
    state = _state()
    for step in (1, 2):  # the second save runs on DCP's cached plan
        ckpt.save(step, state)
        ckpt.wait()
    ckpt.close()
    assert ckpt.failures == 0, ckpt.warnings
    # Per save: the writer hashes its data file once; the commit only .metadata and allhands.json.
    assert sorted(hashed) == sorted(["__0_0.distcp", ".metadata", "allhands.json"] * 2)
    step, path = ckpt.latest()
    doc = json.loads((path / MANIFEST_NAME).read_text())
    assert {f["path"] for f in doc["files"]} == {p.name for p in path.iterdir()} - {MANIFEST_NAME}
    for f in doc["files"]:
        data = (path / f["path"]).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest(), f
    verify_manifest(path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside a tensor: no zip CRC, the manifest still catches it
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="'__0_0.distcp' .* does not match its SHA-256"):
        verify_manifest(path)


def test_write_manifest_rehashes_a_stale_digest_and_refuses_a_missing_file(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"abc")
    (tmp_path / ".metadata").write_bytes(b"meta")
    stale = {"a.distcp": (2, "0" * 64)}  # another size: not this file's digest
    write_manifest(tmp_path, stale)
    verify_manifest(tmp_path)
    assert file_digest(tmp_path / "a.distcp") == (3, hashlib.sha256(b"abc").hexdigest())
    with pytest.raises(CheckpointError, match="'b.distcp' was written but is missing"):
        write_manifest(tmp_path, {"b.distcp": (1, "0" * 64)})
