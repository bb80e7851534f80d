"""The metrics record of a logged step: one small all_gather of every rank's loss, step time,
peak memory and the communication it recorded since the last logged step. The same all_gather
carries each rank's stop request (agree.py), so a logged step needs no collective of its own
for it; a step that does not log calls nothing here."""

from __future__ import annotations

import time
from typing import Any

import torch

from allhands import collective
from allhands.env import gloo_interface
from allhands.memory import peak_memory
from allhands.mesh import Mesh
from allhands.metrics import iface_tx_bytes


class StepLog:
    """Accumulates the steps between two logged ones and gathers the record at a logged one."""

    def __init__(self, mesh: Mesh, global_batch: int):
        self.mesh, self.global_batch = mesh, global_batch
        # One rank per node reads the interface counter: it counts the whole node's traffic.
        self._tx_at_log = iface_tx_bytes(gloo_interface()) if mesh.node_local_rank == 0 else None
        self.net_iface = gloo_interface() if self._tx_at_log is not None else None
        self._window = [0, 0.0]  # steps, summed step seconds since the last logged step
        self.agreed: tuple[int, float] = (0, 0.0)  # the last gather's (stop signal, step time)

    @property
    def window_steps(self) -> int:
        """Steps since the last logged one, this one included."""
        return self._window[0]

    def step_done(self, dt: float) -> None:
        self._window[0] += 1
        self._window[1] += dt

    def gather(self, *, step: int, loss_sum: torch.Tensor, gnorm: torch.Tensor, dt: float,
               comm: tuple[float, float, float, float], reports_loss: bool, lr: float,
               tokens_per_sample: int | None, counters: dict[str, int],
               stop_signal: int = 0) -> dict[str, Any]:
        """The record (collective: every rank calls it). The loss is the mean over the ranks
        that hold one (last pipeline stage, tp rank 0); ``comm``: the strategy's
        ``comm.take()`` (bytes from the collectives' sizes, seconds in flight and exposed), to
        which the lab adds the interface's counter; ``counters``: the run's fault counters;
        ``stop_signal``: this rank's stop request, agreed (the largest) in ``self.agreed``."""
        peak, peak_kind = peak_memory(self.mesh.device)
        payload, wire, comm_s, exposed_s = comm
        tx = iface_tx_bytes(self.net_iface)
        sent = tx - self._tx_at_log if tx is not None and self._tx_at_log is not None else 0.0
        self._tx_at_log = tx
        steps, window_s = self._window
        self._window = [0, 0.0]
        mine = torch.tensor([float(loss_sum), dt, payload, wire, comm_s, exposed_s, sent, window_s,
                             peak, float(reports_loss), float(stop_signal)], dtype=torch.float64,
                            device=collective.device())
        gathered = [torch.empty_like(mine) for _ in range(self.mesh.world_size)]
        collective.all_gather(gathered, mine, call="steplog")
        g = torch.stack(gathered).cpu()  # (world, 11)
        losses = g[g[:, 9] > 0, 0].tolist()
        times = g[:, 1].tolist()
        per_step = max(steps, 1)
        step_time = max(times)
        self.agreed = (int(g[:, 10].max()), step_time)  # alike on every rank: the same gathered rows
        samples_per_s = self.global_batch / step_time
        record = {
            "step": step, "loss": sum(losses) / len(losses), "lr": lr, "grad_norm": float(gnorm),
            "samples_per_s": samples_per_s,
            "step_time": step_time, "step_time_rank": times, "time": time.time(),
            "peak_mem_bytes_rank": [int(v) for v in g[:, 8].tolist()], "peak_mem_kind": peak_kind,
            **counters,
            # Per step, averaged over the steps since the last logged one (DiLoCo: 1/H of a round).
            "comm_bytes": float(g[:, 2].mean()) / per_step,       # collective payload per rank
            "comm_wire_bytes": float(g[:, 3].mean()) / per_step,  # ring lower bound per rank
            "comm_time": float(g[:, 4].max()) / per_step,
            "comm_exposed": float(g[:, 5].max()) / per_step,
            "comm_exposed_frac": float((g[:, 5] / g[:, 7].clamp_min(1e-12)).max()),
        }
        if tokens_per_sample and tokens_per_sample > 1:  # token data: tokens/s as well
            record["tokens_per_s"] = samples_per_s * tokens_per_sample
        if self.net_iface is not None or float(g[:, 6].sum()) > 0:
            record["net_tx_bytes"] = float(g[:, 6].sum()) / per_step  # all nodes' interfaces
        return record
