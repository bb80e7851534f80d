"""Replica mode's launcher (``fault.mode = "replica"``): one torch elastic world per replica
group, each in a process of its own that runs the single-node launcher with one worker and
restarts only that group (one worker, or the dp_shard workers of an FSDP group), plus the store where the groups meet every step (sync/quorum.py).

This is the shape torchft gives a job (one ``torchrun`` per replica group, github.com/pytorch/torchft):
a failed group is restarted by its own supervisor while the others carry on, and it heals from a
live peer (checkpoint/heal.py) instead of everyone restarting from a checkpoint. When every group
failed at once, each restarts from its own last checkpoint and the quorum forms again among
them: the restart mode's recovery, kept as the fallback.

The store is a TCPStore on loopback hosted here; every value the workers write to it is MAC'd
under a secret made for this job (authstore.py), handed to the groups in their environment.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from allhands.checkpoint.heal import group_dir
from allhands.config import Config
from allhands.env import REPLICA_ENV, REPLICA_SECRET_ENV
from allhands.errors import LaunchError
from allhands.launch.replica_nodes import run_replica_nodes


def run_replicas(cfg: Config, nproc: int, multi_node: bool, job: Any, *, launch: Callable,
                 entry: Callable, group_spec: Any, policy: Any) -> None:
    """Run ``nproc`` replica groups of ``group_spec.nproc`` workers each until they complete; LaunchError when
    every group failed for good (each one's restarts used up)."""
    if multi_node:  # every node's groups meet in one quorum store on node 0
        return run_replica_nodes(cfg, nproc, job, launch=launch, entry=entry, group_spec=group_spec,
                                 policy=policy)
    run_dir = Path(cfg.run.dir)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.parallel.timeout_s))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_group_main, name=f"allhands-replica-{g}",
                         args=(cfg.to_dict(), job, g, nproc, store.port, launch, entry, group_spec,
                               policy)) for g in range(nproc)]
    start_with_secret(procs)
    print(f"allhands: replica mode: {nproc} replica groups of {group_spec.nproc} worker(s), quorum store on "
          f"127.0.0.1:{store.port}; run directory {run_dir}", file=sys.stderr, flush=True)
    for p in procs:
        p.join()
    failed = [g for g, p in enumerate(procs) if p.exitcode != 0]
    if len(failed) == len(procs):
        raise LaunchError(f"every replica group failed ({', '.join(map(str, failed))}); see the lines "
                          f"above and {run_dir / 'logs'}")
    if failed:
        print(f"allhands: warning: replica group(s) {', '.join(map(str, failed))} failed for good; "
              f"the others completed the job", file=sys.stderr, flush=True)
    del store


def start_with_secret(procs: list) -> None:
    """Start ``procs`` with a secret made for this job in their environment (the groups' shared
    store is MAC'd under it); the launcher's own environment is restored."""
    saved = os.environ.get(REPLICA_SECRET_ENV)
    os.environ[REPLICA_SECRET_ENV] = secrets.token_hex(32)  # inherited by the groups only
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop(REPLICA_SECRET_ENV, None)
        else:
            os.environ[REPLICA_SECRET_ENV] = saved


def _group_main(cfg_dict: dict, job: Any, group: int, groups: int, port: int, launch: Callable,
                entry: Callable, group_spec: Any, policy: Any) -> None:
    """One replica group: the single-node launcher with the group's workers, in its own directory."""
    os.environ[REPLICA_ENV] = f"{group},{groups},127.0.0.1,{port}"
    cfg = Config.from_dict(cfg_dict)
    where = group_dir(Path(cfg.run.dir), group)
    where.mkdir(parents=True, exist_ok=True)
    try:
        launch(entry, (cfg_dict, job), group_spec, threads=cfg.run.threads,
               log_dir=where / "logs", policy=policy, run_dir=where)
    except LaunchError as e:
        print(f"allhands: replica group {group}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
