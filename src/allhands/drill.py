"""``allhands drill``: prove recovery on a real job.

Runs the job twice from the same config: undisturbed, then with ``N`` seeded faults (``plan_faults``:
SIGKILLs mid-step on random ranks, every third one inside a checkpoint write) and automatic
recovery. Then prints, per fault: when it fired, how long until the launcher saw the failure
(detection), how long until the restarted job completed its next step (recovery), how many
completed steps were lost and recomputed, and whether the final parameters equal the undisturbed
run's bit for bit. The plan is printed as a ``fault.inject`` spec, so any drill replays exactly.

With ``fault.mode = "replica"`` a fault kills one replica group and the others carry on, so the
table says instead, per fault: the survivors' stall (from the kill to a survivor's next completed
step), the heal (the replacement's quorum and state transfer, from its ``quorums.jsonl``), how long
until the killed group trained again, and whether every group's final parameters are bit-equal
(an undisturbed replica run equals a disturbed one only up to where the shares are summed).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from allhands.checkpoint import committed, load_weights
from allhands.paths import group_dir, restart_logs
from allhands.config import Config
from allhands.errors import ConfigError
from allhands.faults import Fault, fired_at, plan_faults
from allhands.launch.launcher import train_job
from allhands.job import Job, build_data, build_reference_model


@dataclass
class FaultRow:
    fault: Fault
    fired: float | None = None
    detected_s: float | None = None
    recovered_s: float | None = None
    resumed_from: int | None = None
    recomputed: int | None = None


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "loss" in r]


def restarts(run_dir: Path) -> list[dict]:
    """Every world's restart records (paths.restart_logs), each with its ``world``, by time."""
    out = [{**json.loads(line), "world": world} for world, path in restart_logs(run_dir).items()
           for line in path.read_text().splitlines() if line]
    return sorted(out, key=lambda e: e["failed_at"])


def analyse(plan: list[Fault], run_dir: Path) -> list[FaultRow]:
    """Join the fired-fault markers, the supervisor's restart log and the step times. A step's
    ``time`` in metrics.jsonl is when rank 0 logged it, i.e. just after it completed."""
    fired = fired_at(run_dir)
    steps = _metrics(run_dir)
    events = restarts(run_dir)
    rows = []
    for f in sorted(plan, key=lambda f: fired.get(str(f), float("inf"))):
        row = FaultRow(f, fired.get(str(f)))
        if row.fired is not None:
            ev = next((e for e in events if e["failed_at"] >= row.fired), None)
            if ev is not None:
                row.detected_s = ev["failed_at"] - row.fired
                resume = ev["resume_from"]
                row.resumed_from = int(resume.split()[-1]) if resume.startswith("checkpoint step") else 0
                done = [s["step"] for s in steps if s["time"] <= row.fired]
                row.recomputed = max(0, (max(done) if done else 0) - row.resumed_from)
                after = [s["time"] for s in steps if s["time"] > ev["failed_at"]]
                row.recovered_s = (min(after) - row.fired) if after else None
        rows.append(row)
    return rows


def _fmt(v: float | int | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[FaultRow]) -> str:
    head = ("fault (rank:step:kind)", "detect s", "recover s", "resumed at", "recomputed")
    lines = [f"{head[0]:<24}{head[1]:>10}{head[2]:>11}{head[3]:>12}{head[4]:>12}"]
    for r in rows:
        fault = str(r.fault) + ("" if r.fired is not None else " (never fired)")
        lines.append(f"{fault:<24}{_fmt(r.detected_s):>10}{_fmt(r.recovered_s):>11}"
                     f"{_fmt(r.resumed_from, 'd'):>12}{_fmt(r.recomputed, 'd'):>12}")
    return "\n".join(lines)


def goodput(cfg: Config, reference: Path, faulted: Path) -> float | None:
    """Useful step time / wall time of the faulted job from its first step to its last: the
    undisturbed run's median step time counts as useful for each of ``run.steps`` steps."""
    ref, rows = _metrics(reference), _metrics(faulted)
    if not ref or not rows:
        return None
    useful = cfg.run.steps * statistics.median(r["step_time"] for r in ref)
    wall = rows[-1]["time"] - rows[0]["time"] + rows[0]["step_time"]
    return useful / wall if wall > 0 else None


def same_parameters(cfg: Config, a: Path, b: Path) -> bool:
    _, _, vocab = build_data(cfg, Job())
    (_, pa), (_, pb) = committed(a / "checkpoints")[-1], committed(b / "checkpoints")[-1]
    wa = load_weights(build_reference_model(cfg, vocab), pa).state_dict()
    wb = load_weights(build_reference_model(cfg, vocab), pb).state_dict()
    return all(torch.equal(wa[k], wb[k]) for k in wa)


@dataclass
class ReplicaRow:
    fault: Fault
    fired: float | None = None
    seconds: dict[str, float | None] = field(default_factory=dict)  # "stall", "heal", "back"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _first_after(times: list[float], t: float) -> float | None:
    later = [x for x in times if x > t]
    return min(later) - t if later else None


def analyse_replica(plan: list[Fault], run_dir: Path, groups: int) -> list[ReplicaRow]:
    """Per fault: the survivors' stall (the lowest other group's next step), the killed group's
    heal (its first quorum after the kill that changed its state) and its first step again."""
    fired = fired_at(run_dir)
    rows = []
    for f in sorted(plan, key=lambda f: fired.get(str(f), float("inf"))):
        row = ReplicaRow(f, fired.get(str(f)))
        if row.fired is not None:
            other = min(g for g in range(groups) if g != f.rank)
            row.seconds["stall"] = _first_after([m["time"] for m in _metrics(group_dir(run_dir, other))],
                                                row.fired)
            mine = group_dir(run_dir, f.rank)
            heals = [q for q in _jsonl(mine / "quorums.jsonl") if q["time"] > row.fired]
            row.seconds["heal"] = heals[0]["seconds"] if heals else None
            row.seconds["back"] = _first_after([m["time"] for m in _metrics(mine)], row.fired)
        rows.append(row)
    return rows


def replica_table(rows: list[ReplicaRow], equal: bool) -> str:
    head = ("fault (group:step:kind)", "stall s", "heal s", "back s", "members equal")
    lines = [f"{head[0]:<25}{head[1]:>9}{head[2]:>8}{head[3]:>8}{head[4]:>15}"]
    for r in rows:
        fault = str(r.fault) + ("" if r.fired is not None else " (never fired)")
        t = r.seconds
        lines.append(f"{fault:<25}{_fmt(t.get('stall'), '.2f'):>9}{_fmt(t.get('heal'), '.2f'):>8}"
                     f"{_fmt(t.get('back'), '.2f'):>8}{'yes' if equal else 'NO':>15}")
    return "\n".join(lines)


def _weights(cfg: Config, run_dir: Path) -> dict[str, torch.Tensor]:
    _, _, vocab = build_data(cfg, Job())
    return load_weights(build_reference_model(cfg, vocab), committed(run_dir / "checkpoints")[-1][1]).state_dict()


def members_equal(cfg: Config, run_dir: Path, groups: int) -> tuple[bool, list[int]]:
    """Whether every group that completed the job (its last checkpoint at ``run.steps``) holds
    the same final parameters, bit for bit; and which groups those are. A group replaced by its
    own restart may not have come back before the others finished."""
    done = [g for g in range(groups) if (c := committed(group_dir(run_dir, g) / "checkpoints"))
            and c[-1][0] == cfg.run.steps]
    weights = [_weights(cfg, group_dir(run_dir, g)) for g in done]
    return all(all(torch.equal(weights[0][k], w[k]) for k in w) for w in weights[1:]), done


def run_drill(cfg: Config, spec, *, faults: int, seed: int, out=sys.stdout,
              plan: list[Fault] | None = None) -> bool:
    """Undisturbed run, faulted run, table. True when the final parameters are equal.
    ``plan`` replaces the seeded plan (benchmarks place faults at fixed intervals)."""
    spec = spec.validated()
    world = spec.nproc * spec.nnodes
    if cfg.checkpoint.interval < 1:
        raise ConfigError("checkpoint.interval: a drill needs periodic checkpoints; set it >= 1")
    if plan is None:
        plan = plan_faults(seed, faults, steps=cfg.run.steps, world_size=world,
                           ckpt_interval=cfg.checkpoint.interval)
    base = Path(cfg.run.dir or f"runs/drill-{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if base.exists() and any(base.iterdir()):
        raise ConfigError(f"run.dir: {str(base)!r} is not empty; a drill needs a fresh directory")

    def variant(name: str, inject: str, max_restarts: int) -> Config:
        c = Config.from_dict(cfg.to_dict())
        c.run.dir, c.fault.inject, c.log.interval, c.log.progress = str(base / name), inject, 1, False
        c.fault.max_restarts = max_restarts
        c.checkpoint.keep_last = max(c.checkpoint.keep_last, 2)
        return c

    spec_str = ",".join(map(str, plan))
    print(f"allhands drill: {faults} fault(s), seed {seed}: fault.inject={spec_str}", file=out, flush=True)
    ref_cfg = train_job(variant("undisturbed", "", 0), spec)
    t0 = time.time()
    hit_cfg = train_job(variant("faulted", spec_str, max(cfg.fault.max_restarts, faults + 2)), spec)
    wall = time.time() - t0
    if cfg.fault.mode == "replica" and world > 1:  # a parameter server's worker worlds, or the groups
        groups = world - cfg.ps.servers if cfg.parallel.sync == "ps" else world
        return _replica_report(cfg, plan, Path(ref_cfg.run.dir), Path(hit_cfg.run.dir), groups, wall, base, out)
    rows = analyse(plan, Path(hit_cfg.run.dir))
    equal = same_parameters(ref_cfg, Path(ref_cfg.run.dir), Path(hit_cfg.run.dir))
    print(table(rows), file=out)
    rec = [r.recovered_s for r in rows if r.recovered_s is not None]
    gp = goodput(cfg, Path(ref_cfg.run.dir), Path(hit_cfg.run.dir))
    print(f"median recovery {_fmt(statistics.median(rec) if rec else None)} s; goodput "
          f"{_fmt(gp, '.2f')} (useful step time / wall time of the faulted run's steps); faulted "
          f"job {wall:.1f} s; final parameters "
          f"{'EQUAL to' if equal else 'DIFFER from'} the undisturbed run's; runs in {base}", file=out)
    return equal


def _replica_report(cfg: Config, plan: list[Fault], ref: Path, hit: Path, groups: int, wall: float,
                    base: Path, out) -> bool:
    equal, done = members_equal(cfg, hit, groups)
    equal = equal and len(done) > 1
    rows = analyse_replica(plan, hit, groups)
    print(replica_table(rows, equal), file=out)
    stalls = [r.seconds["stall"] for r in rows if r.seconds.get("stall") is not None]
    gp = goodput(cfg, ref, hit)
    print(f"median survivor stall {_fmt(statistics.median(stalls) if stalls else None, '.2f')} s; goodput "
          f"{_fmt(gp, '.2f')} (useful step time / wall time of the faulted run's steps); faulted "
          f"job {wall:.1f} s; final parameters of groups {', '.join(map(str, done))} (those that "
          f"completed) {'EQUAL' if equal else 'DIFFER or too few'}; runs in {base}", file=out)
    return equal
