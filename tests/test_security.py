"""Checkpoints are read without running their code; manifests catch edits; admission proofs.

Everything runs in this process without a process group (DCP's ``no_dist=True``). Each crafted
payload first runs unprotected against a control canary, so a refusal cannot pass vacuously.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from allhands.errors import CheckpointError
from allhands.admission import new_secret, prove, verify
from allhands.checkpoint.export import export_weights
from allhands.checkpoint.manifest import MANIFEST_NAME, verify_manifest, write_manifest
from allhands.checkpoint.safe import (RestrictedUnpickler, SafeFileSystemReader, checkpoint_error_from,
                                      verify_metadata)


pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")]


class Canary:
    """Unpickling this creates (truncates) ``path``: ``open(path, "w")`` stands for any code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model_and_optim(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer, n: int, blob: bytes, t: torch.Tensor):
    msd, osd = get_state_dict(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for _ in range(n):
        sched.step()
    return {"model": {"model": msd, "optim": osd}, "scheduler": sched.state_dict(),
            "extra": {"n": n, "blob": blob, "nested": {"name": f"run{n}", "t": t}}}


def _tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}{i}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A real DCP checkpoint of a small model + AdamW state after one step, and what went in."""
    path = tmp_path_factory.mktemp("ckpt") / "step-00000001"
    model, opt = _model_and_optim(0)
    state = _state(model, opt, 7, b"\x00\xffbytes", torch.arange(5))
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, state


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint, with one nested file, free to damage."""
    path = tmp_path / "step"
    shutil.copytree(saved[0], path)
    (path / "extra").mkdir()
    (path / "extra" / "notes.txt").write_text("hello\n")
    return path


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------- metadata


def test_real_checkpoint_passes_and_loads_through_safe_reader(saved):
    path, want = saved
    verify_metadata(path)
    md = SafeFileSystemReader(path).read_metadata()
    assert isinstance(md, Metadata) and md.storage_meta.load_id
    assert "extra.blob" in md.state_dict_metadata

    model2, opt2 = _model_and_optim(1)  # other weights and moments
    got = _state(model2, opt2, 0, b"", torch.zeros(5, dtype=torch.long))
    dcp.load(got, storage_reader=SafeFileSystemReader(path), no_dist=True)

    want_t, got_t = dict(_tensors(want)), dict(_tensors(got))
    assert want_t.keys() == got_t.keys() and len(want_t) > 10
    for k in want_t:
        assert torch.equal(want_t[k], got_t[k]), k
    assert got["extra"]["n"] == 7 and got["extra"]["blob"] == b"\x00\xffbytes"
    assert got["extra"]["nested"]["name"] == "run7"
    assert got["model"]["optim"]["param_groups"] == want["model"]["optim"]["param_groups"]
    assert got["scheduler"] == want["scheduler"] and got["scheduler"]["last_epoch"] == 7


def _craft_metadata(ckpt: Path, canary: Path) -> None:
    md = Metadata(state_dict_metadata={}, planner_data={"x": Canary(canary)})
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_crafted_metadata_is_refused(ckpt, tmp_path):
    control = tmp_path / "control-canary"
    _craft_metadata(ckpt, control)
    with open(ckpt / ".metadata", "rb") as f:
        pickle.load(f)  # what torch's FileSystemReader.read_metadata does
    assert control.exists()

    canary = tmp_path / "canary"
    _craft_metadata(ckpt, canary)
    with pytest.raises(CheckpointError) as ei:
        verify_metadata(ckpt)
    msg = _one_line(ei.value)
    assert "open" in msg and ".metadata" in msg and "crafted" in msg and "not loaded" in msg
    with pytest.raises(CheckpointError):
        SafeFileSystemReader(ckpt).read_metadata()
    assert not canary.exists()


def test_crafted_metadata_is_refused_by_dcp_load(tmp_path):
    ckpt, canary = tmp_path / "c", tmp_path / "canary"
    dcp.save({"x": torch.ones(2)}, checkpoint_id=ckpt, no_dist=True)
    shutil.copy(ckpt / ".metadata", ckpt / "__0.metadata")  # genuine: DCP's fallback must not win
    _craft_metadata(ckpt, canary)
    got = {"x": torch.zeros(2)}
    reader = SafeFileSystemReader(ckpt)
    with pytest.raises(BaseException) as ei:  # DCP wraps failures in CheckpointException
        dcp.load(got, storage_reader=reader, no_dist=True)
    err = checkpoint_error_from(ei.value, reader)
    assert isinstance(err, CheckpointError) and "crafted" in _one_line(err)
    assert "/.metadata" in str(err)
    assert not canary.exists() and torch.equal(got["x"], torch.zeros(2))


def test_data_path_outside_checkpoint_is_refused(ckpt):
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # genuine, so plain pickle is fine here
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../other/__0_0.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint") as ei:
        verify_metadata(ckpt)
    assert "'../other/__0_0.distcp'" in _one_line(ei.value)


def test_unrelated_global_and_missing_or_garbage_metadata(tmp_path):
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_metadata(ckpt)
    (ckpt / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="cannot read") as ei:
        verify_metadata(ckpt)
    _one_line(ei.value)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not DCP Metadata"):
        verify_metadata(ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(shutil.rmtree))  # any global outside the list
    with pytest.raises(CheckpointError, match="refused to unpickle shutil.rmtree"):
        verify_metadata(ckpt)


def test_allowlist_admits_dtypes_but_not_other_torch_attributes():
    import io

    ok = pickle.dumps([torch.bfloat16, torch.Size([2, 3]), torch.strided])
    assert RestrictedUnpickler(io.BytesIO(ok)).load() == [torch.bfloat16, torch.Size([2, 3]),
                                                          torch.strided]
    with pytest.raises(CheckpointError, match="torch.load"):
        RestrictedUnpickler(io.BytesIO(b"ctorch\nload\n.")).load()  # GLOBAL torch.load


def test_crafted_bytes_item_is_refused(tmp_path):
    ckpt = tmp_path / "c"
    control, canary = tmp_path / "control-canary", tmp_path / "canary"
    dcp.save({"x": torch.ones(2), "evil": Canary(control)}, checkpoint_id=ckpt, no_dist=True)
    verify_metadata(ckpt)  # the metadata itself is genuine: the payload is in a bytes item
    dcp.load({"x": torch.zeros(2), "evil": None}, checkpoint_id=ckpt, no_dist=True)
    assert control.exists()  # torch's planner loads bytes items with weights_only=False

    shutil.rmtree(ckpt)
    dcp.save({"x": torch.ones(2), "evil": Canary(canary)}, checkpoint_id=ckpt, no_dist=True)
    with pytest.raises(BaseException) as ei:
        dcp.load({"x": torch.zeros(2), "evil": None}, storage_reader=SafeFileSystemReader(ckpt),
                 no_dist=True)
    err = checkpoint_error_from(ei.value)
    assert isinstance(err, CheckpointError), ei.value
    msg = _one_line(err)
    assert "'evil'" in msg and ".distcp" in msg and "io.open" in msg and "crafted" in msg
    assert not canary.exists()


def test_crafted_pt_file_is_harmless_with_weights_only(tmp_path):
    control, canary = tmp_path / "control-canary", tmp_path / "canary"
    torch.save(Canary(control), tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()

    torch.save(Canary(canary), tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "evil.pt", weights_only=True)
    assert not canary.exists()


# --------------------------------------------------------------------------- manifest


def test_manifest_roundtrip(ckpt):
    out = write_manifest(ckpt)
    assert out == ckpt / MANIFEST_NAME
    doc = json.loads(out.read_text())
    assert doc["version"] == 1
    paths = [f["path"] for f in doc["files"]]
    assert paths == sorted(paths) and ".metadata" in paths and "extra/notes.txt" in paths
    assert all(len(f["sha256"]) == 64 and f["size"] == (ckpt / f["path"]).stat().st_size
               for f in doc["files"])
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]
    verify_manifest(ckpt)


def test_manifest_names_each_flipped_byte(ckpt):
    write_manifest(ckpt)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    assert len(files) >= 3
    for p in files:
        rel = p.relative_to(ckpt).as_posix()
        orig = p.read_bytes()
        damaged = bytearray(orig)
        damaged[len(orig) // 2] ^= 0x01
        p.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError, match="SHA-256") as ei:
            verify_manifest(ckpt)
        assert _one_line(ei.value).startswith(repr(rel))
        p.write_bytes(orig)
        verify_manifest(ckpt)


def test_manifest_names_first_difference(ckpt):
    write_manifest(ckpt)
    for rel in ("extra/notes.txt", ".metadata"):  # ".metadata" sorts first
        with open(ckpt / rel, "ab") as f:
            f.write(b"x")
    with pytest.raises(CheckpointError, match="bytes, the manifest says") as ei:
        verify_manifest(ckpt)
    assert _one_line(ei.value).startswith("'.metadata'")


def test_manifest_detects_deleted_and_added_files(ckpt):
    write_manifest(ckpt)
    (ckpt / "extra" / "notes.txt").unlink()
    with pytest.raises(CheckpointError, match="'extra/notes.txt' listed in the manifest is miss"):
        verify_manifest(ckpt)
    (ckpt / "extra" / "notes.txt").write_text("hello\n")
    verify_manifest(ckpt)
    (ckpt / "__0_1.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="'__0_1.distcp' .* is not in its manifest"):
        verify_manifest(ckpt)


def test_manifest_missing_or_invalid(ckpt):
    with pytest.raises(CheckpointError, match="missing") as ei:
        verify_manifest(ckpt)
    _one_line(ei.value)
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify_manifest(ckpt)
    (ckpt / MANIFEST_NAME).write_text(json.dumps({"version": 2, "files": []}))
    with pytest.raises(CheckpointError, match="not a version 1 manifest"):
        verify_manifest(ckpt)
    (ckpt / MANIFEST_NAME).write_text(json.dumps({"version": 1, "files": [{"path": "a"}]}))
    with pytest.raises(CheckpointError, match="not a version 1 manifest"):
        verify_manifest(ckpt)


# --------------------------------------------------------------------------- admission


def test_prove_verify():
    secret, nonce = new_secret(), b"nonce-123"
    assert len(secret) == 32 and secret != new_secret()
    proof = prove(secret, nonce, 3)
    assert len(proof) == 64 and int(proof, 16) >= 0
    assert verify(secret, nonce, 3, proof)
    assert not verify(new_secret(), nonce, 3, proof)
    assert not verify(secret, nonce, 4, proof)
    assert not verify(secret, b"nonce-124", 3, proof)
    assert not verify(secret, nonce, 3, proof.upper())
    assert not verify(secret, nonce, 3, "é" * 64)
    assert not verify(secret, nonce, -1, proof)
    assert prove(secret, b"1", 23) != prove(secret, b"12", 3)


# --------------------------------------------------------------------------- no code from data

SRC = Path(__file__).resolve().parents[1] / "src" / "allhands"

# Calls that unpickle what a peer sent (torch's *_object collectives pickle.loads every received
# buffer) or what a file holds. allhands exchanges fixed-size tensors only; pickle itself is used
# by checkpoint/safe.py's RestrictedUnpickler alone.
_PEER_UNPICKLERS = {"all_gather_object", "gather_object", "broadcast_object_list",
                    "scatter_object_list", "recv_object_list", "send_object_list"}
_PICKLE_CALLS = {"load", "loads", "Unpickler"}


def _calls(tree):
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                else ""
            yield node, owner, name


def _violations(path: Path) -> list[str]:
    import ast

    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node, owner, name in _calls(tree):
        where = f"{path.name}:{node.lineno}"
        kw = {k.arg: k.value for k in node.keywords}
        if name in _PEER_UNPICKLERS:
            out.append(f"{where} {name} unpickles peer data")
        if owner == "torch" and name == "load":
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                out.append(f"{where} torch.load without weights_only=True")
        if owner in ("pickle", "cPickle", "dill", "marshal") and name in _PICKLE_CALLS \
                and path.name != "safe.py":
            out.append(f"{where} {owner}.{name} outside checkpoint/safe.py")
        if owner in ("np", "numpy") and name == "load":
            ap = kw.get("allow_pickle")
            if isinstance(ap, ast.Constant) and ap.value is True:
                out.append(f"{where} numpy.load(allow_pickle=True)")
        if owner == "yaml" and name in ("load", "unsafe_load", "full_load"):
            out.append(f"{where} yaml.{name}")
    for node in ast.walk(tree):  # `from pickle import loads` would dodge the call check above
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "marshal") \
                and path.name != "safe.py":
            out.append(f"{path.name}:{node.lineno} imports from {node.module}")
    return out


def test_no_code_from_data_anywhere_in_allhands():
    # the benchmarks too: they run our workers on users' machines
    files = sorted([*SRC.rglob("*.py"), *(SRC.parents[1] / "bench").rglob("*.py")])
    assert len(files) > 10
    bad = [v for f in files for v in _violations(f)]
    assert not bad, bad


def test_the_guard_catches_what_it_looks_for(tmp_path):
    """The guard above must not pass vacuously: each forbidden pattern is found."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import pickle, torch, numpy as np, torch.distributed as dist\n"
        "from pickle import loads\n"
        "torch.load('a')\n"
        "torch.load('a', weights_only=False)\n"
        "torch.load('a', weights_only=True)\n"
        "pickle.loads(b'')\n"
        "np.load('a', allow_pickle=True)\n"
        "dist.all_gather_object([], 1)\n"
        "dist.broadcast_object_list([1])\n")
    got = _violations(probe)
    assert len(got) == 7, got
    assert sum("torch.load" in v for v in got) == 2 and any("imports from pickle" in v for v in got)


# --------------------------------------------------------------------------- resume, end to end


def _trained_run(token_dir: Path, run_dir: Path):
    """A real 2-step run of the reference GPT, in this process, with its step-2 checkpoint."""
    import allhands
    from allhands.checkpoint import committed

    from conftest import tiny_config

    cfg = tiny_config(token_dir, run_dir, "run.steps=2", "checkpoint.interval=2")
    allhands.train(cfg)
    (_, ckpt), = committed(run_dir / "checkpoints")
    return cfg, ckpt


def _resume_fails_in_one_line(cfg, run_dir: Path) -> str:
    import allhands

    with pytest.raises(CheckpointError) as ei:
        allhands.train(cfg, resume=str(run_dir))
    return _one_line(ei.value)


def _point_at_payload(ckpt: Path, md, index, canary: Path, payload: Path) -> None:
    """Append a torch.save'd payload to the item's shard, point the item at it in ``.metadata``
    and write a matching manifest (as whoever ships a crafted checkpoint would)."""
    shard = ckpt / md.storage_data[index].relative_path
    torch.save(Canary(canary), payload)
    md.storage_data[index].offset = shard.stat().st_size
    md.storage_data[index].length = payload.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.read_bytes())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    write_manifest(ckpt)


def test_resume_of_crafted_checkpoints_runs_no_payload(token_dir, tmp_path):
    """An attacker ships a checkpoint whose manifest matches (they wrote it), so only the
    restricted readers stand between the payload and our process."""
    run_dir, canary = tmp_path / "run", tmp_path / "canary"
    cfg, ckpt = _trained_run(token_dir, run_dir)
    genuine = (ckpt / ".metadata").read_bytes()

    # 1. A malicious .metadata.
    _craft_metadata(ckpt, canary)
    write_manifest(ckpt)
    msg = _resume_fails_in_one_line(cfg, run_dir)
    assert "refused to unpickle" in msg and ".metadata" in msg and not canary.exists()
    assert "refused (unsafe)" in msg
    with pytest.raises(CheckpointError) as ei:  # export reads the same .metadata
        export_weights(run_dir, tmp_path / "w.safetensors")
    assert _one_line(ei.value) == msg and not canary.exists()

    # 2. A genuine-looking .metadata whose bytes item (the scheduler's last_epoch, a pickled
    #    int) now points at a torch.save'd payload appended to the shard.
    md = pickle.loads(genuine)  # our own file: plain pickle is fine here
    index = next(i for i in md.storage_data if i.fqn == "scheduler.last_epoch")
    _point_at_payload(ckpt, md, index, canary, tmp_path / "payload.pt")
    msg = _resume_fails_in_one_line(cfg, run_dir)
    assert "'scheduler.last_epoch'" in msg and "crafted" in msg and not canary.exists()
    assert "refused (unsafe)" in msg

    # Control: torch's own reader runs this payload, so the refusal above was not vacuous.
    dcp.load({"scheduler": {"last_epoch": 0}}, checkpoint_id=ckpt, no_dist=True)
    assert canary.exists()


def test_a_crafted_tensor_item_is_refused_as_unsafe_on_resume_and_export(token_dir, tmp_path, cli_env):
    """A tensor item (read by torch itself, with weights_only=True) pointed at a payload: resume
    and ``allhands export`` each refuse it in one line naming the item, never as "damaged" and
    never with torch's advice to pass weights_only=False."""
    import subprocess

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from conftest import ALLHANDS, ROOT

    run_dir, canary = tmp_path / "run", tmp_path / "canary"
    cfg, ckpt = _trained_run(token_dir, run_dir)
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: plain pickle is fine
    index = next(i for i in md.storage_data if i.fqn.startswith("model.")
                 and isinstance(md.state_dict_metadata[i.fqn], TensorStorageMetadata))
    _point_at_payload(ckpt, md, index, canary, tmp_path / "payload.pt")
    msg = _resume_fails_in_one_line(cfg, run_dir)
    assert f"checkpoint item {index.fqn!r}" in msg and "refused (unsafe)" in msg, msg
    assert "damaged" not in msg and "weights_only=False" not in msg and not canary.exists()

    r = subprocess.run([*ALLHANDS, "export", str(run_dir), "--out", str(tmp_path / "w.safetensors")],
                       env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("allhands:")]
    assert len(lines) == 1 and "refused (unsafe)" in lines[0] and index.fqn in lines[0], r.stderr
    assert "weights_only=False" not in r.stderr and not canary.exists()
