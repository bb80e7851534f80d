"""Replica mode's start-up in a worker process (``fault.mode = "replica"``): this world is one
replica group (its ``dp_shard`` ranks); it holds its group, claims a dead group's place or waits
as a spare (spares.py), then trains through the one loop with the quorum's hooks (heal.py)."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from allhands.authstore import sealed
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
        return {}
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
            return {}
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
    trainer.faults = FaultInjector(cfg.fault.inject, group * mesh.world_size + mesh.rank, run_dir)
    quorum = ReplicaQuorum(store, group, rep.groups, timeout_s=cfg.fault.quorum_timeout_s,
                           dead_s=cfg.parallel.timeout_s, pg_timeout_s=cfg.parallel.timeout_s,
                           min_groups=cfg.fault.min_groups, local_group=mesh.cpu_group(),
                           secret=rep.secret, address=rep.address, life=life)
    replica = ReplicaGroup(quorum, trainer)  # the trainer's hooks from here on
    try:
        result = trainer.fit()
    except QuorumFinished:  # the others completed the job while this group was joining
        return {}
    except QuorumStopped as e:  # stopped while waiting: its last checkpoint is what it has
        raise CleanStop(e.signum, trainer.train_state.step, None, run_dir) from None
    replica.finish(trainer.train_state.step)
    return result


def _why_not(store) -> str | None:
    """Why a waiting spare gives up: the job is done, or the signal number of a stop."""
    if store.check(["done"]):
        return "done"
    return store.get("stop").decode() if store.check(["stop"]) else None
