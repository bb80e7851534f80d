"""An async save's two background threads, started once per Checkpointer and kept for the run:
DCP's ``DefaultStager`` thread copies the state to host memory (pinned on CUDA), and one write
thread serialises, hashes and writes it with ``dcp.save`` on the checkpoint group, then (rank 0)
commits. The training thread only takes the state dicts and hands them over.

Why not ``dcp.async_save``: on the training thread it starts a fresh upload thread per save
(``ThreadPoolExecutor(max_workers=1)``) and converts the state again; with the copy's hand-off
that was 1-10 ms of a 38 MiB save's stall here, 1/9 of a blocking save (BENCHMARKS.md). The
threads below start once, so a save's stall is taking the state dicts and two queue puts.
Niceness: the copy runs at the training thread's priority (the next optimizer step waits for
it); the write thread is moved to ``WRITER_NICE`` by ``Writer.reset``. On an accelerator the copy
runs on the stager's own stream, ordered after the compute stream by :func:`stage_after_compute`.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from allhands.checkpoint.writer import Writer


def stage_after_compute(stager: Any) -> None:
    """Queue, on the stager's copy stream, a wait for the work queued so far on the compute
    stream; call it on the training thread right before handing the state to ``stager``.

    DCP's ``DefaultStager`` copies device tensors to host memory on a stream of its own (torch
    2.13 ``checkpoint/staging.py``, ``_staging_stream``) and does not wait for the kernels the
    training thread queued before: the optimizer step whose parameters are saved may still be
    running, and the copy would read them half-updated (a torn checkpoint that only a host sync,
    such as a logged loss, happened to prevent). ``wait_stream`` records an event on the compute
    stream and makes the copy stream wait for it on the device, so the host does not block; the
    stager's thread queues its copies after that wait. Without a stream (CPU, or no accelerator)
    the copies are host copies made in program order: nothing to do."""
    stream = getattr(stager, "_staging_stream", None)
    if stream is not None:
        stream.wait_stream(torch.accelerator.current_stream(stream.device))
    elif not hasattr(stager, "_staging_stream") and torch.accelerator.is_available():
        torch.accelerator.synchronize()  # a torch whose stager keeps its stream elsewhere: block


@dataclass
class Pending:
    """The one save in flight: the copy to host memory (``copy``), the write (``future``: done
    when this rank's DCP save returned) and, on rank 0, whether its commit has run."""

    step: int
    tmp: Path
    final: Path
    writer: Writer
    copy: Future = field(default_factory=Future)
    future: Future = field(default_factory=Future)
    committed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Saver:
    """The write thread: for each submitted save, wait for its copy, ``dcp.save`` it, commit.

    ``commit`` (rank 0 only, else None) runs after DCP returned, i.e. after every rank's files
    and ``.metadata`` are written (DCP gathers every rank's write result before the coordinator
    writes ``.metadata``). Any failure is recorded on the save (``error``, the futures), never
    raised here: the training thread settles it."""

    def __init__(self, group: dist.ProcessGroup | None, commit: Callable[[Pending], None] | None):
        self._group = group
        self._commit = commit
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Daemon: a worker that exits mid-write leaves a .tmp- directory, never a commit.
        self._thread = threading.Thread(target=self._run, name="allhands-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, p: Pending, planner: Any) -> None:
        self._jobs.put((p, planner))

    def close(self) -> None:
        """Not blocking: the thread ends once the save in flight (if any) is done. Each save's
        tensors are freed in ``_write``'s frame, so the thread's own exit frees none: one still
        freeing tensors when the interpreter finalizes is killed inside torch's deallocation
        (``terminate called without an active exception``, exit -6)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._write(*job)
            del job  # the staged tensors are freed in _write's frame, not at the thread's exit

    def _write(self, p: Pending, planner: Any) -> None:
        try:
            staged = p.copy.result()
            dcp.save(staged, storage_writer=p.writer, planner=planner, process_group=self._group)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            p.error = e
            p.future.set_exception(e)
            p.committed.set()
            return
        p.future.set_result(None)
        if self._commit is not None:
            try:
                self._commit(p)
            except BaseException as e:
                p.error = e
        p.committed.set()
