"""Replica mode (with and without spares) against restart mode, side by side, on one fault schedule.

A job of ``--groups`` workers (reference GPT, as bench/recovery.py) whose every forward pass
also sleeps ``--device-s`` seconds: simulated device time, as bench/ps.py does, so that a step
takes about as long as the issue's 0.3 s and the workers do not contend for the 2 shared cores
(a sleeping worker leaves the CPU to the others, as one waiting on its accelerator does). It runs
undisturbed, then with a SIGKILL every ``--every`` steps (of group 1, 2, 1, ... in turn) with
``fault.mode = "replica"`` and ``--spares`` spares, with no spare (the failure notice only, the
group's own restart replaces it), and with ``fault.mode = "restart"`` (async checkpoints every
``--ckpt`` steps). Figures per fault:

- survivor stall (replica): from the SIGKILL to group 0's next completed step (which includes
  the rest of the step it was training, and its redo: the killed step is discarded);
- replacement back (replica): from the SIGKILL to the killed group's next completed step;
- recovery (restart): from the SIGKILL to the restarted job's next completed step;
- goodput: the undisturbed run's wall time per step x ``run.steps`` / wall time of the faulted
  run, each from its first step's start to its last step's end. (The undisturbed median
  ``step_time`` is not the reference: it leaves out what every step boundary pays outside the
  timed step, logging and checkpoint saves, so the undisturbed run itself scored about 0.96.)
- timeline (replica): per fault, seconds after the SIGKILL of the watcher's notice, the
  survivors' failed all-reduce (group 0 starts to re-form), the quorum decided, its group
  connected and the heal done, the redone step's end; when the replacement (a spare, or the
  group's restart) holds the group and starts to form its quorum; and the excess of group 0's
  steps in the 20 s after the redone step over their median pace in the 20 s before the fault
  (the dead group's restart, which becomes the new spare, competes for the CPUs).

    python bench/replica.py [--faults 3] [--every 50] [--groups 3] [--spares 1] [--device-s 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # the workers import this module by name for the model

MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.seq_len=64"]
DEVICE_ENV = "ALLHANDS_BENCH_DEVICE_S"  # --device-s, inherited by the spawned workers


class DeviceTimed(torch.nn.Module):
    """The reference GPT plus a fixed sleep per forward pass in training: device time."""

    def __init__(self, inner: torch.nn.Module, device_s: float):
        super().__init__()
        self.inner, self.device_s = inner, device_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.device_s)
        return self.inner(x)


def device_timed_gpt(cfg) -> torch.nn.Module:
    from allhands.job import Job, build_data, build_reference_model

    vocab = build_data(cfg, Job())[2]
    return DeviceTimed(build_reference_model(cfg, vocab), float(os.environ[DEVICE_ENV]))


def steps_of(path: Path) -> list[tuple[int, float, float]]:
    """(step, wall time, step_time) of every training line of a metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [(r["step"], r["time"], r["step_time"]) for r in rows if "loss" in r and "time" in r]


def after(rows: list[tuple[int, float, float]], t: float) -> float | None:
    later = [w for _, w, _ in rows if w > t]
    return min(later) - t if later else None


def pace(rows: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(wall time from the first step's start to the last step's end, and per step)."""
    wall = rows[-1][1] - (rows[0][1] - rows[0][2])
    return wall, wall / (rows[-1][0] - rows[0][0] + 1)


def events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def timeline(run: Path, kills: list[float], killed: list[int], per_step: float) -> None:
    """One line per fault: where its seconds go (module docstring)."""
    from allhands.paths import group_dir

    notices = events(run / "replicas" / "notices.jsonl")
    g0 = events(run / "quorums.jsonl")
    rows0 = steps_of(run / "metrics.jsonl")
    for t, g in zip(kills, killed):
        notice = min((n["time"] for n in notices if n["time"] >= t), default=None)
        q = min((e for e in g0 if e["time"] > t), key=lambda e: e["time"], default=None)
        spare = min((e for e in events(group_dir(run, g) / "quorums.jsonl") if e["time"] > t),
                    key=lambda e: e["time"], default=None)
        if q is None:
            print(f"  fault at {t:.2f}: no quorum after it", flush=True)
            continue
        redo = min(w for _, w, _ in rows0 if w > q["time"])
        later = [w for _, w, _ in rows0 if redo <= w <= redo + 20]
        before = [w for _, w, _ in rows0 if t - 20 <= w < t]  # this run's own pace: the load varies
        own = statistics.median(b - a for a, b in zip(before, before[1:])) if len(before) > 2 else per_step
        excess = (later[-1] - later[0]) - own * (len(later) - 1) if len(later) > 1 else 0.0
        print(f"  group {g} killed: notice +{(notice or t) - t:.3f} s; survivor re-forms from "
              f"+{q['began'] - t:.3f}, decided +{q['formed'] - t:.3f}, connected and healed "
              f"+{q['time'] - t:.3f}, redone step done +{redo - t:.3f}"
              + (f"; replacement (spare or restart): holds the group +{spare.get('held', t) - t:.3f}, "
                 f"in form() +{spare['began'] - t:.3f}"
                 if spare else "") + f"; excess of the next 20 s of steps {excess:.2f} s", flush=True)


def _fmt(values: list[float | None]) -> str:
    return ", ".join(f"{v:.2f} s" if v is not None else "none" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--faults", 3), ("--every", 50), ("--ckpt", 10), ("--groups", 3), ("--spares", 1)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--device-s", type=float, default=0.3)
    ap.add_argument("--only", default="", help="comma-separated runs (undisturbed,replica,notice,restart)")
    args = ap.parse_args()

    import replica as this  # by its module name, so that the spawned workers find the model
    from allhands.config import load_config
    from allhands.faults import fired_at
    from allhands.job import Job
    from allhands.paths import group_dir
    from allhands.launch.launcher import LaunchSpec, train_job

    out = ROOT / "runs" / f"bench-replica-{time.strftime('%Y%m%d-%H%M%S')}"
    steps = args.every * (args.faults + 1)
    killed = [1 + i % (args.groups - 1) for i in range(args.faults)]
    inject = ",".join(f"{g}:{args.every * (i + 1)}:SIGKILL" for i, g in enumerate(killed))
    base = [*MODEL, f"run.steps={steps}", f"run.global_batch={4 * args.groups}", "run.eval_interval=0",
            "data.eval_batches=0", f"checkpoint.interval={args.ckpt}", "fault.backoff_s=0.5",
            "log.tensorboard=false", "log.progress=false", f"fault.max_restarts={args.faults + 1}"]
    os.environ[DEVICE_ENV] = str(args.device_s)
    runs = {"undisturbed": ["fault.mode=replica"],
            "replica": ["fault.mode=replica", f"fault.spares={args.spares}", f"fault.inject={inject}"],
            "notice": ["fault.mode=replica", f"fault.inject={inject}"],
            "restart": ["fault.mode=restart", f"fault.inject={inject}"]}
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only.split(",") or k == "undisturbed"}
    print(f"faults={args.faults} every={args.every} steps={steps} checkpoint every {args.ckpt} "
          f"groups={args.groups} spares={args.spares} device time {args.device_s} s per forward, "
          f"model={' '.join(MODEL)} global_batch={4 * args.groups} in {out}", flush=True)
    rows, walls = {}, {}
    for name, extra in runs.items():
        cfg = load_config(overrides=[*base, *extra, f"run.dir={out / name}"])
        t0 = time.time()
        train_job(cfg, LaunchSpec(nproc=args.groups), job=Job(model=this.device_timed_gpt))
        walls[name] = time.time() - t0
        rows[name] = steps_of(out / name / "metrics.jsonl")
    step_time = statistics.median(dt for _, _, dt in rows["undisturbed"])
    per_step = pace(rows["undisturbed"])[1]
    print(f"undisturbed median step time {step_time:.3f} s, wall time per step {per_step:.3f} s "
          f"(goodput by the median step time {steps * step_time / pace(rows['undisturbed'])[0]:.2f})", flush=True)
    for name in (n for n in runs if n != "undisturbed"):
        kills = sorted(t for k, t in fired_at(out / name).items())
        wall = pace(rows[name])[0]
        goodput = f"goodput {steps * per_step / wall:.2f} (by the median step time {steps * step_time / wall:.2f})"
        stalls = [after(rows[name], t) for t in kills]
        if name == "restart":
            print(f"{name}: {goodput}; recovery {_fmt(stalls)}; job {walls[name]:.0f} s", flush=True)
            continue
        back = [after(steps_of(group_dir(out / name, g) / "metrics.jsonl"), t) for g, t in zip(killed, kills)]
        known = [s for s in stalls if s is not None]
        print(f"{name}: {goodput}; survivor stall {_fmt(stalls)} (median "
              f"{statistics.median(known) if known else float('nan'):.2f} s); replacement back {_fmt(back)}; "
              f"job {walls[name]:.0f} s", flush=True)
        timeline(out / name, kills, killed, per_step)


if __name__ == "__main__":
    main()
