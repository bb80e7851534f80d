"""The invariants a job must keep under any faults, checked from what its run left on disk and
what is still running afterwards, in the manner of Jepsen's checkers (jepsen.io): the faults are
random, the rules are not. One row per rule, all of them in one table:

- ``ends``: the job exited 0 with every world at ``run.steps``, or non-zero with one last line
  saying how to continue (``--resume``) once the faults used up its restarts;
- ``commits``: the newest committed step, as observed while it ran, never went backwards (a
  checkpoint torn on purpose may take its own step back, no other);
- ``parameters``: restart mode, the final parameters equal an undisturbed run's bit for bit;
  replica mode, every group that completed holds the same final parameters; ps mode (async or
  ssp, whose workers' copies never agree by design), the servers committed the final step and
  every tensor of it is finite;
- ``faults``: every fault that fired is in some world's ``restarts.jsonl``, detected within the
  hang timeout (plus slack) and followed by a completed step (its recovery), unless it is one
  whose recovery is not a restart (a torn checkpoint; a killed launcher, which the runner resumes,
  and any fault whose restart that launcher took with it: the resume recovers it);
- ``leftovers``: no process of the job (found by a tag in its environment), no shared-memory
  segment it made, nothing in its temporary directory is left (but torch's compile cache);
- ``silence``: no world went longer than the hang timeout plus 10 s without a line of its own
  (a step in metrics.jsonl, a restart record).

:func:`check` takes a :class:`Record` (built by :func:`collect` from the disk), so that the rules
are tested on recorded or hand-made runs without processes (tests/test_chaos_check.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from allhands.checkpoint import committed
from allhands.paths import group_dir, restart_logs

SILENCE_SLACK_S = 10.0
# A restart record must come this long after the fault at most: the hang timeout for a hang, the
# agent's poll, teardown and a loaded host for a death.
DETECT_SLACK_S = 15.0
NOT_RESTARTED = ("torn", "launcher")  # kinds whose recovery is not a restart record


@dataclass
class Fired:
    kind: str  # worker | group | server | launcher | hang | torn | ...
    at: float  # when it fired (unix time)
    target: str = ""  # what it hit, in words


@dataclass
class Record:
    """What a check needs of one run, every time a unix time."""

    mode: str  # restart | replica | ps
    steps: int  # run.steps
    exit_code: int
    last_line: str
    final_steps: dict[str, int]  # world -> its newest committed step at the end
    commits: list[tuple[float, int]]  # (time, newest committed step of world 0) as observed
    torn: list[int] = field(default_factory=list)  # steps torn on purpose
    restarts: list[dict] = field(default_factory=list)  # every world's records, with "world"
    step_times: dict[str, list[float]] = field(default_factory=dict)  # world -> its steps' times
    fired: list[Fired] = field(default_factory=list)
    hang_timeout_s: float = 0.0
    params_equal: bool | None = None  # restart: to the reference; else: across the groups
    leftovers: dict[str, list[str]] = field(default_factory=dict)  # processes, shm, tmp
    started: float = 0.0
    ended: float = 0.0
    relaunched: list[float] = field(default_factory=list)  # the runner resumed the job (no ranks ran)


@dataclass
class Row:
    rule: str
    ok: bool
    detail: str


def check(r: Record) -> list[Row]:
    return [_ends(r), _commits(r), _parameters(r), _faults(r), _leftovers(r), _silence(r)]


def _ends(r: Record) -> Row:
    if r.exit_code == 0:
        short = {w: s for w, s in r.final_steps.items() if s != r.steps}
        return Row("ends", not short and bool(r.final_steps),
                   f"done at step {r.steps}" if not short else f"exit 0 but worlds at {short}")
    ok = "--resume" in r.last_line
    return Row("ends", ok, f"exit {r.exit_code}: " + ("resume line given" if ok else f"no resume line: {r.last_line[:80]!r}"))


def commits_back(r: Record) -> list[str]:
    """Each time the newest committed step went backwards ('HIGH->STEP'), but from a torn one."""
    high, back = -1, []
    for t, step in sorted(r.commits):
        if step < high and high not in r.torn:
            back.append(f"{high}->{step}")
        high = step if high in r.torn else max(high, step)
    return back


def _commits(r: Record) -> Row:
    back = commits_back(r)
    return Row("commits", not back, "never backwards" if not back else f"went back: {', '.join(back[:3])}")


def _parameters(r: Record) -> Row:
    what = {"restart": "equal to the undisturbed run", "ps": "equal the servers' final step, finite"}.get(
        r.mode, "equal across the groups")
    if r.params_equal is None:
        return Row("parameters", r.exit_code != 0, "not compared (the job did not complete)")
    return Row("parameters", r.params_equal, what if r.params_equal else what.replace("equal", "NOT equal"))


def recoveries(r: Record) -> list[tuple[Fired, float | None, float | None]]:
    """Each fault that fired and is recovered by a restart (or a resume), with its detection
    (seconds to its restart record or the resume) and its recovery (to the first step after
    that); None where that is missing. Faults whose recovery is not a restart are left out."""
    out = []
    events = sorted(r.restarts, key=lambda e: e["failed_at"])
    steps = sorted(t for ts in r.step_times.values() for t in ts)
    for f in r.fired:
        if f.kind in NOT_RESTARTED:
            continue
        limit = f.at + r.hang_timeout_s * (f.kind == "hang") + DETECT_SLACK_S
        ev = next((e["failed_at"] for e in events if f.at <= e["failed_at"] <= limit), None)
        if ev is None:
            # a killed launcher that took this fault's recovery with it: the runner's resume
            # (which it follows) recovers both
            ev = next((t for t in r.relaunched if f.at <= t and not any(
                f.at <= e["failed_at"] <= t for e in events)), None)
        if ev is None:
            out.append((f, None, None))
            continue
        after = [t for t in steps if t > ev]
        out.append((f, ev - f.at, after[0] - f.at if after else None))
    return out


def _faults(r: Record) -> Row:
    missing, detect, recover = [], [], []
    for f, d, rec in recoveries(r):
        if d is None:
            missing.append(f"{f.kind}@{f.at - r.started:.0f}s")
            continue
        detect.append(d)
        if rec is not None:
            recover.append(rec)
        elif r.exit_code == 0:
            missing.append(f"{f.kind}@{f.at - r.started:.0f}s (no step after)")
    n = sum(f.kind not in NOT_RESTARTED for f in r.fired)
    detail = (f"{n - len(missing)}/{n} recorded; detect max {max(detect, default=0):.1f} s, "
              f"recover max {max(recover, default=0):.1f} s")
    return Row("faults", not missing, detail + (f"; missing: {', '.join(missing[:3])}" if missing else ""))


# torch's compile cache (torchinductor_USER), made in the temporary directory on the first import
# of torch._dynamo (the forkserver's preload) and meant to serve later jobs: not the job's
KEPT_BY_DESIGN = ("torchinductor_",)


def _leftovers(r: Record) -> Row:
    left = {k: [x for x in v if not (k == "tmp" and x.startswith(KEPT_BY_DESIGN))]
            for k, v in r.leftovers.items()}
    left = {k: v for k, v in left.items() if v}
    return Row("leftovers", not left, "none" if not left else
               "; ".join(f"{k}: {', '.join(v[:3])}" + (f" (+{len(v) - 3})" if len(v) > 3 else "")
                         for k, v in left.items()))


def _silence(r: Record) -> Row:
    limit = r.hang_timeout_s + SILENCE_SLACK_S
    worst, who = 0.0, ""
    lines: dict[str, list[float]] = {w: list(ts) for w, ts in r.step_times.items()}
    for e in r.restarts:  # a world without steps of its own (the servers) is judged by its workers
        if _world_of(e["world"]) in lines:
            lines[_world_of(e["world"])].append(e["failed_at"])
    for world, ts in lines.items():
        ts = sorted(t for t in ts if t <= r.ended)
        gaps = [b - a for a, b in zip(ts, ts[1:]) if not any(a <= t <= b for t in r.relaunched)]
        if gaps and max(gaps) > worst:
            worst, who = max(gaps), world
    ok = r.hang_timeout_s <= 0 or worst <= limit
    return Row("silence", ok, f"longest {worst:.1f} s ({who or '-'}), limit {limit:g} s")


def _world_of(restart_world: str) -> str:
    """The metrics world of a restart log's world: a ps worker world logs its steps as its group."""
    return restart_world.replace("ps-worker-", "group-") if restart_world != "ps-worker-0" else "job"


def table(rows: list[Row]) -> str:
    lines = [f"{'invariant':<12}{'ok':<5}detail"]
    lines += [f"{r.rule:<12}{'yes' if r.ok else 'NO':<5}{r.detail}" for r in rows]
    return "\n".join(lines)


# -- reading a run back


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worlds(run_dir: Path, groups: int) -> dict[str, Path]:
    """Each world that trains, by name: ``job`` (restart mode, replica group 0, ps worker 0),
    ``group-N`` the others (paths.group_dir)."""
    return {("job" if g == 0 else f"group-{g}"): group_dir(run_dir, g) for g in range(groups)}


def read_run(run_dir: Path, groups: int) -> dict:
    """The parts of a Record that a run directory holds: each world's step times and final
    committed step, every world's restart records."""
    out = {"step_times": {}, "final_steps": {}}
    for name, where in worlds(run_dir, groups).items():
        out["step_times"][name] = [m["time"] for m in _jsonl(where / "metrics.jsonl") if "loss" in m]
        found = committed(where / "checkpoints")
        out["final_steps"][name] = found[-1][0] if found else 0
    out["restarts"] = [{**e, "world": w} for w, p in restart_logs(run_dir).items() for e in _jsonl(p)]
    return out


def tagged_processes(tag: str, environ: Callable[[int], bytes] | None = None) -> list[str]:
    """Live processes whose environment holds ``tag`` (``ALLHANDS_CHAOS_TAG``, set for the job
    only, inherited by every process it starts, forks of a forkserver included), as 'pid name'."""
    read = environ or (lambda pid: Path(f"/proc/{pid}/environ").read_bytes())
    out = []
    needle = f"ALLHANDS_CHAOS_TAG={tag}".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        if pid == os.getpid():
            continue
        try:
            if needle in read(pid).split(b"\0"):
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    out.append(f"{pid} {name}")
        except OSError:
            continue
    return out


def mapped_shm(pids: list[str]) -> set[str]:
    """The /dev/shm entries the processes ('pid name') have mapped or open: what the job made
    there is told apart from other jobs' on a shared host by this, sampled while it runs."""
    out = set()
    for entry in pids:
        pid = entry.split()[0]
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for path in [line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/dev/shm/" in line] + fds:
            if path.startswith("/dev/shm/"):
                out.add(path[len("/dev/shm/"):].split()[0])
    return out


def still_there(names: set[str], directory: Path) -> list[str]:
    return sorted(n for n in names if (directory / n).exists())
