"""Replica mode's launcher (``fault.mode = "replica"``): one torch elastic world per replica
group, each in a process of its own that runs the single-node launcher with one worker and
restarts only that group (one worker, or the dp_shard workers of an FSDP group), plus the store where the groups meet every step (replica/quorum.py).

This is the shape torchft gives a job (one ``torchrun`` per replica group, github.com/pytorch/torchft):
a failed group is restarted by its own supervisor while the others carry on, and it heals from a
live peer (replica/heal.py) instead of everyone restarting from a checkpoint. When every group
failed at once, each restarts from its own last checkpoint and the quorum forms again among
them: the restart mode's recovery, kept as the fallback.

The store is a TCPStore served on loopback only by a process of its own (storehost.py); every
value the workers write to it is MAC'd under a secret made for this job (authstore.py), handed to
the groups in their environment, and a value without a valid MAC is read as absent, not fatal.

Each group's process is a "slot"; ``fault.spares`` more slots start as spares (replica/spares.py).
A watcher thread here sees a worker's process die within ``WATCH_S`` (its supervisor needs longer:
torch's agent polls, then shuts the worker group down), hands its group to an idle spare and posts
the failure notice, so the survivors neither wait ``fault.quorum_timeout_s`` nor a process start.

A stop signal to this launcher is put in the store (``stop``): the members agree on it in their
next all-reduce (replica/quorum.py), every group checkpoints the same step, and the job ends with the
one line of a clean stop; a second signal kills every worker at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from allhands.authstore import sealed
from allhands.paths import group_dir
from allhands.config import Config
from allhands.env import REPLICA_ENV, REPLICA_SECRET_ENV
from allhands.errors import Interrupted, LaunchError
from allhands.launch import forkstart, owner, stop
from allhands.launch.storehost import HostedStore
from allhands.launch.supervisor import _alive
from allhands.stopflag import STOP_SIGNALS, signal_of
from allhands.replica.spares import hand_over, holder

WATCH_S = 0.02  # how often the watcher looks at every worker's process
CUT_SHORT_S = 5.0  # how long a slot ended after the job may take to stop before it is killed


def run_replicas(cfg: Config, nproc: int, job: Any, *, launch: Callable, entry: Callable,
                 group_spec: Any, policy: Any) -> None:
    """Run ``nproc`` replica groups of ``group_spec.nproc`` workers each on this node until they
    complete; LaunchError when every group failed for good (each one's restarts used up). Across
    nodes: launch/replica_nodes.py, with the same slots and summary."""
    run_dir = Path(cfg.run.dir)
    host = HostedStore("127.0.0.1", 0, "replica store", cfg.parallel.timeout_s)  # loopback only
    secret = secrets.token_hex(32)
    procs = [forkstart.process(group_main, (cfg.to_dict(), job, g, nproc, f"{g},{nproc},127.0.0.1,{host.port}",
                                            secret, launch, entry, group_spec, policy), f"allhands-replica-{g}")
             for g in range(nproc + cfg.fault.spares)]
    try:
        for p in procs:
            p.start()
        host.ready()
        spares = f", {cfg.fault.spares} spare(s)" if cfg.fault.spares else ""
        print(f"allhands: replica mode: {nproc} replica groups of {group_spec.nproc} worker(s){spares}, quorum store on "
              f"127.0.0.1:{host.port} only; run directory {run_dir}", file=sys.stderr, flush=True)
        ours = sealed(dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                    timeout=timedelta(seconds=cfg.parallel.timeout_s)),
                      secret, host.where, tolerant=True)
        watcher = Watcher(ours, nproc, procs, run_dir / "replicas" / "notices.jsonl")
        with _stop_handling(ours, watcher) as stopping:
            watcher.start()
            try:
                _join(procs, ours, watcher)
            finally:
                watcher.halt()
                ours.close()
    finally:
        end_slots(procs)
        host.close()
    if watcher.cut_short:  # a group ended while restarting holds the final state all the same
        from allhands.replica.start import catch_up  # start-up time: the trainer's modules

        for g in (i for i in watcher.cut_short if i < nproc):
            catch_up(run_dir, g, nproc)
    codes = [p.exitcode for i, p in enumerate(procs) if i not in watcher.cut_short]
    signum = stopping.signum or next((signal_of(c) for c in codes if c and signal_of(c)), None)
    if signum:
        spec = dataclasses.replace(group_spec, nproc=nproc)
        s = stop.Stopped(signum, clean=not stopping.killed and all(c == 0 or signal_of(c) for c in codes))
        raise Interrupted(stop.final_line(s, run_dir, stop.resume_command(spec, run_dir)),
                          stop.exit_code(signum))
    failed = [g for g, p in enumerate(procs) if p.exitcode != 0 and g not in watcher.cut_short]
    check_groups(failed, len(procs), run_dir, nproc)


def slot_dir(run_dir: Path, slot: int, groups: int) -> Path:
    """Where slot ``slot`` keeps its logs: its group's directory, or a spare's own."""
    return group_dir(run_dir, slot) if slot < groups else run_dir / "replicas" / f"spare-{slot - groups}"


def see_logs(dirs: list[Path], run_dir: Path) -> str:
    """The logs directories of ``dirs`` that exist, for a "see" line (the run directory when none
    does: a world that failed before it logged anything)."""
    found = [str(d / "logs") for d in dirs if (d / "logs").is_dir()]
    return ", ".join(found) if found else str(run_dir)


def check_groups(failed: list[int], total: int, run_dir: Path, groups: int, whose: str = "") -> None:
    """The end of a replica-mode launch whose slots ``failed`` (of ``total``) exited non-zero:
    LaunchError when every one did (naming their logs), else a warning line naming them."""
    if failed and len(failed) == total:
        logs = see_logs([slot_dir(run_dir, g, groups) for g in failed], run_dir)
        raise LaunchError(f"every replica group{whose} failed ({', '.join(map(str, failed))}); see the "
                          f"lines above and {logs}")
    if failed:
        print(f"allhands: warning: replica group(s) {', '.join(map(str, failed))} failed for good; "
              f"the others completed the job", file=sys.stderr, flush=True)


def end_slots(procs: list) -> None:
    """Kill every slot still running and its workers (a launcher that failed before its slots
    ended leaves none behind), then wait for them."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            for pid in [*_descendants(p.pid), p.pid]:
                _kill(pid)
            p.join()


def start_with_secret(procs: list, secret: str) -> None:
    """Start ``procs`` with a secret made for this job in their environment (the groups' shared
    store is MAC'd under it); the launcher's own environment is restored."""
    saved = os.environ.get(REPLICA_SECRET_ENV)
    os.environ[REPLICA_SECRET_ENV] = secret  # inherited by the groups only
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop(REPLICA_SECRET_ENV, None)
        else:
            os.environ[REPLICA_SECRET_ENV] = saved


def _join(procs: list, store: dist.Store, watcher: "Watcher") -> None:
    """Wait for every slot. Once the job is done and every group's last holder has exited, a slot
    still restarting a worker (its start takes seconds) has nothing left to do: it is ended, its
    worker killed and the slot stopped like a launcher in its backoff (SIGTERM, so the failure
    it was restarting from still reaches its restarts.jsonl), or killed after CUT_SHORT_S."""
    while any(p.is_alive() for p in procs):
        time.sleep(0.1)
        if not store.check(["done"]) or not {holder(store, g) for g in range(watcher.n)} <= watcher.dead:
            continue
        for i, p in enumerate(procs):
            if p.is_alive():
                watcher.cut_short.add(i)
                for pid in _descendants(p.pid):  # its worker first: not an orphan
                    _kill(pid)
                _kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + CUT_SHORT_S
        for i in watcher.cut_short:
            procs[i].join(max(0.0, deadline - time.monotonic()))
            if procs[i].is_alive():  # never a reaped pid, which may be another process's by now
                _kill(procs[i].pid)
        break
    for p in procs:
        p.join()


def group_main(cfg_dict: dict, job: Any, group: int, groups: int, coordinates: str, secret: str,
               launch: Callable, entry: Callable, group_spec: Any, policy: Any) -> None:
    """One slot (a replica group, or a spare when ``group >= groups``): the single-node launcher
    with the group's workers, whose logs stay in the slot's directory whichever group it holds.
    The quorum's ``coordinates`` (env.py ``replica_env``) and ``secret`` ("" with --insecure) reach
    the workers through the environment (the secret comes here through a pipe, not argv)."""
    os.environ[REPLICA_ENV], os.environ[REPLICA_SECRET_ENV] = coordinates, secret
    owner.mark_own()  # spawned (no server to fork it from), it runs this alone
    cfg = Config.from_dict(cfg_dict)
    run_dir = Path(cfg.run.dir)
    where = slot_dir(run_dir, group, groups)
    where.mkdir(parents=True, exist_ok=True)
    try:
        launch(entry, (cfg_dict, job), group_spec, threads=cfg.run.threads,
               log_dir=where / "logs", policy=policy, run_dir=where, resume_dir=run_dir)
    except Interrupted as e:  # the replicas launcher says the one line for the whole job
        sys.exit(e.exit_code)
    except LaunchError as e:
        print(f"allhands: replica group {group}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


class Watcher(threading.Thread):
    """The launcher's eye on every worker process (the roster of replica/spares.py): when one that
    holds a group dies, its group goes to an idle spare and the failure notice is posted."""

    def __init__(self, store: dist.Store, n_groups: int, slots: list, log: Path | None = None):
        super().__init__(name="allhands-replica-watcher", daemon=True)
        self.store, self.n, self.slots, self.log = store, n_groups, slots, log
        self.pids: dict[str, int] = {}  # incarnation -> pid, in start order
        self.dead: set[str] = set()
        self.handovers: list[tuple[float, int, str | None]] = []  # (time, group, spare or None)
        self.cut_short: set[int] = set()  # slots ended after the job was done
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(WATCH_S):
            try:
                self.poll()
            except Exception as e:  # the store is gone: the job is over
                if not self._halt.is_set():
                    print(f"allhands: replica watcher stopped: {e}", file=sys.stderr, flush=True)
                return

    def halt(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)

    def poll(self) -> None:
        for i in range(len(self.pids), self.store.add("procs", 0)):
            life, pid = self.store.get(f"proc/{i}").decode().split(":")
            self.pids[life] = int(pid)
        gone = [life for life, pid in self.pids.items() if life not in self.dead and not _alive(pid)]
        if not gone:
            return
        self.dead.update(gone)
        if self.store.check(["done"]) or self.store.check(["stop"]):  # finished or stopping, not failed
            return
        held = {holder(self.store, g): g for g in range(self.n)}
        for life in gone:
            g = held.get(life)
            if g is None:  # a spare or a finished process: no group waits for it
                self.store.set(f"dead/{life}", "1")
                continue
            idle = [s for s in self.pids if s not in self.dead]
            alive = any(h not in self.dead for h in held if h is not None and h != life)
            taker = hand_over(self.store, g, life, idle, peers_alive=alive)
            self.handovers.append((time.time(), g, taker))
            if self.log is not None:  # each notice's time, for the timeline of a fault (bench/replica.py)
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log, "a") as f:
                    f.write(json.dumps({"time": self.handovers[-1][0], "group": g, "pid": self.pids[life],
                                        "spare": self.pids[taker] if taker else None}) + "\n")
            then = (f"spare pid {self.pids[taker]} takes its place" if taker else
                    "no spare left: its own restart replaces it")
            print(f"allhands: replica group {g}: worker pid {self.pids[life]} died; {then}",
                  file=sys.stderr, flush=True)


class _Stopping:
    def __init__(self, store: dist.Store, watcher: Watcher):
        self.store, self.watcher, self.signum, self.killed = store, watcher, 0, False

    def on_signal(self, signum: int, frame=None) -> None:
        if self.signum:  # the second signal: every worker now, then their supervisors
            self.killed = True
            for p in self.watcher.slots:
                if p.pid:
                    for pid in [*_descendants(p.pid), p.pid]:
                        _kill(pid)
            return
        self.signum = signum
        self.store.compare_set("stop", "", str(signum))


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its agent's worker runs in a session of its own, so the
    process group would miss it), deepest first, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(children.get(c, []))
    return out[::-1]


def _kill(pid: int, signum: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def _stop_handling(store: dist.Store, watcher: Watcher):
    """This launcher's stop signals, for the job's duration (main thread only)."""
    stopping = _Stopping(store, watcher)
    with stop_signals_to(stopping.on_signal):
        yield stopping


@contextlib.contextmanager
def stop_signals_to(handler: Callable):
    """The stop signals go to ``handler`` while the block runs (main thread only)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS} if main else {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
