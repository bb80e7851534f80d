"""How one rank writes its part of a checkpoint: DCP's file writer with allhands' additions and
DCP's save planner with its plan cache.

Split from checkpoint.py (which owns the state contract and the commit protocol); every figure
quoted here is from ``bench/checkpoint_profile.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.futures import Future

from allhands.checkpoint.manifest import file_digest

# Niceness of an async save's writer thread. DCP's serialisation is ~60 ms of CPU per rank per
# 38 MiB save here (mostly per-item torch.save overhead); at nice 0 it takes that from the
# training ranks when there are no spare cores. At 19 the scheduler gives it ~1.5% of a
# contended core, so it fills idle time (collective waits) and training keeps the CPU.
WRITER_NICE = 19


# torch.save's zip records each carry a CRC-32, which torch.load never checks (torch 2.13: a
# tensor file with a flipped byte loads silently, wrong). allhands' check is the manifest's
# SHA-256 of every file, verified before any load, so in the checkpoint writer the CRC is pure
# cost: ~0.35 ms per MiB, ~7 ms per rank per save of the bench state. torch reads the switch
# from one process-wide config, so allhands wraps the function torch.save asks and answers
# False only in a thread that is writing a checkpoint; every other torch.save is unchanged.
IN_WRITER = threading.local()


def _install_crc32_switch() -> None:
    torch_get = getattr(torch.serialization, "get_crc32_options", None)
    if torch_get is None or getattr(torch_get, "allhands_switch", False):
        return  # another torch (the CRC stays on), or installed already

    def get_crc32_options() -> bool:
        return False if getattr(IN_WRITER, "active", False) else torch_get()

    get_crc32_options.allhands_switch = True  # type: ignore[attr-defined]
    get_crc32_options.__doc__ = torch_get.__doc__
    torch.serialization.get_crc32_options = get_crc32_options


_install_crc32_switch()


@dataclass
class FileDigests:
    """Sizes and SHA-256 of the files one rank wrote, sent to the coordinator with that rank's
    write results (DCP gathers them before it writes ``.metadata``); rank 0's commit puts them
    into the manifest instead of re-hashing every rank's files itself."""

    files: dict[str, tuple[int, str]]


class Writer(FileSystemWriter):
    """DCP's file writer (fsyncs every file) that also hashes the files this rank wrote, right
    after writing them (from the page cache, in this rank's writer thread), and hands the
    digests to the coordinator (``digests`` after ``finish``). Optional hook run after this
    rank's files are written: the ``ckpt`` fault kills the worker there, i.e. mid-checkpoint.

    ``background``: this writer runs in the async save's write thread (saver.py), which it
    moves to ``WRITER_NICE`` first. Linux applies niceness per thread, so the training thread
    and the copy's thread keep their priority."""

    def __init__(self, path: Path, after_write: Callable[[], None] | None = None, background: bool = False):
        super().__init__(path, sync_files=True)
        self._after_write = after_write
        self._background = background
        self.digests: dict[str, tuple[int, str]] | None = None

    def reset(self, checkpoint_id=None) -> None:
        if self._background and threading.current_thread() is not threading.main_thread():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
                pass
        super().reset(checkpoint_id)

    def write_data(self, plan, planner):
        IN_WRITER.active = True
        try:
            fut = super().write_data(plan, planner)
            fut.wait()  # FileSystemWriter writes before it returns; this only re-raises
        finally:
            IN_WRITER.active = False
        results = fut.value()
        names = sorted({r.storage_data.relative_path for r in results})
        digests = FileDigests({n: file_digest(Path(self.path) / n) for n in names})
        if self._after_write is not None:
            self._after_write()
        out: Future = Future()
        out.set_result([*results, digests])
        return out

    def finish(self, metadata, results) -> None:
        """Coordinator: split every rank's digests from its write results, then DCP's finish."""
        self.digests, plain = {}, []
        for rank_results in results:
            plain.append([r for r in rank_results if not isinstance(r, FileDigests)])
            for r in rank_results:
                if isinstance(r, FileDigests):
                    self.digests.update(r.files)
        super().finish(metadata, plain)


def save_planner(key: str) -> DefaultSavePlanner:
    """DCP's planner with its plan cache on, keyed by one Checkpointer.

    Without it every save repeats the whole global planning in the writer thread: each rank
    pickles its local plan (one WriteItem per tensor, ~260 for the bench state) for a gather to
    rank 0, which dedups, builds the metadata and pickles a plan per rank back (~65 ms of rank
    0's CPU per save, BENCHMARKS.md). The state's keys, shapes and owners do not change between
    saves, so from the second save on each rank compares its new plan with its cached one and
    sends an empty one, and rank 0 reuses its cached global plan and metadata (DCP recomputes the
    storage part of the metadata from every save's write results). A rank whose plan changed
    (a new key or shape) sends it and rank 0 replans. DCP keys the cache by a string in a
    class-level dict; one key per Checkpointer keeps two checkpointers of one process (e.g. a
    model and an eval state) from sharing plans."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key
    return planner
