"""The one checkpoint contract: a dict of ``Stateful`` objects under fixed keys, saved with torch
Distributed Checkpoint (DCP) into ``RUN_DIR/checkpoints/step-NNNNNNNN``.

Keys: ``model`` (model + optimizer via ``get_state_dict``), ``scheduler``, ``train`` (step and the
data cursor), ``rng`` (per-rank generators), ``sync`` (strategy state). The checkpointer knows
nothing else about them.

Commit protocol: DCP writes into ``.tmp-step-N`` (``.metadata`` last, after gathering every
rank's write result); then rank 0 writes ``allhands.json`` (format version, step, resolved
config), ``manifest.json`` (size and SHA-256 of every file, verified before any load), fsyncs
the files and renames the directory to ``step-N``. A directory without the ``.tmp-`` prefix is
therefore complete; a crash mid-save leaves only a ``.tmp-`` directory that resume ignores and a
later save removes. Saves are asynchronous by default (see ``Checkpointer``); resume falls back
past a damaged checkpoint to the previous committed one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from allhands import collective
from allhands.checkpoint.catalog import FORMAT_VERSION, META_NAME, committed
from allhands.checkpoint.manifest import verify_manifest, write_manifest
from allhands.checkpoint.safe import SafeFileSystemReader, checkpoint_error_from
from allhands.checkpoint.saver import Pending, Saver, stage_after_compute
from allhands.checkpoint.writer import Writer, save_planner
from allhands.errors import CheckpointError, first_line
from allhands.safefs import write_private


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Saves and loads the state dict of ``Stateful`` objects under the commit protocol above.

    ``mode="async"``: ``save`` takes the state dicts and returns; DCP's stager copies the model
    and optimizer state to host memory in a thread while training goes on, and ``before_update``
    (called before the optimizer step) waits for that copy. ``dcp.save`` runs in a write thread
    of its own (saver.py) whose collectives run on ``group`` (a gloo group of its own, so they
    never interleave with the training collectives on the default group); rank 0 commits
    (manifest, fsync, rename, keep_last) in that thread after DCP returned, i.e. only after every
    rank's write and the ``.metadata`` succeeded. At most one save is in flight: the next
    ``save``, ``wait`` or the end of training waits for it.

    A failed save (disk full, unwritable directory: DCP raises ``CheckpointException``, a
    ``BaseException``) never raises here: it is counted in ``failures``, its temporary directory
    is removed, a one-line warning is queued in ``warnings``, and the previous checkpoint and the
    training state are untouched. The caller decides whether that is fatal (the trainer: only
    for the final save).
    """

    def __init__(self, ckpt_dir: str | os.PathLike, *, rank: int, keep_last: int = 2,
                 mode: str = "sync", group: dist.ProcessGroup | None = None,
                 meta: dict[str, Any] | None = None,
                 writer_hook: Callable[[int], Callable[[], None] | None] | None = None):
        self.dir = Path(ckpt_dir)
        self.rank = rank
        self.keep_last = keep_last
        self.mode = mode
        self.group = group
        self.meta = meta or {}
        self.writer_hook = writer_hook
        self.failures = 0
        self.warnings: list[str] = []
        self._pending: Pending | None = None
        self._stager: Any = None
        self._copier: Any = None
        self._saver: Saver | None = None
        self._prepared = False
        self._plan_key = f"allhands.Checkpointer {id(self)} {self.dir} {mode}"

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being copied, written or committed in the background."""
        return self._pending is not None

    def latest(self) -> tuple[int, Path] | None:
        found = committed(self.dir)
        return found[-1] if found else None

    # -- saving
    def save(self, step: int, state: dict[str, Stateful]) -> None:
        """Collective. Sync mode: returns after the commit. Async mode: after staging.

        The first save of a process (every save in sync mode) waits for all ranks while rank 0
        removes the ``.tmp-`` directories of saves a crash interrupted. Later async saves have
        no collective in the training thread, so a rank's stall is taking the state dicts (plus
        the wait for its previous save, if that is still writing, and whatever of the copy to
        host memory is left at ``before_update``); rank 0's commit
        removes stale ``.tmp-`` directories from then on.
        """
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".tmp-step-{step:08d}"
        if self.mode == "sync" or not self._prepared:
            self.wait()
            error: BaseException | None = None
            if self.rank == 0:
                try:
                    self.dir.mkdir(parents=True, exist_ok=True)
                    for stale in self.dir.glob(".tmp-step-*"):  # a crash mid-save; never committed
                        shutil.rmtree(stale, ignore_errors=True)
                except OSError as e:
                    error = e
            if not _agree(error is None):  # also the barrier: nobody writes before the cleanup
                self._failed(step, tmp, error or RuntimeError("rank 0 could not prepare the directory"))
                return
            self._prepared = True
        else:
            self._wait_here()
        hook = self.writer_hook(step) if self.writer_hook else None
        writer = Writer(tmp, hook, background=self.mode != "sync")
        try:
            if self.mode == "sync":
                dcp.save(state, storage_writer=writer, planner=save_planner(self._plan_key))
                _barrier()
                if self.rank == 0:
                    self._commit(step, tmp, final, writer.digests)
                _barrier()
                return
            snapshot = self._snapshot(state)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self._failed(step, tmp, e)
            return
        pending = Pending(step, tmp, final, writer)
        self._pending = pending
        self._saver_once().submit(pending, save_planner(self._plan_key))
        # Last: the copy's thread takes the GIL once woken, so nothing of this call is left to
        # wait behind it; the copy overlaps the next forward/backward.
        try:
            stage_after_compute(self._stager)
            self._stager.stage(snapshot).add_done_callback(lambda f, c=pending.copy: _chain(f, c))
        except BaseException as e:  # the write thread fails the save with it
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            pending.copy.set_exception(e)

    def _saver_once(self) -> Saver:
        if self._saver is None:
            commit = (lambda p: self._commit(p.step, p.tmp, p.final, p.writer.digests)) if self.rank == 0 else None
            self._saver = Saver(self.group, commit)
        return self._saver

    def _stager_once(self):
        """One stager for the whole run: it keeps its host buffers (pinned on CUDA) between saves.

        It copies in a thread of its own (torchtitan's "zero-overhead" pattern): the copy of the
        model and optimizer state overlaps the next forward/backward, and ``before_update``
        waits for it before the optimizer may change them. The one-in-flight rule (``save``
        waits for the previous save first) keeps a save from restaging into buffers the
        previous one is still writing. On an accelerator it copies on a stream of its own, which
        ``save`` orders after the compute stream (saver.py ``stage_after_compute``)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True,
                                                        use_non_blocking_copy=cuda))
            self._copier = DefaultStager(StagingOptions(False, False, False, False))
        return self._stager

    def _snapshot(self, state: dict[str, Any]) -> dict[str, Any]:
        """Each object's state dict, taken now on the training thread. Objects that say their
        tensors change only in the optimizer step (``overlap_until_update``) stay references
        for the background copy; those whose state dict is built anew (``fresh``: step, data
        cursor, RNG, scheduler) are kept as they are; the others (a sync strategy whose state
        its backward hooks update) are copied here: they are small."""
        self._stager_once()
        out = {}
        for key, obj in state.items():
            sd = obj.state_dict() if isinstance(obj, Stateful) else obj
            keep = getattr(obj, "overlap_until_update", False) or getattr(obj, "fresh", False)
            out[key] = sd if keep else self._copier.stage(sd)
        return out

    def before_update(self) -> None:
        """Not collective. Call before anything changes the parameters or optimizer state
        (the trainer: before ``optimizer.step()``): waits until the save in flight has copied
        them to host memory. A no-op when no copy is running."""
        p = self._pending
        if p is not None and not p.copy.done():
            try:
                p.copy.result()
            except BaseException as e:  # surfaces again through the write, as a failed save
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise

    def _commit(self, step: int, tmp: Path, final: Path,
                digests: dict[str, tuple[int, str]] | None = None) -> None:
        write_private(tmp / META_NAME, json.dumps({"format": FORMAT_VERSION, "step": step, **self.meta},
                                                  indent=1) + "\n")
        # DCP fsynced its data files and .metadata (sync_files=True); write_manifest fsyncs the
        # manifest and the directory, so only allhands.json is left.
        _fsync_file(tmp / META_NAME)
        # Sizes and SHA-256 of every file, checked on resume; each rank hashed its own data files
        # in its writer (``digests``), so only .metadata and allhands.json are hashed here.
        write_manifest(tmp, digests)
        if final.exists():  # re-saving the same step after a restart
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        # Older .tmp- directories are dead saves; a newer one may be another rank already
        # writing the next save, so only older steps go.
        for stale in self.dir.glob(".tmp-step-*"):
            if stale.name[len(".tmp-step-"):].isdigit() and int(stale.name[len(".tmp-step-"):]) < step:
                shutil.rmtree(stale, ignore_errors=True)
        # Older ones go only now that a newer one is committed.
        for _, old in committed(self.dir)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def poll(self) -> None:
        """Non-blocking, not collective: settle a finished background save on this rank."""
        p = self._pending
        if p is not None and p.future.done() and (self.rank != 0 or p.committed.is_set()):
            self._settle(p)

    def wait(self) -> None:
        """Collective: block until the save in flight is written and committed on every rank."""
        self._wait_here()
        _barrier()  # every rank: whether or not poll() already settled it here

    def _wait_here(self) -> None:
        """Not collective: this rank's save in flight is written (and, on rank 0, committed)."""
        self.before_update()
        p = self._pending
        if p is not None:
            try:
                p.future.result()
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
            if self.rank == 0:
                p.committed.wait()
            self._settle(p)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Not collective, for a rank on its way out with an error: give the save in flight up
        to ``timeout_s`` to commit, so a failure two steps after a save does not lose it. The
        writer thread's collectives run on their own group, so they complete even while the
        other ranks' training threads are blocked on this one. Other ranks cannot see rank 0's
        commit except as the renamed directory, so they watch for it."""
        p = self._pending
        if p is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            p.future.result(timeout=timeout_s)
        except BaseException:
            return
        if self.rank == 0:
            p.committed.wait(max(0.0, deadline - time.monotonic()))
            return
        while not p.final.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _settle(self, p: Pending) -> None:
        self._pending = None
        err = p.error if self.rank == 0 else p.future.exception()
        if err is not None:
            self._failed(p.step, p.tmp, err)

    def _failed(self, step: int, tmp: Path, e: BaseException) -> None:
        self.failures += 1
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial file would keep a full disk full
        self.warnings.append(f"checkpoint step {step} was not saved ({_cause(e)}); check free space "
                             f"and permissions of {str(self.dir)!r}; the last committed checkpoint "
                             f"and the training state are intact")

    def close(self) -> None:
        self.before_update()
        if self._saver is not None:  # its thread ends after the save in flight, if any
            self._saver.close()
            self._saver = None
        if self._stager is not None:
            self._stager.close()
            self._copier.close()
            self._stager = self._copier = None

    # -- loading
    def load(self, path: Path, state: dict[str, Stateful], verify: bool = True) -> None:
        """Verify the manifest, then load through the reader that never unpickles code."""
        if verify:
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

    def load_latest(self, state_for: Callable[[int, Path], dict[str, Stateful]],
                    warn: Callable[[str], None], also: Iterable[Path] = ()) -> tuple[int, Path] | None:
        """Load the newest committed checkpoint that verifies; a damaged one is named in one
        line and the previous one is tried. Raises the newest one's error if none loads.
        Every rank reads the same files, so every rank settles on the same checkpoint.
        ``also``: more checkpoint directories whose commits count as this job's (replica groups,
        which hold the same state: a group may resume from the newest step any group committed);
        at the same step this directory's own comes first."""
        first_error: CheckpointError | None = None
        mine = [(step, 1, path) for step, path in committed(self.dir)]
        theirs = [(step, 0, path) for d in also if Path(d) != self.dir for step, path in committed(Path(d))]
        for step, _, path in sorted(mine + theirs, reverse=True):
            try:
                verify_manifest(path)
                self.load(path, state_for(step, path), verify=False)
                return step, path
            except CheckpointError as e:
                first_error = first_error or e
                warn(f"allhands: warning: {e}; falling back to the previous checkpoint")
        if first_error is not None:
            raise first_error
        return None

    def saved_keys(self, path: Path) -> set[str]:
        """Flattened state keys present in a committed checkpoint."""
        return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def _cause(e: BaseException) -> str:
    """One line for a failed save: DCP wraps the OSError of a full or read-only disk."""
    for wrapped in (getattr(e, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            return _cause(inner)
    cause = e.__cause__ or e.__context__
    if not isinstance(e, OSError) and cause is not None:
        return _cause(cause)
    return first_line(e)


def _chain(done: Any, into: Any) -> None:
    """The stager's future's outcome into the save's own ``copy`` future."""
    if done.exception() is not None:
        into.set_exception(done.exception())
    else:
        into.set_result(done.result())


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (one all_reduce; also a barrier)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=collective.device())
    collective.all_reduce(flag, op=collective.MAX, call="checkpoint agreement")
    return int(flag.item()) == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
