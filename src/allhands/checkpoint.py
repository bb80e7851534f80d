"""The one checkpoint contract: a dict of ``Stateful`` objects under fixed keys, saved with torch
Distributed Checkpoint (DCP) into ``RUN_DIR/checkpoints/step-NNNNNNNN``.

Keys: ``model`` (model + optimizer via ``get_state_dict``), ``scheduler``, ``train`` (step and the
data cursor), ``rng`` (per-rank generators), ``sync`` (strategy state). The checkpointer knows
nothing else about them.

Commit protocol: DCP writes into ``.tmp-step-N``; after every rank has returned from ``dcp.save``
(which writes ``.metadata`` last) rank 0 writes ``manifest.json`` (size and SHA-256 of every
file, verified before any load), fsyncs the files and renames the directory to
``step-N``. A directory without the ``.tmp-`` prefix is therefore complete; a crash mid-save
leaves only a ``.tmp-`` directory that resume ignores and the next save removes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from allhands.errors import CheckpointError, first_line
from allhands.security import SafeFileSystemReader, checkpoint_error_from, verify_manifest, write_manifest

_STEP_DIR = re.compile(r"^step-(\d{8})$")


class ModelOptimState(Stateful):
    """Model and optimizer through DCP's state_dict helpers (they strip DDP's ``module.``,
    activation checkpointing's wrapper names, and gather nothing: FSDP/TP shards stay DTensors
    that DCP reshards on load).

    Optimizer keys are flat (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): one entry per
    parameter, whichever rank holds it, so a ZeRO-1 rank that owns only some parameters writes
    exactly its entries and every layout reads every other's checkpoint.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 aliases: dict[str, str] | None = None):
        # ``model`` may be the list of this rank's pipeline stages (interleaved schedules), with
        # ``optimizer.optimizers`` one optimizer per stage: the helpers map parameters to FQNs
        # one module at a time. Flat keys make the stages' entries disjoint.
        # ``aliases``: optimizer-state names of tied copies, {local FQN: the unsplit model's FQN}
        # (the last pipeline stage's ``lm_head.weight`` is ``tok_emb.weight`` in one module,
        # which keys a shared parameter's state by its first name).
        self.model, self.optimizer = model, optimizer
        self.aliases = aliases or {}

    def _parts(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
        if isinstance(self.model, list):
            return list(zip(self.model, self.optimizer.optimizers))
        return [(self.model, self.optimizer)]

    def state_dict(self) -> dict[str, Any]:
        msd: dict[str, Any] = {}
        osd: dict[str, Any] = {}
        for model, optim in self._parts():
            m, o = get_state_dict(model, optim, options=self.OPTIONS)
            msd.update(m)
            osd.update(_rename_optim_keys(o, self.aliases))
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = self._parts()
        back = {v: k for k, v in self.aliases.items()}
        for model, optim in parts:
            msd, osd = state["model"], _rename_optim_keys(state["optim"], back)
            if len(parts) > 1:  # each stage takes its own keys (strict loading stays on)
                mine = set(get_state_dict(model, optim, options=self.OPTIONS)[0])
                msd = {k: v for k, v in msd.items() if k in mine}
                osd = {k: v for k, v in osd.items() if k.split(".", 1)[1].rsplit(".", 1)[0] in mine}
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=self.OPTIONS)


def _rename_optim_keys(osd: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state.<fqn>.<leaf>`` / ``param_groups.<fqn>.<leaf>`` with ``fqn`` renamed by ``names``."""
    if not names:
        return osd
    out = {}
    for key, value in osd.items():
        kind, rest = key.split(".", 1)
        fqn, leaf = rest.rsplit(".", 1)
        out[f"{kind}.{names.get(fqn, fqn)}.{leaf}"] = value
    return out


class TrainState(Stateful):
    """Completed steps and the data cursor (a step count is the whole cursor: see sampler.py)."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0
        self.nonfinite_skips = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.samples),
                "nonfinite_skips": torch.tensor(self.nonfinite_skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples = int(state["samples"])
        self.nonfinite_skips = int(state["nonfinite_skips"])


class RNGState(Stateful):
    """Python, NumPy, torch CPU (and CUDA) generators of this rank, stored as tensors only.

    Each rank saves under its own key ``rank<R>`` so DCP does not deduplicate them as
    replicated; no pickled object is needed to restore them.
    """

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        version, py_state, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": torch.tensor(py_state, dtype=torch.int64),
            "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
            "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
            "numpy_rest": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state[self.key]
        torch.set_rng_state(s["torch"])
        has_gauss, gauss = s["python_gauss"].tolist()
        random.setstate((3, tuple(int(v) for v in s["python"].tolist()), gauss if has_gauss else None))
        pos, np_has_gauss, np_gauss = s["numpy_rest"].tolist()
        np.random.set_state(("MT19937", s["numpy_keys"].numpy().astype(np.uint32), int(pos),
                             int(np_has_gauss), float(np_gauss)))
        if "cuda" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state(s["cuda"])


def seed_rank(seed: int, rank: int) -> None:
    """Per-rank generators for dropout and user code: distinct per rank, reproducible per job."""
    s = seed * 7919 + 1 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def committed(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / ".metadata").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, ckpt_dir: str | os.PathLike, *, rank: int, keep_last: int = 2):
        self.dir = Path(ckpt_dir)
        self.rank = rank
        self.keep_last = keep_last

    def latest(self) -> tuple[int, Path] | None:
        found = committed(self.dir)
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Stateful]) -> Path:
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".tmp-step-{step:08d}"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        try:
            dcp.save(state, checkpoint_id=tmp)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"saving checkpoint step {step} to {str(tmp)!r} failed "
                                  f"({first_line(e)}); check free space and permissions of "
                                  f"{str(self.dir)!r}; earlier checkpoints are untouched") from e
        _barrier()
        if self.rank == 0:
            write_manifest(tmp)  # sizes and SHA-256 of every file, checked on resume
            _fsync_tree(tmp)
            if final.exists():  # re-saving the same step after a restart
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            for _, old in committed(self.dir)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        """Verify the manifest, then load through the reader that never unpickles code."""
        verify_manifest(path)
        reader = SafeFileSystemReader(path)
        try:
            dcp.load(state, storage_reader=reader)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            refused = checkpoint_error_from(e, reader)
            if refused is not None:
                raise refused from e
            raise CheckpointError(f"loading checkpoint {str(path)!r} failed ({first_line(e)}); "
                                  f"it may be from another model or config, or damaged") from e

    def saved_keys(self, path: Path) -> set[str]:
        """Flattened state keys present in a committed checkpoint."""
        return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module) -> torch.nn.Module:
    """Load the model weights of a committed checkpoint into a plain single-device module
    (no process group needed), e.g. for evaluation or tests."""
    sd = model.state_dict()
    dcp.load({"model": {"model": sd}}, storage_reader=SafeFileSystemReader(Path(path)),
             no_dist=not dist.is_initialized())
    model.load_state_dict(sd)
    return model
