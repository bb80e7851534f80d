"""Parameter-server training, the worker's side: push gradients to the servers that own each
piece of the parameters, pull the parameters back (DistBelief, Dean et al. 2012).

The servers (ps/server.py) hold the parameters cut into byte-balanced pieces
(wire.plan_shards) and their optimizer state, and apply every update. A worker keeps a full
replica for forward/backward; its own optimizer never steps (``attach_optimizer`` makes
``optimizer.step`` a no-op, as torchft wraps the step), so the training loop is unchanged:

- after the backward of the step's last micro-batch (``micro_step``) the worker sends each
  server its gradient pieces with the step's learning rate and the gradient's global norm
  (torch's ``get_total_norm``, so the server clips like ``clip_grad_norm_``);
- after the step (``after_step``) it receives the parameters it asked for and copies them in.

Embedding tables (ps/rows.py, ``ps.sparse``) are not replicated: their modules fetch the
rows a batch uses from the servers at forward, and a push carries only those rows' gradients.

``ps.mode``:
- ``sync``: every step; a server averages the W workers' gradients, clips by the norm of the
  average (one all-reduce of a scalar among servers) and steps: DDP's update.
- ``async`` (Downpour SGD): gradients summed locally and pushed every ``push_every`` steps, each
  push applied on arrival with its own clipping; parameters pulled every ``fetch_every`` steps.
  Nobody waits for another worker.
- ``ssp`` (stale synchronous parallel, Ho et al. 2013): async, but every step the worker reports
  its clock and a worker more than ``max_staleness`` steps ahead of the slowest waits for the reply.

Exactness: one async worker with push/fetch every step computes each gradient on the latest
parameters, so it trains exactly like one process (the servers' AdamW is elementwise, so pieces
of a tensor update like the tensor).
"""

from __future__ import annotations

import contextlib
import time
import types
from typing import Any

import torch
import torch.nn as nn

from allhands import collective
from allhands.config import PSConfig
from allhands.mesh import Mesh
from allhands.ps import links as ps_links, rows as ps_rows, wire as w
from allhands.ps.messages import ServerMessages
from allhands.sync.base import SyncStrategy


class PSSync(ServerMessages, SyncStrategy):
    name = "ps"
    reconciles_replicas = True  # the servers do; parallelize() must not add DDP

    def __init__(self, q: PSConfig, roles: w.Roles, *, total_steps: int, timeout_s: float):
        super().__init__()
        self.q, self.roles, self.total, self.timeout_s = q, roles, total_steps, timeout_s
        self.mode = q.mode
        self.lockstep = q.mode == "sync"
        self.clock = 0  # completed steps (checkpointed under ``sync``)
        self.version = [0] * roles.n_servers  # each server's update count of the last pull
        self.started = False
        self.done = False
        self._loading = False
        self._acc: list[torch.Tensor] | None = None  # async: gradients summed since the last push
        self._acc_rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # and the tables'
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, list[Any]]] = []
        self.broken: set[int] = set()  # replica mode: servers whose link failed, until relinked
        self.faults = None  # the worker's FaultInjector (a ``ps-push`` fault), set by worker.py
        # replica mode: the worker's heartbeat, kept fresh while it waits on a server (a stopped
        # server is its own world's to find; ps/start.py)
        self.heartbeat: Any = None

    def describe(self) -> str:
        q = self.q
        how = {"sync": "sync (averaged every step)",
               "async": f"async (push every {q.push_every}, fetch every {q.fetch_every})",
               "ssp": f"ssp (max staleness {q.max_staleness}, push every {q.push_every}, "
                      f"fetch every {q.fetch_every})"}[q.mode]
        return (f"ps: {self.roles.n_workers} workers, {self.roles.n_servers} servers, {how}; "
                f"server optimizer {q.optimizer}")

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        r = self.roles
        self.mesh = mesh
        if r.links is not None:  # replica mode: links of this incarnation (ps/links.py)
            self.wire, self.life, self.slife = ps_links.join(r, mesh, self.timeout_s)
        else:
            pg = mesh.cross_role_group(r.cross_store, r.rank, r.world, self.timeout_s)
            self.wire, self.life = w.Wire({s: (pg, r.server_rank(s)) for s in range(r.n_servers)}), 1
        # Pull before the first forward: a replacement's first gradient is then of the servers'
        # parameters, not of those in its checkpoint.
        self._hook = model.register_forward_pre_hook(lambda m, args: None if self.started else self._start())
        self.tables = ps_rows.detach_tables(model, self.q.sparse)
        for t in self.tables:
            t.fetch = self._fetch
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("parallel.sync=ps: the servers hold fp32 parameters")
        # tables are planned in rows (parameter index n_dense + table index), the rest in elements
        n = self.n_dense = len(self.params)
        self.plan = w.plan_shards([p.numel() for p in self.params] + [t.rows for t in self.tables],
                                  [p.element_size() for p in self.params] + [t.dim * 4 for t in self.tables],
                                  r.n_servers)
        self.mine = [[p for p in w.server_pieces(self.plan, s) if p.param < n] for s in range(r.n_servers)]
        self.row_pieces = [[p for p in w.server_pieces(self.plan, s) if p.param >= n]
                           for s in range(r.n_servers)]
        return model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # The update happens on the servers. A bound method: LR schedulers wrap ``step`` through
        # its ``__func__``.
        optimizer.step = types.MethodType(lambda opt, closure=None: None, optimizer)

    # -- the step
    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return self._after_backward() if last else contextlib.nullcontext()

    def _due(self, every: int, clock: int) -> bool:
        return self.mode == "sync" or clock % every == 0 or clock >= self.total

    @contextlib.contextmanager
    def _after_backward(self):
        yield
        if not self.started:
            self._start()
        if self.broken:  # a server restarted during the last exchange's save or fetch
            self._recover()
        clock = self.clock + 1  # the step whose gradient this is
        grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        rows = [t.take_grads() for t in self.tables]
        summed = self._acc is not None
        if summed:
            grads = [a.add_(g) for a, g in zip(self._acc, grads)]
            rows = [ps_rows.coalesce(torch.cat([a[0], r[0]]), torch.cat([a[1], r[1]]))
                    for a, r in zip(self._acc_rows, rows)]
        push = self._due(self.q.push_every, clock)
        self._acc = None if push else grads if summed else [g.clone() for g in grads]
        self._acc_rows = None if push else rows
        pull = self._due(self.q.fetch_every, clock)
        flags = (w.PUSH if push else 0) | (w.PULL if pull else 0) | (w.TICK if self.mode == "ssp" else 0)
        if not flags:
            return
        # the norm of the whole gradient as torch's clip_grad_norm_ computes it, for the server's clip
        norm = float(torch.nn.utils.get_total_norm(grads + [g for _, g in rows])) if push else 0.0
        flats = [self._gather(s, grads) for s in range(self.roles.n_servers)] if push else []
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        # Every server's request and reply are posted before any is waited on: gloo's send
        # completes only once the receiver has posted its receive, so waiting on each server in
        # turn would chain the servers' queues and make a second server slower, not faster.
        kill = self.faults.push_hook(clock) if push and self.faults is not None else None
        sent = []
        for s in range(self.roles.n_servers):
            if kill is not None and s == self.roles.n_servers - 1:
                # fault ``ps-push``: every other server's push complete, this one's header only
                self._wait(sent + [(s, self.wire.send(w.request(flags, clock, lr, norm), s, w.TAG_REQ),
                                    None, False)])
                kill()
            sent += self._request(s, w.request(flags, clock, lr, norm, self.version[s]),
                                  flats[s] if push else None, rows if push else None, wait=False)
            if pull or self.mode == "ssp":
                self._expect(s, pull)
        self._wait(sent)
        self.comm.blocking(time.perf_counter() - t0)

    def after_step(self, step: int) -> None:
        self.clock = step
        t0 = time.perf_counter()
        self._receive()
        if step >= self.total:  # the last step always pushed and pulled: no save to request
            self.done = True
        self.comm.blocking(time.perf_counter() - t0)

    def finish(self) -> None:
        """After the loop (its last evaluation fetches rows too): release the servers, a
        restarted one too; then (replica mode) say so in the link store."""
        left = set(range(self.roles.n_servers))
        while left:
            for s in sorted(left):
                self._request(s, w.request(w.DONE, self.clock))
            left = set(self.broken)
            self._recover(pull=False)
        if self.roles.links is not None:
            ps_links.finished(self.roles)

    def in_sync(self, step: int) -> bool:
        return self.mode == "sync"

    def _fetch(self, table: ps_rows.Table, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (sorted, unique) of ``table``, from the servers holding them; a
        server that restarted meanwhile is relinked and asked again."""
        if not self.started:  # the first forward (or the first evaluation) may come before a push
            self._start()
        t0 = time.perf_counter()
        param, got = self.n_dense + table.index, []
        for s in range(self.roles.n_servers):
            for p in (p for p in self.row_pieces[s] if p.param == param):
                lo, hi = torch.searchsorted(ids, torch.tensor([p.start, p.stop], device=ids.device)).tolist()
                if hi == lo:
                    continue
                buf = collective.host_empty((hi - lo, table.dim), torch.float32, pinned=ids.device.type != "cpu")
                while True:  # parameters are pulled at the next step: this is mid-forward
                    self._request(s, w.request(w.ROWS, self.clock, count=param, rows=hi - lo))
                    self._send(ids[lo:hi].contiguous(), s, w.TAG_IDS)
                    if self._wait([(s, self._io(self.wire.recv, buf, s, w.TAG_ROWS), buf, True)]):
                        break
                    self._recover(pull=False)
                got.append(buf)
        self.comm.blocking(time.perf_counter() - t0)
        return (torch.cat(got) if got else torch.empty(0, table.dim)).to(ids.device)  # the rows' device: the ids'

    def _recover(self, pull: bool = True) -> None:
        """Relink to each restarted server (replica mode: its world restarted alone and restores
        its shard from its last checkpoint): give it the layout (``_init_server``, restore), then
        pull its parameters, unless mid-forward (``pull=False``: the next step's pull does)."""
        while self.broken:
            s = min(self.broken)
            self.broken.discard(s)
            with self._waiting():  # for the server's world to restart it
                self.slife[s] = ps_links.relink(self.roles, self.mesh, self.wire, self.life, s,
                                                self.slife[s], self.timeout_s)
            self._init_server(s, restore=True)
            if pull:
                self._request(s, w.request(w.PULL, self.clock))
                self._expect(s, True)
                self._collect()

    def _init_server(self, s: int, restore: bool) -> None:
        """Give server ``s`` its pieces' layout and this worker's values; ``restore``: the
        server goes on from its latest checkpoint rather than the one at this clock."""
        # per piece: parameter, start, stop, dims, row width (tables), values follow (tables)
        table = torch.tensor([[p.param, p.start, p.stop, self.params[p.param].dim(), 0, 1]
                              for p in self.mine[s]] +
                             [[p.param, p.start, p.stop, 2, t.dim, int(t.values is not None)]
                              for p in self.row_pieces[s]
                              for t in [self.tables[p.param - self.n_dense]]],
                             dtype=torch.int64).reshape(-1, 6)
        self._request(s, w.request(w.INIT, self.clock, count=len(table), rows=int(restore)))
        self._wait([(s, self._io(self.wire.send, table, s, w.TAG_INIT), table, False)])  # even if empty
        self._send(self._gather(s, self.params), s, w.TAG_GRAD)
        values = [t.values[p.start:p.stop].reshape(-1) for p in self.row_pieces[s]
                  for t in [self.tables[p.param - self.n_dense]] if t.values is not None]
        if values:
            self._send(torch.cat(values), s, w.TAG_ROWS)

    def _start(self) -> None:
        """Worker 0 gives each server its pieces' layout and values (a server that restores its
        shard from its own checkpoint keeps those); then every worker pulls, so all replicas start
        from the servers' values. A replacement (replica mode) only pulls."""
        self.started = True
        self._hook.remove()
        if self.roles.index == 0 and self.life == 1:
            for s in range(self.roles.n_servers):
                self._init_server(s, restore=False)
        for t in self.tables:
            t.values = None  # the servers hold the table now
        for s in range(self.roles.n_servers):
            self._request(s, w.request(w.PULL, self.clock))
            self._expect(s, True)
        self._receive()

    # -- checkpoint: the clock here; the servers save their shards when worker 0 saves
    def state_dict(self) -> dict[str, Any]:
        if self.roles.index == 0 and self.started and not self.done and not self._loading:
            for s in range(self.roles.n_servers):
                self._request(s, w.request(w.SAVE, self.clock))
        return {"clock": torch.tensor(self.clock)}

    def saved_keys(self, keys: set[str]) -> None:
        self._loading = True  # the next state_dict is the load's template, not a save

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loading = False
        self.clock = int(state["clock"])
