"""Multi-node restarts on torch's elastic agent: one line per failure, backoff, a restart limit
with a clean stop, and the node that left or came back named.

A multi-node job cannot restart from outside the agent the way a single node does
(supervisor.py): ``elastic_launch`` closes the rendezvous for good when it returns, and the other
nodes' agents re-rendezvous only with a live agent. So the restart stays torch's
(``SimpleElasticAgent._invoke_run``: monitor, stop, re-rendezvous, start) and
:class:`SupervisedAgent` hooks its two seams:

- ``_monitor_workers``: on a failed group, judge it with the job's restart policy (policy.py:
  fatal cause, start-up flake, restart, or give up) and steer torch's loop through
  ``_remaining_restarts`` (0 = stop now; +1 = a flake that does not count);
- ``_restart_workers``: let the policy wait the backoff and say who failed and why in one line,
  and after the re-rendezvous say which node left (no keep-alive for ``fault.node_timeout_s``) or
  came back and the world size the job continues at.

:func:`run_agent` is ``torch.distributed.launcher.api.launch_agent`` with this agent in place of
``LocalElasticAgent`` (torch offers no way to pass an agent class), and rendezvous errors turned
into one line each.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError, RendezvousConnectionError, RendezvousError, RendezvousTimeoutError,
)

from allhands.errors import LaunchError
from allhands.heartbeat import clear_heartbeats, progressed, take_hangs
from allhands.launch import forkstart, stop
from allhands.launch.policy import Decision, RestartPolicy, WorkerFailure, say

# gloo's words for a peer that went away: "[.../pair.cc:553] Connection closed by peer
# [10.61.0.2]:32440. This is typically caused by a remote worker crashing. ..."
_GLOO_PEER = re.compile(r"\[[^\]]*gloo[^\]]*\] ((?:Connection|Read error|Socket)[^\[]*?"
                        r"\[([0-9A-Fa-f.:]+)\]:\d+)")


def first_failure(failures: dict[int, Any]) -> int:
    """The rank whose failure is the cause: the earliest one, but a worker that only lost a peer
    (gloo's peer error) comes after every other failure in the set, which is that peer or took it
    down (a SIGKILLed worker has no error record to date it, and its peer's comes right after).
    -1 for no failure."""
    def lost_peer(f: Any) -> bool:
        return isinstance(f.message, dict) and _GLOO_PEER.search(str(f.message.get("message", ""))) is not None

    ranked = sorted(failures.items(), key=lambda kv: (lost_peer(kv[1]), kv[1].timestamp, kv[0]))
    return ranked[0][0] if ranked else -1


def describe_failures(failures: dict[int, Any], first_rank: int, node: str,
                      members: dict[str, tuple[int, int]] | None = None, single_node: bool = False) -> str:
    """'worker rank R (pid P) on node N failed: cause' for the first failure and any other rank
    that raised; ranks the agent merely terminated after the first failure are left out. A gloo
    error about a peer names that peer's node (and its worker ranks, from ``members``); on a
    single node no node was lost, so it names the worker that died instead."""
    lines = []
    for rank, f in sorted(failures.items(), key=lambda kv: (kv[0] != first_rank, kv[0])):
        raised = isinstance(f.message, dict)
        if rank != first_rank and not raised:
            continue
        if raised:
            full = str(f.message.get("message", "")).strip()
            msg = full.splitlines()[0] if full else "raised an exception"
            peer = _GLOO_PEER.search(full)
            if peer and single_node:
                dead = failures.get(first_rank)
                if rank == first_rank or dead is None:
                    msg = f"a peer worker on this node died: gloo: {peer.group(1)}"
                elif isinstance(dead.message, dict):  # it raised: its own line says why
                    msg = f"its peer worker rank {first_rank} failed first"
                else:
                    msg = f"its peer worker rank {first_rank} died ({_death(dead)})"
            elif peer:
                msg = f"lost node {peer.group(2)}{_ranks_of(peer.group(2), members)}: gloo: {peer.group(1)}"
        else:
            msg = _death(f)
        lines.append((rank, f.pid, msg))
    # The same cause on several ranks (every rank rejecting the same input) is said once.
    causes = {msg: [(r, p) for r, p, m in lines if m == msg] for _, _, msg in lines}
    return "; ".join(
        f"worker rank {who[0][0]} (pid {who[0][1]}) on node {node} failed: {msg}" if len(who) == 1
        else f"worker ranks {', '.join(str(r) for r, _ in who)} (pids {', '.join(str(p) for _, p in who)}) "
             f"on node {node} failed: {msg}"
        for msg, who in causes.items())


def _death(f: Any) -> str:
    """How a worker that raised nothing ended: a signal, or an exit code."""
    if f.exitcode < 0:
        return f"killed by {f.signal_name()}"
    return f"exited with code {f.exitcode} (its output above says why)"


def _ranks_of(addr: str, members: dict[str, tuple[int, int]] | None) -> str:
    if members and addr in members:
        first, n = members[addr]
        return f" (worker rank{'s' if n > 1 else ''} {first}" + (f"-{first + n - 1})" if n > 1 else ")")
    return ""


# How long a node waits for its own workers to fail before it acts on a peer's restart or a lost
# rendezvous store (NarrowRendezvousHandler.num_nodes_waiting). A worker hears of a dead peer
# within 0.03 s (gloo's "Connection reset") but its exit can take seconds under load; if none
# fails in this long they are healthy and the agent goes on as torch would have at once.
SETTLE_S = 10.0


# How long a node whose worker failed waits for its other workers to exit before torch's monitor
# takes the failure: that monitor reports only the lowest failed local rank and terminates the
# rest at once, so a worker that failed *because* a local peer raised (gloo: "Connection closed by
# peer") could hide the peer's own cause, e.g. a start-up flake that must not count.
LOCAL_SETTLE_S = 3.0


def exit_codes(pcontext: Any) -> dict[int, int | None]:
    """``{local rank: exit code}`` of the workers of torch's process context (-N: killed by
    signal N; None while running). Read from the process objects the context itself keeps
    (multiprocessing's for a function entry point, ``Popen`` for a program), which keep the code
    once read, so torch's monitor still collects every exit and error file as usual. A forkserver's
    workers are not this process's children: only their process objects know how they ended."""
    pc = getattr(pcontext, "_pc", None)
    if pc is not None:
        return {lr: p.exitcode for lr, p in enumerate(pc.processes)}
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return {lr: h.proc.poll() for lr, h in handlers.items()}


class LocalAgent(LocalElasticAgent):
    """torch's local agent, reporting every worker of this node that failed, not only the first:
    torch's monitor takes the lowest failed local rank and terminates the others at once, so the
    one reported can be a worker that only lost a local peer while the peer's own cause (a
    start-up flake that must not count, a fatal config error) is never seen. Here the others get
    ``LOCAL_SETTLE_S`` to exit first, and their failures and error files join the result."""

    def _settle_local_exits(self) -> dict[int, tuple[int, int]]:
        """``{local rank: (pid, exit code)}`` of this node's workers that have exited. Once one
        failed, the others get up to ``LOCAL_SETTLE_S`` to exit by themselves first (see there)."""
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        codes = exit_codes(self._pcontext)
        if any(codes.values()) and None in codes.values():
            deadline = time.monotonic() + LOCAL_SETTLE_S
            while None in codes.values() and time.monotonic() < deadline:
                time.sleep(0.05)
                codes = exit_codes(self._pcontext)
        return {lr: (pids[lr], c) for lr, c in codes.items() if c is not None}

    def _add_local_failures(self, result, worker_group, exits: dict[int, tuple[int, int]]) -> None:
        """Add to ``result.failures`` the workers of this node that failed besides the one torch
        reports, with their error files, so that the verdict sees every cause."""

        for w in worker_group.workers:
            pid, code = exits.get(w.local_rank, (0, 0))
            if code and w.global_rank not in result.failures:
                result.failures[w.global_rank] = ProcessFailure(
                    local_rank=w.local_rank, pid=pid, exitcode=code,
                    error_file=self._pcontext.error_files[w.local_rank])

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Workers take SIGTERM as a request for a clean stop at the next step (stopflag.py); when
        # the agent stops them (a failed peer, a restart) they must go at once, as they did on
        # SIGTERM before they handled it.
        super()._shutdown(signal.SIGKILL, timeout)

    def _start_workers(self, worker_group):
        result = super()._start_workers(worker_group)
        # torch's monitor also stops the workers itself once one failed, with SIGTERM and a 30 s
        # grace before the SIGKILL: a program's in PContext._poll -> close(), a function's in
        # torch.multiprocessing's ProcessContext.join. A survivor blocked in C++ (gloo
        # connecting to the dead peer) never reaches its SIGTERM handler, so the job waited
        # 30 s. The others had LOCAL_SETTLE_S to exit by themselves already: kill at once.
        pc = self._pcontext
        if pc is not None:
            close = pc.close
            pc.close = lambda death_sig=None, timeout=30: close(death_sig or signal.SIGKILL, timeout)
            procs = getattr(pc, "_pc", None)  # MultiprocessContext's torch.multiprocessing context
            if procs is not None:
                join = procs.join
                procs.join = lambda timeout=None, grace_period=None: join(
                    timeout, 0 if grace_period is None else grace_period)
        return result

    def _monitor_workers(self, worker_group):
        exits = self._settle_local_exits()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._add_local_failures(result, worker_group, exits)
        return result


class SupervisedAgent(LocalAgent):
    """torch's local agent; restarts judged, timed and reported by the job's restart policy."""

    def __init__(self, spec: WorkerSpec, *, policy: RestartPolicy, run_dir: Path | None,
                 heartbeat_dir: Path | None, node: str, node_timeout_s: float, **kw):
        super().__init__(spec, **kw)
        self.job = policy.for_job(run_dir, node=node)
        self.hb, self.node, self.node_timeout_s = heartbeat_dir, node, node_timeout_s
        self.final: str | None = None
        self._pending: Decision | None = None
        if hasattr(spec.rdzv_handler, "settle"):  # rendezvous.NarrowRendezvousHandler
            spec.rdzv_handler.settle = self._workers_failed

    def _workers_failed(self, within_s: float = SETTLE_S) -> bool:
        """Wait up to ``within_s`` for a worker of this node to exit with a failure; True if one
        did (torch's next ``_monitor_workers`` then reports it). See
        NarrowRendezvousHandler.num_nodes_waiting for when this is asked."""
        deadline = time.monotonic() + within_s
        while self._pcontext is not None:
            if any(exit_codes(self._pcontext).values()):
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return False

    def _members(self) -> dict[str, tuple[int, int]]:
        """``{node address: (first worker rank, workers)}``: nodes run equal --nproc, and worker
        ranks follow the rendezvous rank (torch's ``_assign_worker_ranks``)."""
        members = getattr(self._worker_group.spec.rdzv_handler, "members", None)
        n = self._worker_group.spec.local_world_size
        return {a: (r * n, n) for a, r in members().items()} if callable(members) else {}

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and \
                stop.CURRENT.outcome(result.failures) is not None:
            self._remaining_restarts = 0  # a stop signal: no restart; run_agent says it (stop.py)
            return result
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._pending is None:
            first_rank = first_failure(result.failures)
            summary = describe_failures(result.failures, first_rank, self.node, self._members()) \
                or f"the workers on node {self.node} became {result.state.name.lower()}"
            hangs = take_hangs(self.hb) if self.hb else []
            d = self.job.decide(summary, progressed(self.hb) if self.hb else True, hangs)
            if d.stops:
                self._remaining_restarts = 0  # torch's loop then stops the group and returns
                self.final = self.job.stop(d)
            else:
                self._pending = d  # acted on in _restart_workers, which torch calls next
                if d.verdict == "flake":
                    self._remaining_restarts += 1  # torch's loop takes one off again: not counted
        return result

    def _restart_workers(self, worker_group) -> None:
        if stop.CURRENT.signum:  # a stop signal came while the failed group was being stopped
            raise stop.Stopped(stop.CURRENT.signum, clean=False)
        d, self._pending = self._pending, None
        before = self._members()
        pids = self._launcher_pids()
        if d is None:  # torch restarts a healthy group when a node waits to join
            self.job.admit()
        else:
            self.job.backoff(d)
        if self.hb:
            clear_heartbeats(self.hb)
        t0 = time.monotonic()
        super()._restart_workers(worker_group)
        self._report_membership(before, pids, time.monotonic() - t0)

    def _launcher_pids(self) -> dict[str, int]:
        pids = getattr(self._worker_group.spec.rdzv_handler, "launcher_pids", None)
        return pids() if callable(pids) else {}

    def _report_membership(self, before: dict, pids: dict[str, int], took: float) -> None:
        wg = self._worker_group
        after, now = self._members(), self._launcher_pids()
        world = wg.workers[0].world_size if wg.workers else 0
        parts = [f"node {a}{_ranks_of(a, before)} left the job (no keep-alive for "
                 f"fault.node_timeout_s={self.node_timeout_s:g} s)" for a in before if a not in after]
        parts += [f"node {a} {'came back (a new launcher)' if a in pids and now.get(a) != pids[a] else 'joined'}"
                  for a in after if a not in before or now.get(a) != pids.get(a)]
        size = f"{wg.group_world_size} node(s), world size {world}"
        say(f"allhands: {'; '.join(parts) + '; ' if parts else ''}re-rendezvous done in "
            f"{took:.1f} s: continuing on {size}")


def run_agent(*, spec_kw: dict, rdzv: RendezvousParameters, logs_specs: Any, policy: RestartPolicy | None,
              run_dir: Path | None, heartbeat_dir: Path | None, node: str,
              node_timeout_s: float, external_store: bool = False) -> dict[int, Any]:
    """``launch_agent`` with :class:`SupervisedAgent` (``policy`` None: :class:`LocalAgent`, for a
    single node, which restarts outside). Raises WorkerFailure / LaunchError with one line."""
    method = forkstart.ensure_server() if callable(spec_kw["entrypoint"]) else "spawn"
    if method == "forkserver":
        spec_kw = {**spec_kw, "entrypoint": forkstart.forked,
                   "args": (forkstart.Inherited(), spec_kw["entrypoint"], *spec_kw["args"])}
    spec = WorkerSpec(rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv), **spec_kw)
    if policy is None:
        agent = LocalAgent(spec=spec, logs_specs=logs_specs, start_method=method)
    else:
        agent = SupervisedAgent(spec, policy=policy, run_dir=run_dir, heartbeat_dir=heartbeat_dir,
                                node=node, node_timeout_s=node_timeout_s, logs_specs=logs_specs,
                                start_method=method)
    shutdown = True
    stop.CURRENT.workers = lambda: agent._pcontext.pids().values() if agent._pcontext else ()
    try:
        result = agent.run()
        stopped = stop.CURRENT.outcome(result.failures) if result is not None and result.is_failed() else None
        if stopped is not None:
            raise stopped
        if result is None:  # torch: the rendezvous was closed while this node was redundant
            raise LaunchError(f"node {node}: the job ended while this node waited to join")
        if result.is_failed():
            final = getattr(agent, "final", None)
            if final:
                raise WorkerFailure(final)
            raise WorkerFailure(describe_failures(result.failures, first_failure(result.failures), node,
                                                  single_node=policy is None))
        return result.return_values
    except (SignalException, stop.Stopped):
        shutdown = False  # as launch_agent: a signalled agent leaves the rendezvous open
        raise
    except RendezvousClosedError:
        # torch keeps a closed rendezvous closed in its store: a long-lived external store
        # refuses the next run of the same job (same endpoint, hence the same run id).
        again = ("; or the rendezvous store served an earlier run of this job: restart "
                 "`allhands rendezvous-store` before starting the job again") if external_store else ""
        raise LaunchError(f"node {node}: another node ended the job (it failed for good or used up "
                          f"its restarts; its output says why){again}") from None
    except RendezvousTimeoutError:
        raise LaunchError(f"node {node}: fewer than {rdzv.min_nodes} node(s) joined the rendezvous "
                          f"at {rdzv.endpoint} within fault.rdzv_join_timeout_s; start the missing "
                          f"nodes' command again, or allow a smaller job with --nnodes MIN:MAX") from None
    except RendezvousConnectionError:
        where = ("the `allhands rendezvous-store` process is down or unreachable; start it again, "
                 "then the job" if external_store else
                 "the node hosting it (--node-rank 0) is down or unreachable; start the job again")
        raise LaunchError(f"node {node}: lost the rendezvous store at {rdzv.endpoint}: {where} "
                          f"(it continues from the last committed checkpoint)") from None
    except RendezvousError as e:
        raise LaunchError(f"node {node}: rendezvous failed: {type(e).__name__}: {e}") from None
    except (DistNetworkError, DistStoreError) as e:
        # torch's agent reads the rendezvous store unguarded between rounds (the worker store's
        # address, the other nodes' role infos): a node that stopped there (a refused forgery, a
        # crash) leaves the others a closed connection or a timeout, not a rendezvous error.
        said = str(e).splitlines()[0][:200]
        raise LaunchError(f"node {node}: the rendezvous store at {rdzv.endpoint} stopped answering "
                          f"while the nodes were assigned ranks ({type(e).__name__}: {said}): "
                          f"another node stopped (its output says why) or node 0 is down; start the "
                          f"job again (it continues from the last committed checkpoint)") from None
    finally:
        stop.CURRENT.workers = None
        if shutdown:
            try:
                spec.rdzv_handler.shutdown()
            except Exception:  # the store may be gone with node 0; nothing left to close
                pass


def node_label(local_addr: str | None, multi_node: bool) -> str:
    """Nodes named by the address the others reach them at (host names can repeat, e.g. in
    containers or the lab's namespaces); a single node by its host name."""
    return (local_addr if multi_node and local_addr else socket.gethostname())

