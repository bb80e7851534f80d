"""Parameter-server training, the server's side: one process owns a byte-balanced shard of the
parameters (wire.plan_shards) and their optimizer state, and serves the workers' pushes and
pulls until every worker is done (DistBelief's parameter server shard, Dean et al. 2012).

One request at a time, in arrival order (gloo's ``recv_anysource``):
- ``sync``: the W pushes of a step are kept per worker and summed in worker order (the same
  result whatever the arrival order, so a resume is exact), averaged, clipped by the norm of the
  whole average (a scalar all-reduce over the servers' own group), and applied; then every
  worker's pull is answered.
- ``async``: each push is clipped by the norm its worker sent and applied at once; a pull is
  answered at once. ``staleness`` counts the updates applied to this shard between the pushing
  worker's last pull and its push (Downpour's delay).
- ``ssp``: as async, but a worker's reply waits while its clock is more than ``max_staleness``
  ahead of the slowest active worker's (Ho et al. 2013); ``clock_gap`` records that distance
  when a worker is let go, so it never exceeds the bound.

Embedding tables (ps/rows.py): this server's row range of each, updated by row; a ROWS
request is answered at once with the current rows, in every mode (a worker in sync mode asks
for step t+1's rows only after step t's reply, so after step t's update).

Faults (``fault.inject``, RANK = the server's rank in the job): a server fails while applying
update STEP (its version + 1), as a worker fails mid-step; torch's elastic agent then restarts
every process, and the servers restore their shards from the last checkpoint. In replica mode
(requests over ps/links.py's per-worker links) a worker whose link fails is dropped: it
leaves the active set (ssp's slowest worker is among the others), its waiting replies go, a push
of it cut short is not applied; its replacement's first request makes it active again at the
clock it reports. A server that restarted alone (its own world, replica mode) starts with no
active worker: the live workers relink, the first one's INIT (with ``restore``) gives the layout
and the shard comes back from the latest committed checkpoint, and each worker is active again
from its next request, at the clock it reports, so the ssp bound holds among the relinked
workers and none waits for one that has not relinked.

Checkpoints: on worker 0's SAVE (sent when it saves), the shard (parameters, optimizer state,
version) goes through the job's Checkpointer over the servers' group; on INIT a server restores
the shard saved at the workers' resume step if it has one, else takes worker 0's values with
fresh optimizer state.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.stateful import Stateful

from allhands import collective
from allhands.config import Config
from allhands.faults import FaultInjector
from allhands.ps import links as ps_links, rows as ps_rows, wire as w
from allhands.ps.replies import Waiting, due_replies
from allhands.ps.shard import Shard, server_optimizer

__all__ = ["Server", "due_replies", "serve"]

SaveFn = Callable[[int, dict[str, Stateful]], None]
LoadFn = Callable[[int | None, dict[str, Stateful]], int | None]  # step (None: the latest) -> step loaded


class Server:
    def __init__(self, cfg: Config, roles: w.Roles, source: ps_links.AnySource | ps_links.Hub, *,
                 save: SaveFn | None, load: LoadFn | None, heartbeat: Any = None):
        self.cfg, self.q, self.roles, self.source, self.wire = cfg, cfg.ps, roles, source, source.wire
        self.save, self.load, self.heartbeat = save, load, heartbeat
        self.faults = FaultInjector(cfg.fault.inject, roles.rank, Path(cfg.run.dir))
        self.lr_scale = cfg.ps.lr / cfg.optim.lr if cfg.ps.lr else 1.0
        self.version = 0
        self.clocks = [0] * roles.n_workers
        # neither done nor lost; after a restart, linked again and heard from
        self.active = set(range(roles.n_workers)) if source.incarnation == 1 else set()
        self.done: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.tables: dict[int, ps_rows.RowShard] = {}  # by parameter index
        self.round: dict[int, torch.Tensor] = {}  # sync: this step's pushes by worker
        self.waiting: Waiting = []
        self.stats: dict[str, Any] = {"updates": 0, "pushes": 0, "pulls": 0, "skipped": 0,
                                      "bytes_in": 0, "bytes_out": 0, "busy_s": 0.0,
                                      "rows_fetched": 0, "rows_pushed": 0, "row_bytes_in": 0,
                                      "row_bytes_out": 0,
                                      "staleness": collections.Counter(),
                                      # seconds since start of each worker's pushes (throughput)
                                      "push_t": {k: [] for k in range(roles.n_workers)},
                                      "clock_gap": collections.Counter(),
                                      "lost": [],  # [worker, seconds since start]
                                      "restored": None}  # [step, version] a restart went on from

    # -- the loop
    def run(self) -> dict[str, Any]:
        t_start = self.t0 = time.perf_counter()
        idle_since = None  # when the last live worker was lost with others not done
        beaten = 0.0
        while len(self.done) < self.roles.n_workers:
            if self.heartbeat is not None and time.perf_counter() - beaten >= 0.5:  # the loop runs: alive
                self.heartbeat.beat(self.version)
                beaten = time.perf_counter()
            got = self.source.next(self.done)
            for k in self.source.finished - self.done:  # finished while this server restarted
                self.done.add(k)
                self.active.discard(k)
            if got is None:  # replica mode: nothing yet; give up on workers gone for too long
                idle_since = idle_since or time.perf_counter() if not self.active else None
                if idle_since and time.perf_counter() - idle_since > self.cfg.parallel.timeout_s:
                    break
                continue
            src, hdr = got
            t0 = time.perf_counter()
            try:
                if hdr is not None:  # None: its link closed
                    self.handle(src, hdr)
                    self.source.handled(src, last=bool(int(hdr[0]) & w.DONE))
            except RuntimeError as e:
                if not (self.source.rejoins and w.link_failed(e)):
                    raise
                hdr = None
            if hdr is None:
                self._lose(src)
            self._release()
            self.stats["busy_s"] += time.perf_counter() - t0
        self.stats["wall_s"] = time.perf_counter() - t_start
        if self.heartbeat is not None:
            self.heartbeat.beat(self.version, done=True)
        if self.save is not None and self.cfg.checkpoint.at_end and self.flat is not None:  # None: restarted
            # after every worker finished, so nothing to add to the last checkpoint
            self.save(max(self.clocks), {"ps": Shard(self)})
        return self.report()

    def handle(self, src: int, hdr: torch.Tensor) -> None:
        flags, clock = int(hdr[0]), int(hdr[1])
        if src in self.source.fresh:  # a new incarnation's first request: its predecessor's state is void
            self.source.fresh.discard(src)
            self.active.discard(src)
            self.waiting = [r for r in self.waiting if r[0] != src]
        if flags & w.INIT:
            self._init(src, clock, int(hdr[5]), restore=bool(hdr[6]))
            return
        if flags & w.DONE:
            self.active.discard(src)
            self.done.add(src)
            self.clocks[src] = clock
            return
        if flags & w.SAVE:
            if self.save is not None:
                self.save(clock, {"ps": Shard(self)})
            return
        if flags & w.ROWS:
            self._serve_rows(src, int(hdr[5]), int(hdr[6]))
            return
        if src not in self.active:  # a lost worker's replacement: it resumed at ``clock``
            self.active.add(src)
            self.clocks[src] = clock
        self.clocks[src] = max(self.clocks[src], clock)
        pull = bool(flags & w.PULL)
        if flags & w.PUSH:
            grad = self._recv(torch.empty_like(self.flat), src, w.TAG_GRAD)
            rows = self._recv_rows(src)
            self.stats["pushes"] += 1
            self.stats["push_t"][src].append(round(time.perf_counter() - self.t0, 6))
            if self.q.mode == "sync":
                self.round[src] = (grad, rows)
                self.waiting.append((src, clock, pull))
                if len(self.round) == self.roles.n_workers:
                    self._apply_round(float(hdr[2]))
                return
            self.stats["staleness"][self.version - int(hdr[4])] += 1
            self._update(grad, rows, float(hdr[2]), float(hdr[3]))
        if pull or flags & w.TICK:
            self.waiting.append((src, clock, pull))

    def _lose(self, k: int) -> None:
        """Replica mode: worker ``k``'s link failed (it died); serve the others without it."""
        if k in self.done:
            return
        self.active.discard(k)
        self.round.pop(k, None)
        self.waiting = [r for r in self.waiting if r[0] != k]
        self.stats["lost"].append([k, round(time.perf_counter() - self.t0, 3)])
        self.source.lost(k)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        if t.numel():  # an empty piece is never sent (ps.py)
            self.wire.recv(t, src, tag).wait()
            self.stats["bytes_in"] += t.numel() * t.element_size()
        return t

    def _init(self, src: int, clock: int, count: int, restore: bool) -> None:
        """The layout and values of this shard from a worker; then the checkpoint at ``clock``
        if there is one or, with ``restore`` (workers relinking to restarted servers), the latest.
        Only the first INIT counts: the others that restarted servers receive are read and dropped."""
        table = torch.empty(count, 6, dtype=torch.int64)
        self.wire.recv(table, src, w.TAG_INIT).wait()
        rows = table.tolist()
        dense = [r for r in rows if r[4] == 0]
        sizes = [r[2] - r[1] for r in dense]
        flat = self._recv(torch.empty(sum(sizes)), src, w.TAG_GRAD)
        sent = [r for r in rows if r[4] and r[5]]
        values = self._recv(torch.empty(sum((r[2] - r[1]) * r[4] for r in sent)), src, w.TAG_ROWS)
        if self.flat is not None:
            return
        self.flat = flat
        # Pieces are views of one flat buffer (what a pull sends); the optimizer steps them.
        self.pieces = [torch.nn.Parameter(v) for v in self.flat.split(sizes)]
        lr = self.cfg.ps.lr or self.cfg.optim.lr
        decay = [p for p, row in zip(self.pieces, dense) if row[3] >= 2]
        no_decay = [p for p, row in zip(self.pieces, dense) if row[3] < 2]
        self.opt = server_optimizer(self.cfg, decay, no_decay, lr) if self.pieces else None
        values = iter(values.split([(r[2] - r[1]) * r[4] for r in sent]))
        for param, start, stop, _, width, given in (r for r in rows if r[4]):
            init = (next(values).view(stop - start, width).clone() if given else
                    ps_rows.draw_rows(start, stop, width, self.q.row_init_std, self.cfg.run.seed * 7919 + param))
            self.tables[param] = ps_rows.RowShard(
                start, stop, init, lambda ps, lr=lr: server_optimizer(self.cfg, ps, [], lr))
        if not restore:  # restored servers learn each worker's clock from its next request
            self.clocks = [clock] * self.roles.n_workers
        if self.load is not None:
            step = self.load(None if restore else clock, {"ps": Shard(self)})
            for p in self.pieces:
                p.grad = None
            if restore:  # what this incarnation went on from (None: no checkpoint yet)
                self.stats["restored"] = None if step is None else [step, self.version]

    def _serve_rows(self, src: int, param: int, n: int) -> None:
        ids = self._recv(torch.empty(n, dtype=torch.int64), src, w.TAG_IDS)
        rows = self.tables[param].lookup(ids)
        self.wire.send(rows, src, w.TAG_ROWS).wait()
        self.stats["rows_fetched"] += n
        self.stats["row_bytes_in"] += ids.numel() * 8
        self.stats["row_bytes_out"] += rows.numel() * 4
        self.stats["bytes_out"] += rows.numel() * 4

    def _recv_rows(self, src: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A push's gradient rows: ``{table parameter: (global row ids, rows)}``."""
        if not self.tables:
            return {}
        counts = torch.empty(len(self.tables), dtype=torch.int64)
        self.wire.recv(counts, src, w.TAG_COUNTS).wait()
        widths = [t.rows.shape[1] for t in self.tables.values()]
        ids = self._recv(torch.empty(int(counts.sum()), dtype=torch.int64), src, w.TAG_IDS)
        vals = self._recv(torch.empty(sum(c * d for c, d in zip(counts.tolist(), widths))), src, w.TAG_ROWS)
        self.stats["rows_pushed"] += ids.numel()
        self.stats["row_bytes_in"] += ids.numel() * 8 + vals.numel() * 4
        return {k: (i, v.view(-1, d)) for k, i, v, d in zip(
            self.tables, ids.split(counts.tolist()), vals.split([c * d for c, d in zip(counts.tolist(), widths)]),
            widths)}

    def _release(self) -> None:
        """Answer the replies that ``due_replies`` lets go."""
        if self.flat is None:
            return
        go, self.waiting = due_replies(self.waiting, self.q.mode, set(self.round), self.clocks,
                                       self.active, self.q.max_staleness)
        for src, gap, pull in go:
            if self.q.mode == "ssp":
                self.stats["clock_gap"][gap] += 1
            try:
                self._reply(src, pull)
            except RuntimeError as e:
                if not (self.source.rejoins and w.link_failed(e)):
                    raise
                self._lose(src)

    def _reply(self, dst: int, with_params: bool) -> None:
        self.wire.send(torch.tensor([self.version, 0, 0, 0], dtype=torch.float64), dst, w.TAG_REP).wait()
        if with_params:
            self.stats["pulls"] += 1
            if self.flat.numel():
                self.stats["bytes_out"] += self.flat.numel() * self.flat.element_size()
                self.wire.send(self.flat, dst, w.TAG_PARAM).wait()

    # -- updates
    def _apply_round(self, lr: float) -> None:
        n = self.roles.n_workers
        total = self.round[0][0].clone()
        for k in range(1, n):
            total += self.round[k][0]
        total /= n
        rows = {}  # each table's rows summed in worker order (index_add_ in order), averaged
        for t in self.tables:
            ids, g = ps_rows.coalesce(torch.cat([self.round[k][1][t][0] for k in range(n)]),
                                      torch.cat([self.round[k][1][t][1] for k in range(n)]))
            rows[t] = (ids, g / n)
        self.round = {}
        sq = torch.nn.utils.get_total_norm(list(total.split([p.numel() for p in self.pieces])) +
                                           [g for _, g in rows.values()]) ** 2
        if self.roles.n_servers > 1:
            # the norm of the whole averaged gradient, over every server's shard
            collective.all_reduce(sq, call="parameter server norm")
        self._update(total, rows, lr, float(sq.sqrt()))

    @torch.no_grad()
    def _update(self, grad: torch.Tensor, rows: dict[int, tuple[torch.Tensor, torch.Tensor]],
                lr: float, norm: float) -> None:
        self.faults.after_forward(self.version + 1, torch.zeros(()))  # fault.inject on a server
        if not torch.isfinite(torch.tensor(norm)):
            self.stats["skipped"] += 1  # as the loop's guard skips a non-finite step
            return
        for p, g in zip(self.pieces, grad.split([p.numel() for p in self.pieces])):
            p.grad = g
        touched = [(self.tables[t], ids, self.tables[t].param(ids, g)) for t, (ids, g) in rows.items() if len(ids)]
        clip = self.cfg.optim.grad_clip
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.pieces + [q for _, _, q in touched], clip,
                                                 torch.tensor(norm))
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr * self.lr_scale
            self.opt.step()
        for shard, ids, q in touched:
            shard.step(q, ids, lr * self.lr_scale)
        for p in self.pieces:
            p.grad = None
        self.version += 1
        self.stats["updates"] += 1

    def report(self) -> dict[str, Any]:
        out = dict(self.stats)
        for k in ("staleness", "clock_gap"):
            out[k] = {str(v): n for v, n in sorted(self.stats[k].items())}
        out.update(server=self.roles.index, shard_bytes=self.flat.numel() * 4 if self.flat is not None else 0,
                   table_bytes=sum(t.rows.numel() * 4 for t in self.tables.values()), version=self.version,
                   joins=self.source.joins, incarnation=self.source.incarnation,
                   incarnations=self.source.incarnations() if self.source.rejoins else [])
        return out


def serve(cfg: Config, roles: w.Roles, source: ps_links.AnySource | ps_links.Hub, run_dir: Path, *,
          save: SaveFn | None = None, load: LoadFn | None = None, heartbeat: Any = None) -> dict[str, Any]:
    """Run this server until every worker is done; its statistics go to ``ps/server<i>.json``
    in the run directory (per-server load, bytes, staleness histogram, push times), and its
    load and bytes as one line of metrics.jsonl (appended after worker 0 closed it: the servers
    finish only after every worker's loop has)."""
    stats = Server(cfg, roles, source, save=save, load=load, heartbeat=heartbeat).run()
    out = run_dir / "ps"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"server{roles.index}.json").write_text(json.dumps(stats, indent=1) + "\n")
    line = {"step": stats["version"], "ps_server": roles.index,
            "ps_load": stats["busy_s"] / max(stats["wall_s"], 1e-12),
            **{f"ps_{k}": stats[k] for k in ("updates", "pushes", "pulls", "bytes_in", "bytes_out",
                                             "rows_fetched", "rows_pushed", "staleness", "clock_gap")},
            "time": time.time()}
    with open(run_dir / "metrics.jsonl", "a") as f:  # one write of one line: O_APPEND keeps it whole
        f.write(json.dumps(line) + "\n")
    return stats
