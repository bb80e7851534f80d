"""Replica mode's per-step quorum: which replica groups train the next step, agreed in the job's
MAC'd store, the gloo group of that quorum for the cross-group gradient all-reduce, and a step
that counts only when every member reduced it (otherwise every member discards it).

The shape is torchft's (Manager + Lighthouse, github.com/pytorch/torchft): each replica group is
its own torch elastic world, and the groups meet per step in a quorum. Here the quorum lives in a
store (authstore.py: every value MAC'd under a secret only the job holds) instead of a lighthouse
service, and the all-reduce runs on a ``ProcessGroupGloo`` made for that quorum's id over a
``PrefixStore``, a new one per membership change. Its connection records travel through the
MAC'd store, and before any tensor crosses it every member proves the job's replica secret over
the group itself (admission.py ``admit_peers``), as every process group of a worker's own world
is admitted (mesh.py). ``address``: where this group's gloo listens (another node's groups dial
it), by default where gloo's environment says.

Keys (all under the store given):
- ``q/E/m/G``: group G's registration for quorum E (its step and incarnation); ``q/E/members``
  the decided membership, set once by compare-and-set, so every group reads the same one;
  ``epoch`` the newest decided quorum.
- ``q/E/r/G.L``: rank L of member G is ready to connect quorum E's gloo group; ``q/E/go``
  ``yes`` once all are, ``no`` (compare-and-set, one outcome for all) when a member's holder is
  dead by the launcher's notice or not ready within ``timeout_s``: a member lost between the
  decision and the connection fails the quorum, and the others re-form without it.
- ``life/G``: group G's current incarnation (a fresh token per process start).
- ``joiners``: a counter a group outside the quorum bumps to be let in. Members read it before
  each all-reduce and sum it inside that all-reduce, so all of them see the same total and
  re-form together, at the same step boundary.
- ``d/E/S``: the decision on step S of quorum E, ``commit`` only if every rank L of every member
  G wrote ``ok/E/S/G.L`` (its all-reduce completed), else ``abort``. A gloo ring can complete on one member
  and fail on another when a third dies mid-ring; the compare-and-set decision makes the outcome
  one for all (torchft's ``should_commit``).

Who may close a quorum early (after ``timeout_s`` without every group registered, or at once when
every missing group's holder is dead by the launcher's notice, replica/spares.py): a member of
the newest quorum, or anyone once every member of it has restarted (a new incarnation: that
quorum is dead, e.g. every group failed and restarted from its checkpoint), or anyone after
``dead_s``. A group that is merely joining waits for the live quorum to let it in, so two
quorums never train side by side.

A group of several ranks (FSDP inside the group: HSDP across groups) is one member, as in torchft
(every rank has a Manager; the quorum is decided once per group): its local rank 0 registers and
closes quorums, the other local ranks read the first decided quorum after their last one that
holds their group's incarnation, and each local rank all-reduces its own gradient shard with the
same local rank of the other members (``pg/E/L/``), since rank L of every group holds the same
slice of every parameter.

A stop (a signal to the launcher or to a group, launch/replicas.py) is agreed like the joiners:
``stop`` holds the signal number, each member adds whether it saw it to the same all-reduce, and
every member stops after the same step.

Store hygiene: keys of a step are deleted by their writers once the next step's all-reduce
completed (every member has read them by then), a quorum's registrations two quorums later, so a
long job's store does not grow with its steps.
"""

from __future__ import annotations

import datetime
import sys
import time
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from allhands import collective
from allhands.admission import admit_peers
from allhands.replica.membership import Quorum, QuorumFinished, QuorumStopped, shared_token
from allhands.stopflag import FLAG

__all__ = ["Quorum", "QuorumFinished", "QuorumStopped", "ReplicaQuorum", "shared_token"]


class ReplicaQuorum:
    """One replica group's side of the quorum. ``store`` is the job's MAC'd store (shared by
    every group), ``group`` this group's index of ``n_groups``."""

    def __init__(self, store: dist.Store, group: int, n_groups: int, *, timeout_s: float,
                 dead_s: float, pg_timeout_s: float, min_groups: int = 1,
                 local_group: dist.ProcessGroup | None = None, secret: str | None = None,
                 address: str = "", life: str | None = None):
        self.store, self.group, self.n, self.min_groups = store, group, n_groups, min_groups
        self.secret, self.address = secret, address  # no secret: --insecure, nothing to prove
        self.timeout_s, self.dead_s, self.pg_timeout_s = timeout_s, dead_s, pg_timeout_s
        # ``local_group``: this group's own world when it has several ranks (they share one
        # incarnation, made by local rank 0, and agree on when to re-form).
        self.local = local_group if local_group is not None and local_group.size() > 1 else None
        self.rank = self.local.rank() if self.local is not None else 0
        self.ranks = self.local.size() if self.local is not None else 1
        if life is None:  # not given by the worker (which registered it: replica/spares.py)
            life = shared_token(self.local)
            if self.rank == 0:
                self.store.set(f"life/{group}", life)
        self.life = life
        self.quorum: Quorum | None = None
        self.pg: dist.ProcessGroup | None = None
        self.reform = True  # no quorum yet
        self.stop = 0  # a stop signal every member agreed on (0: none)
        self._stale: list[str] = []  # keys this member wrote, deleted once every member read them

    # -- forming a quorum
    def _latest(self) -> Quorum | None:
        e = int(self.store.get("epoch")) if self.store.check(["epoch"]) else 0
        if self.quorum is not None and self.quorum.qid > e:
            # ``epoch`` is gone or forged and its writer (who alone read it) died: this member's
            # own quorum is at least as new, so it is re-derived from that and written back
            e = self.quorum.qid
            self.store.compare_set("epoch", "", str(e))  # over a forged value as over none
        return Quorum.decode(e, self.store.get(f"q/{e}/members")) if e else None

    def _may_close(self, prev: Quorum | None, waited: float) -> bool:
        if prev is None or waited >= self.dead_s:
            return True
        if self.group in prev.members and prev.lives[prev.members.index(self.group)] == self.life:
            return True
        restarted = [self.store.get(f"life/{g}").decode() != life for g, life in zip(prev.members, prev.lives)]
        return all(restarted)

    def _missing_dead(self, missing: list[int]) -> bool:
        """Every group in ``missing`` is held by a process the launcher saw die (replica/spares.py)."""
        lives = [self.store.get(f"life/{g}").decode() if self.store.check([f"life/{g}"]) else ""
                 for g in missing]
        return all(life and self.store.check([f"dead/{life}"]) for life in lives)

    def form(self, step: int, on_wait=None) -> Quorum:
        """Register at the next quorum with this group's step; return the decided one, with this
        group in it (retrying at the next quorum id when it was decided without this group).
        ``on_wait`` is called about once a second while waiting (the worker's heartbeat, so that
        the hang watchdog does not take a wait for a replacement for a hang)."""
        self.pg = None  # the old group's connections close with it
        if self.rank > 0:
            return self._follow(on_wait)
        while True:
            prev = self._latest()
            e = prev.qid + 1 if prev else 1
            if prev is not None and (self.group not in prev.members or
                                     prev.lives[prev.members.index(self.group)] != self.life):
                # Ask the live quorum to re-form with this group; before registering, so a
                # quorum that includes this group already counts its request.
                self.store.add("joiners", 1)
            self.store.set(f"q/{e}/m/{self.group}", f"{step}:{self.life}")
            start = beat = time.monotonic()
            while not self.store.check([f"q/{e}/members"]):
                if self.store.check(["done"]):
                    raise QuorumFinished()
                if self.store.check(["stop"]):
                    raise QuorumStopped(int(self.store.get("stop")))
                keys = [f"q/{e}/m/{g}" for g in range(self.n)]
                present = [g for g, k in enumerate(keys) if self.store.check([k])]
                now = time.monotonic()
                waited = now - start
                if on_wait is not None and now - beat >= 1.0:
                    on_wait()
                    beat = now
                if len(present) == self.n or (len(present) >= self.min_groups and (
                        waited >= self.timeout_s or self._missing_dead(
                            [g for g in range(self.n) if g not in present]))
                        and self._may_close(prev, waited)):
                    self._close(e, present)
                    break
                time.sleep(0.005)
            q = Quorum.decode(e, self.store.get(f"q/{e}/members"))
            if self.group in q.members and q.lives[q.members.index(self.group)] == self.life:
                self._stale.append(f"q/{e}/m/{self.group}")
                if q.members[0] == self.group and e > 2:  # nobody reads a quorum two back
                    self._stale.append(f"q/{e - 2}/members")
                if self._connect(q, on_wait):
                    return q
                # a member died between the decision and the connection: re-form without it

    def _follow(self, on_wait=None) -> Quorum:
        """A local rank > 0: the first quorum after this rank's last one that holds this group's
        incarnation, which is the one local rank 0 was let into (it returns at the first)."""
        e = self.quorum.qid + 1 if self.quorum else 1
        beat = time.monotonic()
        while True:
            if self.store.check([f"q/{e}/members"]):
                q = Quorum.decode(e, self.store.get(f"q/{e}/members"))
                if self.group in q.members and q.lives[q.members.index(self.group)] == self.life \
                        and self._connect(q, on_wait):
                    return q
                e += 1
            elif self.store.check(["epoch"]) and int(self.store.get("epoch")) > e:
                e += 1  # a quorum without this group, its keys deleted since
            elif self.store.check(["done"]):
                raise QuorumFinished()
            elif self.store.check(["stop"]):
                raise QuorumStopped(int(self.store.get("stop")))
            else:
                if on_wait is not None and time.monotonic() - beat >= 1.0:
                    on_wait()
                    beat = time.monotonic()
                time.sleep(0.01)

    def _close(self, e: int, present: list[int]) -> None:
        joiners = self.store.add("joiners", 0)
        regs = [self.store.get(f"q/{e}/m/{g}").decode().split(":") for g in present]
        q = Quorum(e, tuple(present), tuple(int(r[0]) for r in regs), tuple(r[1] for r in regs), joiners)
        if self.store.compare_set(f"q/{e}/members", "", q.encode()) == q.encode():
            self.store.set("epoch", str(e))
        elif not self.store.check(["epoch"]) or int(self.store.get("epoch")) < e:
            self.store.set("epoch", str(e))  # the winner may have died before it said so

    def _connect(self, q: Quorum, on_wait=None) -> bool:
        """Make ``q``'s gloo group; False when the quorum failed before it connected: a member
        died after the decision (the launcher's notice), or never came to connect within
        ``timeout_s``, or the connection itself failed. Every member takes the same outcome from
        ``q/E/go`` (compare-and-set, as a step's decision), so all of them connect or all re-form."""
        mine = f"q/{q.qid}/r/{self.group}.{self.rank}"
        self.store.set(mine, "1")
        self._stale.append(mine)
        go, ready = f"q/{q.qid}/go", [f"q/{q.qid}/r/{g}.{r}" for g in q.members for r in range(self.ranks)]
        start = beat = time.monotonic()
        while not self.store.check([go]):
            verdict = b"yes" if self.store.check(ready) else b""
            if not verdict and (time.monotonic() - start > self.timeout_s or any(
                    self.store.check([f"dead/{life}"]) for life in q.lives)):
                verdict = b"no"
            if verdict:
                self.store.compare_set(go, "", verdict)
                break
            if on_wait is not None and time.monotonic() - beat >= 1.0:
                on_wait()
                beat = time.monotonic()
            time.sleep(0.002)
        if q.members[0] == self.group and self.rank == 0:
            self._stale.append(go)
        self.quorum = q
        if bytes(self.store.get(go)) == b"yes":
            try:
                self.pg, self.reform = self._group(q), False
                return True
            except RuntimeError as e:  # gloo: a member died inside the connection or admission
                print(f"allhands: replica group {self.group}: quorum {q.qid}'s group did not connect "
                      f"({str(e).splitlines()[0][:160]}); re-forming", file=sys.stderr, flush=True)
        elif self.rank == 0:
            print(f"allhands: replica group {self.group}: quorum {q.qid} lost a member before its group "
                  f"connected; re-forming without it", file=sys.stderr, flush=True)
        self.pg, self.reform = None, True
        return False

    def _group(self, q: Quorum) -> dist.ProcessGroup:
        """The quorum's gloo group (of this local rank's peers: worker L of every member), its
        members admitted: a stranger that took a member's place (its records in the store, or its
        connection) is refused before any gradient is summed."""
        prefix = dist.PrefixStore(f"pg/{q.qid}/" + (f"{self.rank}/" if self.ranks > 1 else ""), self.store)
        rank, size = q.members.index(self.group), len(q.members)
        timeout = datetime.timedelta(seconds=self.pg_timeout_s)
        if self.address:  # not GLOO_SOCKET_IFNAME: a group's own world is pinned to loopback
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout, opts._devices = timeout, [dist.ProcessGroupGloo.create_device(hostname=self.address)]
            pg = dist.ProcessGroupGloo(prefix, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        collective.register(pg, "cpu")
        if self.secret:
            admit_peers(torch.device("cpu"), pg, secret=self.secret)
        return pg

    # -- one step
    def allreduce(self, grads: list[torch.Tensor], step: int) -> bool:
        """Sum ``grads`` (each already scaled by this group's share of the global batch) over
        the quorum, in place. True: every member reduced step ``step`` and it counts; False: it
        is discarded everywhere and the quorum re-forms before the next try."""
        q = self.quorum
        assert q is not None and self.pg is not None
        stopping = bool(FLAG.signum) or self.store.check(["stop"])
        if FLAG.signum:  # a signal that reached this group: the first one is the job's
            self.store.compare_set("stop", "", str(FLAG.signum))
        # The counters ride at the end of the gradients' buffer, on their device; a GPU's buffer
        # crosses the gloo group through a pinned host copy (the host buffer on the CPU itself).
        dev = grads[0].device if grads else torch.device("cpu")
        joiners = torch.tensor([float(self.store.add("joiners", 0)), float(stopping)], device=dev)
        flat = _flatten_dense_tensors([g.detach().float() for g in grads] + [joiners])
        host = collective.to_host(flat)
        try:
            collective.all_reduce(host, call="replica quorum", group=self.pg)
            ok = True
        except RuntimeError:  # gloo: a peer closed the connection (it died) or timed out
            ok = False
        decision = self._decide(q, step, ok)
        if decision != b"commit":
            self.reform = True
            return False
        if host is not flat:
            flat.copy_(host)
        *reduced, _ = _unflatten_dense_tensors(flat, [g.float() for g in grads] + [joiners])
        for g, r in zip(grads, reduced):
            g.copy_(r)
        # Every member summed the same counters: all of them re-form after this step, or none.
        # The ranks of one group read the counters at different moments: they take the largest.
        total = host[-2:].clone()
        if self.local is not None:
            collective.all_reduce(total, op=collective.MAX, call="replica quorum (counters)", group=self.local)
        if float(total[0]) > len(q.members) * q.joiners:
            self.reform = True
        if float(total[1]) > 0:  # some member saw the stop, which it stored before reducing
            self.stop = int(self.store.get("stop"))
        # Every member completed this all-reduce, so each has read the previous step's keys.
        for key in self._stale:
            self.store.delete_key(key)
        self._stale = [f"ok/{q.qid}/{step}/{self.group}.{self.rank}"] + (
            [f"d/{q.qid}/{step}"] if q.members[0] == self.group and self.rank == 0 else [])
        return True

    def _decide(self, q: Quorum, step: int, ok: bool) -> bytes:
        key = f"d/{q.qid}/{step}"
        oks = [f"ok/{q.qid}/{step}/{g}.{r}" for g in q.members for r in range(self.ranks)]
        if ok:
            self.store.set(f"ok/{q.qid}/{step}/{self.group}.{self.rank}", "1")
        deadline = time.monotonic() + self.timeout_s
        verdict = b"abort"
        while ok and not self.store.check([key]):
            if self.store.check(oks):
                verdict = b"commit"
                break
            if time.monotonic() > deadline:  # a member never reduced: it died in between
                break
            time.sleep(0.001)
        self.store.compare_set(key, "", verdict)
        return bytes(self.store.get(key))

    def finish(self, step: int) -> None:
        """This group completed the job at ``step``: a group still joining stops instead of
        waiting for a quorum that will not come."""
        self.store.set("done", str(step))
        self.pg = None
