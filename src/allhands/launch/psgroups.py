"""A parameter server in replica mode (``parallel.sync=ps``, ``fault.mode=replica``, async or
ssp): every worker is a torch elastic world of its own and the servers one more, so torch's agent
restarts a dead worker alone while the servers and the other workers keep training.

The shape of launch/replicas.py (one ``torchrun`` per group, as torchft runs replica groups):
the worlds cannot reach each other's process groups, so workers and servers link through a
store hosted here (ps/links.py: a gloo group per worker, server and worker incarnation),
every value MAC'd under a secret made for this job (authstore.py). A dead server's agent
restarts the servers world alone: the servers restore their shards from their last checkpoint
and the workers, which keep their processes, link to the new incarnation (ps/links.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable

from allhands.paths import group_dir
from allhands.config import Config
from allhands.env import PS_ENV
from allhands.errors import ConfigError, Interrupted, LaunchError
from allhands.launch import forkstart, stop
from allhands.launch.replicas import _descendants, _kill, end_slots, see_logs, start_with_secret, stop_signals_to
from allhands.launch.storehost import HostedStore


def run_ps_groups(cfg: Config, spec: Any, job: Any, *, launch: Callable, entry: Callable,
                  policy: Any) -> None:
    """Run ``spec.nproc - ps.servers`` one-worker worlds and one world of the servers until they
    complete; LaunchError when the servers failed or every worker did."""
    if spec.multi_node:  # the link store is on loopback, as replica mode's quorum store
        raise ConfigError("fault.mode: replica with parallel.sync=ps runs on one node for now; use "
                          "fault.mode=restart for a multi-node job")
    workers = spec.nproc - cfg.ps.servers
    run_dir = Path(cfg.run.dir)
    store = HostedStore("127.0.0.1", 0, "parameter-server link store", cfg.parallel.timeout_s)
    procs = []
    for g in range(workers + 1):  # the last group: the servers
        nproc = cfg.ps.servers if g == workers else 1
        group_spec = dataclasses.replace(spec, nproc=nproc, port=0, run_id="")
        # Its logs and restart record; and where its restart resumes from: a restarted server
        # restores its shard from the servers' checkpoints (ps/start.py run_server), a worker from
        # its group's (as in replica mode, replica/heal.py)
        where = run_dir / "ps-servers" if g == workers else group_dir(run_dir, g) / "ps-worker"
        resume = run_dir / "ps-checkpoints" if g == workers else group_dir(run_dir, g) / "checkpoints"
        # The servers compile nothing and beat their update count: their first updates are
        # judged as any other (supervisor.py), not by fault.first_step_timeout_s.
        world_policy = policy if g < workers else dataclasses.replace(
            policy, first_step_timeout_s=policy.hang_timeout_s)
        args = (cfg.to_dict(), job, g, workers + 1, store.port, launch, entry, group_spec, world_policy,
                where, resume)
        # forked from this launcher's server (forkstart.py), with its environment, as its workers are
        procs.append(forkstart.process(_group_main, args, f"allhands-ps-{g}"))
    try:
        start_with_secret(procs, secrets.token_hex(32))
        store.ready()
        print(f"allhands: parameter server, replica mode: {workers} workers restarted alone, "
              f"{cfg.ps.servers} server(s); link store on 127.0.0.1:{store.port} only", file=sys.stderr,
              flush=True)
        with _stop_handling(procs) as stopping:
            _join(procs, stopping)
    finally:
        end_slots(procs)
        store.close()
    if stopping.signum:
        s = stop.Stopped(stopping.signum, clean=not stopping.killed)
        raise Interrupted(stop.final_line(s, run_dir, stop.resume_command(spec, run_dir)),
                          stop.exit_code(stopping.signum))
    if procs[-1].exitcode != 0 or all(p.exitcode != 0 for p in procs[:-1]):
        worlds = [run_dir / "ps-servers", *(group_dir(run_dir, g) / "ps-worker" for g in range(workers))]
        raise LaunchError(f"the parameter servers or every worker failed; see the lines above and "
                          f"{see_logs(worlds, run_dir)}")


def _group_main(cfg_dict: dict, job: Any, group: int, groups: int, port: int, launch: Callable,
                entry: Callable, group_spec: Any, policy: Any, where: Path, resume: Path) -> None:
    """One world (a worker, or the servers): the single-node launcher, its logs under ``where``,
    its restarts resuming from the checkpoints in ``resume``."""
    os.environ[PS_ENV] = f"{group},{groups},127.0.0.1,{port}"
    where.mkdir(parents=True, exist_ok=True)
    cfg = Config.from_dict(cfg_dict)
    try:
        launch(entry, (cfg_dict, job), group_spec, threads=cfg.run.threads, log_dir=where / "logs",
               policy=policy, run_dir=where, checkpoints=resume, resume_dir=Path(cfg.run.dir))
    except Interrupted as e:  # the job's launcher says the one line for the whole job
        sys.exit(e.exit_code)
    except LaunchError as e:
        print(f"allhands: ps group {group}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


class _Stopping:
    """A stop signal to this launcher: the first is forwarded to every world's launcher (each
    stops its workers cleanly, launch/stop.py), and the servers' world, which serves no one once
    every worker world ended, is ended then; a second kills every process of the job at once."""

    def __init__(self, procs: list):
        self.procs, self.signum, self.killed = procs, 0, False

    def on_signal(self, signum: int, frame=None) -> None:
        if self.signum:
            self.killed = True
            for p in self.procs:
                _end_tree(p)
            return
        self.signum = signum
        for p in self.procs:
            if p.pid and p.is_alive():
                _kill(p.pid, signum)


def _join(procs: list, stopping: _Stopping) -> None:
    """Wait for every world; on a stop, end the servers' world once the workers' have ended, and
    afterwards every process a world left behind (its forkserver, resource tracker, workers)."""
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.1)
            if stopping.signum and procs[-1].is_alive() and not any(p.is_alive() for p in procs[:-1]):
                _end_tree(procs[-1])
    finally:
        for p in procs:
            _end_tree(p)
            p.join()


def _end_tree(p) -> None:
    """SIGKILL a live world's launcher and every process below it (never a reaped pid)."""
    if p.pid and p.is_alive():
        for pid in [*_descendants(p.pid), p.pid]:
            _kill(pid)


@contextlib.contextmanager
def _stop_handling(procs: list):
    stopping = _Stopping(procs)
    with stop_signals_to(stopping.on_signal):
        yield stopping
