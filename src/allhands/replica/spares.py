"""Replica mode's roster: which process holds each replica group's index, the spares waiting to
take one, and the failure notice that lets the survivors close a quorum without waiting.

Processes ("slots") are started by the replicas launcher (launch/replicas.py): ``fault.spares``
more than there are groups. Each process has an incarnation (a fresh token per process start) and
registers it with its pid. Keys, in the job's MAC'd store (authstore.py):

- ``life/G``: the incarnation that holds group G (quorum.py reads it as the group's incarnation);
  changed only by compare-and-set, so two processes never hold one group.
- ``procs`` (a counter) and ``proc/I``: every incarnation ever started, ``LIFE:PID``, so that the
  launcher's watcher finds each process to watch.
- ``dead/LIFE``: the watcher's notice that incarnation LIFE's process is gone. A survivor waiting
  for a group whose holder is dead closes the quorum at once instead of after
  ``fault.quorum_timeout_s`` (quorum.py).
- ``spare/LIFE``: a spare waiting (empty), or the group index it was handed; ``spares`` counts
  the spares that became ready, which the groups wait for before their first quorum. The watcher hands a
  dead holder's group to an idle spare before it posts the notice, so the survivors wait for the
  spare (which registers within a second) rather than close a quorum without it.

A process that starts finds a group to hold (its own slot's on the first start, otherwise any
group whose holder is dead) or becomes a spare; so a failed group's own restart becomes the new
spare when a spare took its place, and takes its group back when no spare was left (the
restart mode's replacement, as without spares).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch.distributed as dist


def is_dead(store: dist.Store, life: str) -> bool:
    return store.check([f"dead/{life}"])


def holder(store: dist.Store, group: int) -> str | None:
    """The incarnation that holds ``group`` now, None before its first holder started."""
    key = f"life/{group}"
    return store.get(key).decode() if store.check([key]) else None


def register(store: dist.Store, life: str, pid: int | None = None) -> None:
    """Make this process known to the launcher's watcher."""
    i = store.add("procs", 1) - 1
    store.set(f"proc/{i}", f"{life}:{pid or os.getpid()}")


def claim(store: dist.Store, life: str, slot: int, n_groups: int) -> int | None:
    """A starting process: the group it now holds, or None (it is a spare). Its own slot's group
    when nobody held it yet (the job's start), else a group whose holder is dead (its own first)."""
    if slot < n_groups and store.compare_set(f"life/{slot}", "", life) == life.encode():
        return slot
    for g in sorted(range(n_groups), key=lambda g: g != slot):
        old = holder(store, g)
        if old is not None and is_dead(store, old) and \
                store.compare_set(f"life/{g}", old, life) == life.encode():
            return g
    return None


def wait_as_spare(store: dist.Store, life: str, *, poll_s: float = 0.005,
                  stop: Callable[[], str | None] = lambda: None) -> tuple[int, bool] | str:
    """A spare: wait until the watcher hands this process a group: (its index, whether another
    group's holder was alive then, so that the state comes from a peer and not a checkpoint);
    or until ``stop`` says why to give up (the job is done or stopping: that reason)."""
    key = f"spare/{life}"
    store.set(key, "")
    store.add("spares", 1)  # ready: see wait_for_spares
    while True:
        got = store.get(key).decode()
        if got:
            group, live = got.split(":")
            return int(group), live == "live"
        why = stop()
        if why:
            return why
        time.sleep(poll_s)


def hand_over(store: dist.Store, group: int, dead_life: str, spares: list[str],
              peers_alive: bool = True) -> str | None:
    """Watcher: ``group``'s holder ``dead_life`` is gone. Hand the group to the first idle spare of
    ``spares`` (incarnations with live processes, oldest first), then post the failure notice;
    returns the spare that took it, or None (no spare: the group's own restart will claim it).
    ``peers_alive``: some other group's holder is alive, so the spare heals from it rather than
    loading the group's checkpoint first (when every group died, the checkpoints are the state)."""
    taker = None
    for life in spares:
        key = f"spare/{life}"
        if store.check([key]) and not store.get(key) and \
                store.compare_set(f"life/{group}", dead_life, life) == life.encode():
            store.set(key, f"{group}:{'live' if peers_alive else 'all-dead'}")
            taker = life
            break
    store.set(f"dead/{dead_life}", "1")
    return taker


def wait_for_spares(store: dist.Store, n: int, timeout_s: float) -> None:
    """At the job's start (no quorum yet), wait up to ``timeout_s`` until ``n`` spares are ready,
    so that a failure in the first steps finds one; later starts do not wait."""
    deadline = time.monotonic() + timeout_s
    while n and store.add("spares", 0) < n and not store.check(["epoch"]) and time.monotonic() < deadline:
        time.sleep(0.01)
