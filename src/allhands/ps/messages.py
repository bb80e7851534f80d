"""The worker's messages to and from the servers: gradient pieces and embedding rows out, replies
and parameters in, each over the link to the server that owns them (wire.py), with a failed link
remembered rather than raised in replica mode (the server restarts alone and the worker relinks:
client.py ``_recover``). A mixin of ``PSSync``, which holds what these methods read:
``roles``, ``wire``, ``comm`` (the CommMeter), ``mine`` and ``row_pieces`` (each server's pieces),
``params``, ``tables``, ``n_dense``, ``version``, ``broken`` and ``_pending``."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from allhands import collective
from allhands.ps import wire as w


class ServerMessages:
    def _gather(self, s: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Server ``s``'s pieces of ``tensors`` (one per parameter), as one flat fp32 buffer."""
        return torch.cat([tensors[p.param].detach().reshape(-1)[p.start:p.stop] for p in self.mine[s]]
                         or [torch.empty(0)])

    def _moved(self, t: torch.Tensor) -> None:
        # bytes moved point-to-point: an all_gather over 2 ranks counts payload once on the wire
        self.comm.collective("all_gather", t.numel() * t.element_size(), 2)

    def _send(self, t: torch.Tensor, dst: int, tag: int, posted: list | None = None) -> None:
        """Send ``t`` and wait; with ``posted``, only post the send there (``_wait`` waits)."""
        if t.numel():  # gloo pairs every send with a receive; an empty piece is neither
            work = (dst, self._io(self.wire.send, t, dst, tag), t, True)
            if posted is None:
                self._wait([work])
            else:
                posted.append(work)

    def _io(self, op, t: torch.Tensor, s: int, tag: int) -> dist.Work | None:
        """Post a send or receive (``op``) with server ``s``; None once its link failed."""
        if s in self.broken:
            return None
        try:
            return op(t, s, tag)
        except RuntimeError as e:
            self._broke(s, e)
            return None

    def _broke(self, s: int, e: RuntimeError) -> None:
        """Server ``s``'s link failed: in replica mode its server restarts alone and this worker
        relinks (``_recover``); otherwise the job restarts, so the error stands."""
        if self.roles.links is None or not w.link_failed(e):
            raise e
        self.broken.add(s)

    def _waiting(self) -> contextlib.AbstractContextManager:
        """Replica mode: the worker's heartbeat stays fresh while it waits on a server, whose own
        world's watchdog judges it (ps/start.py sets ``heartbeat``)."""
        hb = getattr(self, "heartbeat", None)
        return hb.waiting() if hb is not None else contextlib.nullcontext()

    def _wait(self, posted: list[tuple[int, dist.Work | None, torch.Tensor, bool]]) -> bool:
        """Wait for posted sends (each holds its tensor until then) and count their payload;
        False if a link failed."""
        for s, work, t, payload in posted:
            try:
                if s in self.broken or work is None:
                    continue
                with self._waiting():
                    work.wait()
            except RuntimeError as e:
                self._broke(s, e)
                continue
            if payload:
                self._moved(t)
        return not any(s in self.broken for s, _, _, _ in posted)

    def _request(self, s: int, header: torch.Tensor, payload: torch.Tensor | None = None,
                 rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 wait: bool = True) -> list[tuple[int, dist.Work | None, torch.Tensor, bool]]:
        """Send server ``s`` a request; ``wait=False`` returns its posted sends, not waited on."""
        dst = s
        posted = [(s, self._io(self.wire.send, header, dst, w.TAG_REQ), header, False)]
        if payload is not None:
            self._send(payload, dst, w.TAG_GRAD, posted)
        if rows is not None and self.row_pieces[s]:
            # per table piece of this server: the touched ids in its range and their gradient rows
            ids, vals = [], []
            for p in self.row_pieces[s]:
                i, g = rows[p.param - self.n_dense]
                lo, hi = torch.searchsorted(i, torch.tensor([p.start, p.stop], device=i.device)).tolist()
                ids.append(i[lo:hi])
                vals.append(g[lo:hi].reshape(-1))
            counts = torch.tensor([len(i) for i in ids], dtype=torch.int64)
            posted.append((s, self._io(self.wire.send, counts, dst, w.TAG_COUNTS), counts, False))
            self._send(torch.cat(ids), dst, w.TAG_IDS, posted)
            self._send(torch.cat(vals), dst, w.TAG_ROWS, posted)
        if not wait:
            return posted
        self._wait(posted)
        return []

    def _expect(self, s: int, with_params: bool) -> None:
        """Post the receive of server ``s``'s reply (and parameters) now; ``_receive`` waits."""
        rep = torch.empty(w.REP_LEN, dtype=torch.float64)
        works = [self._io(self.wire.recv, rep, s, w.TAG_REP)]
        # the parameters arrive on the host (gloo), pinned for their copy to a GPU's replica
        buf = collective.host_empty(sum(p.numel for p in self.mine[s]) if with_params else 0, torch.float32,
                                    pinned=bool(self.params) and self.params[0].device.type != "cpu")
        if buf.numel():
            works.append(self._io(self.wire.recv, buf, s, w.TAG_PARAM))
        self._pending.append((s, rep, buf, works))

    def _receive(self) -> None:
        self._collect()
        self._recover()

    @torch.no_grad()
    def _collect(self) -> None:
        """Wait for the posted replies; copy in the parameters of each whose link held."""
        for s, rep, buf, works in self._pending:
            if not self._wait([(s, work, buf, False) for work in works]):
                continue
            if buf.numel():
                self.version[s] = int(rep[0])
                self._moved(buf)
                for p, v in zip(self.mine[s], buf.split([p.numel for p in self.mine[s]])):
                    self.params[p.param].view(-1)[p.start:p.stop].copy_(v)
        self._pending = []
