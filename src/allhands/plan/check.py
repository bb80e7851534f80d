"""``allhands plan --check``: train each layout that fits this machine for a few steps with the
real launcher and put the plan's per-rank memory and step time beside the measured ones
(metrics.jsonl: the training-state bytes of every rank, the peak memory, the step times)."""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from allhands.config import Config, apply_override
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.plan.cluster import Cluster
from allhands.plan.estimate import Estimate
from allhands.plan.search import with_layout

# A step shorter than this is timed mostly by the scheduler on a loaded CPU, not by its compute
# and communication: a time slice lost by one worker stalls its peer's collectives for as long.
SHORT_STEP = 0.020

# No evaluation, checkpoint or progress bar: the steps and the memory record only.
QUIET = ["run.eval_interval=0", "data.eval_batches=0", "checkpoint.interval=0",
         "checkpoint.at_end=false", "log.progress=false", "log.tensorboard=false", "log.interval=1",
         "fault.max_restarts=0"]  # a layout that fails is a finding, not a fault to restart


@dataclass
class Checked:
    estimate: Estimate
    state_rank: list[float]  # measured training-state bytes per rank
    peak: float  # measured peak memory of the busiest rank
    peak_kind: str
    step_time: float  # the fastest measured step after the warm-up steps (calibrate.py's statistic)
    step_median: float = 0.0  # their median, for the record

    def predicted_state_rank(self) -> list[float]:
        """The plan's state bytes for each rank (pp is the outermost mesh dim)."""
        per_stage = len(self.state_rank) // self.estimate.layout.pp
        return [self.estimate.state_rank[r // per_stage] for r in range(len(self.state_rank))]

    def state_error(self) -> float:
        """The largest relative error of the predicted state bytes over the ranks."""
        return max(abs(p - m) / m for p, m in zip(self.predicted_state_rank(), self.state_rank))

    def row(self) -> dict:
        e = self.estimate
        return {"layout": e.layout.name(), "state_pred_mib": max(self.predicted_state_rank()) / 2**20,
                "state_meas_mib": max(self.state_rank) / 2**20, "state_err": self.state_error(),
                "peak_pred_mib": e.memory["total"] / 2**20, "peak_meas_mib": self.peak / 2**20,
                "peak_kind": self.peak_kind, "step_pred_ms": 1e3 * e.time["step"],
                "step_meas_ms": 1e3 * self.step_time, "step_median_ms": 1e3 * self.step_median}


def run_layout(cfg: Config, est: Estimate, nproc: int, run_dir: Path, steps: int) -> Checked:
    job = with_layout(cfg, est.layout)
    for item in (*QUIET, f"run.steps={steps}", f"run.dir={run_dir}", "optim.warmup_steps=1"):
        apply_override(job, item)
    done = train_job(job, LaunchSpec(nproc=nproc))
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines() if x]
    mem = next(r for r in rows if "memory_params_bytes" in r)
    state = [float(sum(v)) for v in zip(mem["memory_params_bytes"], mem["memory_grads_bytes"],
                                       mem["memory_optim_bytes"])]
    steps_rows = [r for r in rows if "loss" in r]
    warm = steps_rows[min(2, len(steps_rows) - 1):]  # the first steps build buckets and caches
    times = [r["step_time"] for r in warm]
    return Checked(est, state, max(max(r["peak_mem_bytes_rank"]) for r in steps_rows),
                   steps_rows[-1]["peak_mem_kind"], min(times), statistics.median(times))


def check(cfg: Config, estimates: list[Estimate], cluster: Cluster, *, steps: int = 6,
          limit: int = 0, refresh: Callable[[Estimate], Estimate] | None = None) -> list[Checked]:
    """Run every feasible estimate (at most ``limit`` when > 0) on ``cluster.per_node`` local
    workers, each in its own run directory under a temporary folder. ``refresh``, when given,
    predicts each layout again right before it runs (calibrate.recalibrated: the machine measured
    anew), so that on a shared machine the prediction and the run see the same load."""
    todo = [e for e in estimates if e.feasible][: limit or None]
    out = []
    with tempfile.TemporaryDirectory(prefix="allhands-plan-check-") as tmp:
        for i, est in enumerate(todo):
            est = refresh(est) if refresh else est
            out.append(run_layout(cfg, est, cluster.per_node, Path(tmp) / f"layout-{i}", steps))
    return out


def format_check(rows: list[Checked]) -> str:
    head = (f"{'layout':<28} {'state MiB pred/meas':>21} {'err':>6} {'peak MiB pred/meas':>21} "
            f"{'step ms pred/best':>19} {'ratio':>6} {'median':>7}")
    lines = [head, "-" * len(head)]
    for c in rows:
        r = c.row()
        lines.append(f"{r['layout']:<28} {r['state_pred_mib']:>10.2f}/{r['state_meas_mib']:<10.2f} "
                     f"{100 * r['state_err']:>5.1f}% {r['peak_pred_mib']:>10.1f}/{r['peak_meas_mib']:<10.1f} "
                     f"{r['step_pred_ms']:>9.1f}/{r['step_meas_ms']:<9.1f} "
                     f"{r['step_pred_ms'] / r['step_meas_ms']:>6.2f} {r['step_median_ms']:>7.1f}")
    if rows:
        lines.append(f"(peak measured as {rows[0].peak_kind}; state = parameters + gradients + "
                     f"optimizer state after step 1, per rank, the busiest shown; step = the fastest "
                     f"after the first 2, as the calibration times its probes; median beside it)")
    if short := [c.row()["layout"] for c in rows if c.step_time < SHORT_STEP]:
        lines.append(f"note: steps under {1e3 * SHORT_STEP:.0f} ms ({', '.join(short)}) are not timed reliably "
                     f"on a loaded CPU; a larger model or run.global_batch checks their step time")
    return "\n".join(lines)
