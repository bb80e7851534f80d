"""Replica mode's start-up in a worker process (``fault.mode = "replica"``): this world is one
replica group (its ``dp_shard`` ranks); it holds its group, claims a dead group's place or waits
as a spare (spares.py), then trains through the one loop with the quorum's hooks (heal.py)."""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from allhands.authstore import sealed
from allhands.checkpoint import committed
from allhands.config import Config, replica_group_config, validate
from allhands.env import ReplicaEnv, WorkerEnv, replica_env
from allhands.faults import FaultInjector
from allhands.lockstep import build_mesh, said_since
from allhands.mesh import Mesh
from allhands.paths import group_dir
from allhands.replica import spares
from allhands.replica.heal import ReplicaGroup
from allhands.replica.quorum import QuorumFinished, QuorumStopped, ReplicaQuorum, shared_token
from allhands.stopflag import CleanStop
from allhands.trainer import Job, Trainer


def run(cfg: Config, job: Job, env: WorkerEnv) -> dict[str, Any]:
    """One replica group's worker: its world is the group; the groups meet in the quorum."""
    rep = replica_env()
    assert rep is not None, "the replica launcher sets the group's environment"
    cfg = replica_group_config(cfg)
    if env.attempt:  # a restarted group may bring fewer workers: the batch must still divide
        validate(cfg, world_size=env.world_size, need_data=False)
    mesh = build_mesh(cfg, env)
    try:
        return run_group(cfg, job, mesh, rep, time.time())
    finally:
        mesh.destroy()


def run_group(cfg: Config, job: Job, mesh: Mesh, rep: ReplicaEnv, t: float) -> dict[str, Any]:
    """One replica-mode process: the group it holds (or, as a spare, is handed: replica/spares.py),
    its trainer, joined to the quorum of the groups."""
    run_dir = Path(cfg.run.dir)
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = sealed(dist.TCPStore(rep.host, rep.port, is_master=False, timeout=timeout), rep.secret,
                   f"replica store at {rep.host}:{rep.port}", tolerant=True)
    life = shared_token(mesh.cpu_group() if mesh.world_size > 1 else None)  # a group's ranks share it
    spares.register(store, life)  # every rank's process, for the launcher's failure notice
    if store.check(["done"]):  # a restart that came up after the others completed the job
        return _came_late(run_dir, rep.group, rep.groups, store, mesh.rank)
    if cfg.fault.spares:  # any group whose holder died, or wait as a spare (one process a group)
        group = spares.claim(store, life, rep.group, rep.groups)
    else:  # this slot's group: its own ranks (FSDP inside a group) or, across nodes, its node's
        group = rep.group
        if mesh.rank == 0:
            store.set(f"life/{group}", life)
    where = group_dir(run_dir, group if group is not None else rep.group)
    trainer = Trainer(cfg, job, mesh, where)  # a spare too: what a replacement must not wait for
    said_since(mesh.rank, "building the data, model and layout", t)
    if group is None:
        got = spares.wait_as_spare(store, life, stop=lambda: _why_not(store))
        if got == "done":
            return _came_late(run_dir, rep.group, rep.groups, store, mesh.rank)
        if isinstance(got, str):
            raise CleanStop(int(got), 0, None, run_dir)
        group, trainer.resume = got[0], not got[1]  # live peers: heal from them, load nothing
        trainer.move_to(group_dir(run_dir, group))
        print(f"allhands: replica group {group}: spare pid {os.getpid()} takes its place",
              file=sys.stderr, flush=True)
    else:
        spares.wait_for_spares(store, cfg.fault.spares, cfg.parallel.timeout_s)
    # faults name a rank as in the whole job's mesh (group G's local rank L is G * dp_shard + L;
    # G itself with one rank per group) and fire once per job
    # A group with no live peer resumes from the newest step any group committed, not only its own
    trainer.resume_also = [group_dir(run_dir, g) / "checkpoints" for g in range(rep.groups) if g != group]
    trainer.faults = FaultInjector(cfg.fault.inject, group * mesh.world_size + mesh.rank, run_dir)
    quorum = ReplicaQuorum(store, group, rep.groups, timeout_s=cfg.fault.quorum_timeout_s,
                           dead_s=cfg.parallel.timeout_s, pg_timeout_s=cfg.parallel.timeout_s,
                           min_groups=cfg.fault.min_groups, local_group=mesh.cpu_group(),
                           secret=rep.secret, address=rep.address, life=life)
    replica = ReplicaGroup(quorum, trainer)  # the trainer's hooks from here on
    try:
        result = trainer.fit()
    except QuorumFinished:  # the others completed the job while this group was joining
        return _came_late(run_dir, group, rep.groups, store, mesh.rank)
    except QuorumStopped as e:  # stopped while waiting: its last checkpoint is what it has
        raise CleanStop(e.signum, trainer.train_state.step, None, run_dir) from None
    replica.finish(trainer.train_state.step)
    return result


def _why_not(store) -> str | None:
    """Why a waiting spare gives up: the job is done, or the signal number of a stop."""
    if store.check(["done"]):
        return "done"
    return store.get("stop").decode() if store.check(["stop"]) else None


def _came_late(run_dir: Path, group: int, groups: int, store, rank: int) -> dict[str, Any]:
    """A group (a restart or a spare) that came back after the others completed the job trains
    nothing and writes nothing of its own: it takes the final checkpoint of a group that
    finished (catch_up), so that no group's directory ends at a stale step, and says so."""
    step = int(store.get("done").decode() or 0)
    if rank == 0:
        got = catch_up(run_dir, group, groups)
        where = f"took group {got[0]}'s final checkpoint, step {got[1]}" if got else "nothing newer to take"
        print(f"allhands: replica group {group}: came back after the job completed at step {step}; "
              f"{where}", file=sys.stderr, flush=True)
    return {}


def catch_up(run_dir: Path, group: int, groups: int) -> tuple[int, int] | None:
    """Copy the newest checkpoint any other group committed into ``group``'s checkpoints when it
    is newer than the group's own (hard links where the file system allows: checkpoints are never
    written in place); committed by one rename, so a reader never sees half of it. Returns (the
    group it came from, its step), or None when the group's own is as new."""
    mine = group_dir(run_dir, group) / "checkpoints"
    own = committed(mine)
    best = max(((c[-1][0], g, c[-1][1]) for g in range(groups) if g != group
                and (c := committed(group_dir(run_dir, g) / "checkpoints"))), default=None)
    if best is None or (own and own[-1][0] >= best[0]):
        return None
    step, source, path = best
    tmp = mine / f".tmp-late-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp, copy_function=_link_or_copy)
    os.replace(tmp, mine / path.name)
    return source, step


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
