"""``allhands drill --chaos DURATION --seed S``: many faults of every kind a mode can take, at
random points of one long run, then the invariant checker (check.py) over what it left.

The schedule is drawn from the seed alone (:func:`plan_chaos`), one fault per ``FAULT_EVERY_S``
seconds of DURATION, at random steps of the run, and printed first, so a run replays from its seed
(or from the printed ``fault.inject`` spec). Most faults are the injector's (faults.py: a rank
fires at a step, once per run directory): a SIGKILL of a worker (in replica mode that is its whole
group; in ps mode of a server too), a SIGSTOP that outlasts ``fault.hang_timeout_s`` (a hang the
watchdog must find), a kill inside a checkpoint write, a SIGKILL of the launcher (restart mode: the
job ends and is resumed with ``--resume``, as a scheduler would). Two are the runner's, timed from
outside: the newest checkpoint torn, then a worker killed so that the restart must fall back past
it; and a second kill during the recovery from a fault (as soon as a restart is on record).

The job runs as its own ``allhands train`` process, tagged in its environment (check.py finds
every process it started by the tag) and with a temporary directory of its own, which must end
empty. Restart mode also runs the job once undisturbed: the final parameters must equal it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from allhands.chaos import check as chk
from allhands.checkpoint import committed
from allhands.config import Config
from allhands.errors import ConfigError
from allhands.faults import Fault, fired_at
from allhands.heartbeat import read_heartbeats

FAULT_EVERY_S = 10.0
# What each mode can take from the injector (faults.py kinds) and from the runner (outside).
KINDS = {"restart": ("SIGKILL", "SIGSTOP", "ckpt", "launcher-SIGKILL", "torn", "second"),
         "replica": ("SIGKILL", "SIGSTOP", "ckpt", "torn", "second"),
         "ps": ("SIGKILL", "server-SIGKILL", "SIGSTOP", "server-SIGSTOP", "second")}
OUTSIDE = ("torn", "second")


@dataclass(frozen=True)
class Planned:
    step: int
    kind: str  # a KINDS entry
    rank: int  # the injector's rank (a server's is after the workers'); -1 for the runner's

    def __str__(self) -> str:
        return f"step {self.step}: {self.kind}" + (f" (rank {self.rank})" if self.rank >= 0 else "")


def mode_of(cfg: Config) -> str:
    if cfg.fault.mode == "replica":
        return "ps" if cfg.parallel.sync == "ps" else "replica"
    return "restart"


def plan_chaos(seed: int, duration_s: float, *, mode: str, steps: int, workers: int,
               servers: int = 0) -> list[Planned]:
    """The seeded schedule: ``max(1, duration_s // FAULT_EVERY_S)`` faults at distinct steps in
    ``[2, steps - 1]``, kinds drawn from the mode's (each kind once before any repeats, so a
    short run still sees every kind); same arguments, same plan."""
    rng = random.Random(seed)
    n = max(1, int(duration_s // FAULT_EVERY_S))
    candidates = list(range(2, steps))
    if n > len(candidates):
        raise ConfigError(f"--chaos: {n} faults need at least {n + 2} steps; run.steps is {steps}")
    kinds: list[str] = []
    while len(kinds) < n:
        batch = list(KINDS[mode])
        rng.shuffle(batch)
        kinds += batch
    out = []
    for step, kind in zip(sorted(rng.sample(candidates, n)), kinds):
        if kind in OUTSIDE:
            rank = -1
        elif kind.startswith("server-"):
            rank = workers + rng.randrange(max(1, servers))
        else:
            rank = rng.randrange(workers)
        out.append(Planned(step, kind, rank))
    return out


def inject_spec(plan: list[Planned]) -> str:
    """The injector's share of the plan as ``fault.inject``."""
    return ",".join(str(Fault(p.step, p.rank, p.kind.removeprefix("server-"))) for p in plan
                    if p.kind not in OUTSIDE)


class Outside(threading.Thread):
    """The runner's own faults while the job runs, and what it observes: the newest committed
    step of world 0 over time (check.py ``commits``)."""

    def __init__(self, plan: list[Planned], run_dir: Path, tmp: Path, seed: int, tag: str):
        super().__init__(name="allhands-chaos", daemon=True)
        self.todo = sorted((p for p in plan if p.kind in OUTSIDE), key=lambda p: p.step)
        self.run_dir, self.tmp, self.rng = run_dir, tmp, random.Random(seed + 1)
        self.fired: list[chk.Fired] = []
        self.commits: list[tuple[float, int]] = []
        self.torn: list[int] = []
        self.halt = threading.Event()
        self._restarts_seen = 0
        self.tag, self.shm = tag, set()  # what the job's processes had in /dev/shm

    def run(self) -> None:
        armed: Planned | None = None
        ticks = 0
        while not self.halt.wait(0.2):
            ticks += 1
            if ticks % 5 == 1:
                self.shm |= chk.mapped_shm(chk.tagged_processes(self.tag))
            found = committed(self.run_dir / "checkpoints")
            newest = found[-1][0] if found else 0
            self.commits.append((time.time(), newest))
            n = len(chk.read_run(self.run_dir, 1)["restarts"]) if armed else 0
            if armed is not None and n > self._restarts_seen:  # a recovery is under way: hit it
                time.sleep(self.rng.uniform(0.2, 1.0))
                if self._kill_a_worker("second"):
                    armed = None
            if not self.todo or newest < self.todo[0].step:
                continue
            p = self.todo.pop(0)
            if p.kind == "second":
                armed, self._restarts_seen = p, len(chk.read_run(self.run_dir, 1)["restarts"])
                self._kill_a_worker("worker")
            elif p.kind == "torn":
                self._tear(found[-1][1], newest)
                self._kill_a_worker("torn")

    def _tear(self, path: Path, step: int) -> None:
        """Flip a byte in the middle of the newest checkpoint's first shard (its manifest no longer
        verifies: resume names it and falls back to the one before, trainer.py)."""
        shard = next(iter(sorted(path.glob("*.distcp"))), None)
        if shard is None:
            return
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x55
        shard.write_bytes(bytes(data))
        self.torn.append(step)

    def _kill_a_worker(self, kind: str) -> bool:
        live = []
        for hb in self.tmp.rglob("allhands-hb-*"):
            for attempt in hb.glob("attempt-*"):
                live += [b[0] for b in read_heartbeats(attempt).values() if not b[4]]
        for pid in self.rng.sample(live, len(live)):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            self.fired.append(chk.Fired(kind, time.time(), f"pid {pid}"))
            return True
        return False


def _train(args: list[str], env: dict, log: Path) -> tuple[int, str]:
    with open(log, "a") as out:
        r = subprocess.run([sys.executable, "-m", "allhands.cli", "train", *args], env=env,
                           stdout=out, stderr=subprocess.STDOUT)
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    return r.returncode, lines[-1] if lines else ""


def run_chaos(cfg: Config, spec, *, config_path: str | None, sets: list[str], duration_s: float,
              seed: int, out=sys.stdout, report: dict | None = None) -> bool:
    """The chaos run of ``cfg`` (``config_path`` and ``sets`` as given to the drill, for the
    job's own command line), then the checker's table. True when every invariant held.
    ``report``, if given, receives the run's ``record``, the checker's ``rows`` and the ``plan``."""
    spec = spec.validated()
    mode = mode_of(cfg)
    servers = cfg.ps.servers if mode == "ps" else 0
    workers = spec.nproc - servers
    plan = plan_chaos(seed, duration_s, mode=mode, steps=cfg.run.steps, workers=workers, servers=servers)
    base = Path(cfg.run.dir or f"runs/chaos-{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if base.exists() and any(base.iterdir()):
        raise ConfigError(f"run.dir: {str(base)!r} is not empty; a chaos drill needs a fresh directory")
    base.mkdir(parents=True, exist_ok=True)
    print(f"allhands drill --chaos {duration_s:g} --seed {seed}: {mode} mode, {len(plan)} fault(s):",
          file=out, flush=True)
    for p in plan:
        print(f"  {p}", file=out)
    spec_str = inject_spec(plan)
    print(f"  fault.inject={spec_str}", file=out, flush=True)
    common = [*([config_path] if config_path else []), "--nproc", str(spec.nproc), *[f"--set={s}" for s in sets],
              "--set=log.interval=1", "--set=log.progress=false",
              f"--set=checkpoint.keep_last={max(cfg.checkpoint.keep_last, 3)}"]
    restarts = max(cfg.fault.max_restarts, 2 * len(plan) + 2)
    env = dict(os.environ)
    reference = None
    if mode == "restart":
        reference = base / "undisturbed"
        _train([*common, f"--set=run.dir={reference}", "--set=fault.inject=", "--max-restarts", "0"],
               env, base / "undisturbed.log")
    tag, tmp, run_dir = uuid.uuid4().hex, base / "tmp", base / "faulted"
    tmp.mkdir()
    env.update(ALLHANDS_CHAOS_TAG=tag, TMPDIR=str(tmp))
    outside = Outside(plan, run_dir, tmp, seed, tag)
    t0 = time.time()
    outside.start()
    args = [*common, f"--set=run.dir={run_dir}", f"--set=fault.inject={spec_str}", "--max-restarts", str(restarts)]
    code, last = _train(args, env, base / "faulted.log")
    relaunched: list[float] = []
    while code != 0 and len(relaunched) < sum(p.kind == "launcher-SIGKILL" for p in plan) and run_dir.exists():
        _wait_gone(tag, 60)  # a killed launcher: its workers stop (they are sent SIGINT as it dies),
        relaunched.append(time.time())  # then the job is resumed, as its scheduler would
        code, last = _train(["--nproc", str(spec.nproc), "--resume", str(run_dir), "--max-restarts",
                             str(restarts)], env, base / "faulted.log")
    outside.halt.set()
    outside.join(5)
    ended = time.time()
    _wait_gone(tag, 10)  # a stopped job's last processes exit within seconds
    record = _record(cfg, mode, workers, run_dir, reference, code, last, outside, t0, ended)
    record.relaunched = relaunched
    record.leftovers = {"processes": chk.tagged_processes(tag),
                        "shm": chk.still_there(outside.shm, Path("/dev/shm")),
                        "tmp": sorted(p.name for p in tmp.iterdir())}
    rows = chk.check(record)
    print(chk.table(rows), file=out)
    print(f"faulted job {ended - t0:.1f} s, {len(relaunched)} relaunch(es) after a killed launcher; runs in "
          f"{base}", file=out, flush=True)
    if report is not None:  # bench/chaos.py's figures
        report.update(record=record, rows=rows, plan=plan)
    return all(r.ok for r in rows)


def _wait_gone(tag: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while chk.tagged_processes(tag) and time.time() < deadline:
        time.sleep(0.2)


def _record(cfg: Config, mode: str, workers: int, run_dir: Path, reference: Path | None, code: int,
            last: str, outside: Outside, t0: float, ended: float) -> chk.Record:
    from allhands.drill import members_equal, same_parameters  # the drill's comparisons

    groups = workers if mode != "restart" else 1
    got = chk.read_run(run_dir, groups)
    fired = [chk.Fired(_kind(k, workers), t, k) for k, t in fired_at(run_dir).items()] + outside.fired
    complete = code == 0 and all(s == cfg.run.steps for s in got["final_steps"].values())
    equal = None
    if complete:
        equal = (same_parameters(cfg, reference, run_dir) if reference is not None
                 else servers_final(cfg, run_dir) if mode == "ps"
                 else members_equal(cfg, run_dir, groups)[0])
    return chk.Record(mode=mode, steps=cfg.run.steps, exit_code=code, last_line=last,
                      final_steps=got["final_steps"], commits=outside.commits, torn=outside.torn,
                      restarts=got["restarts"], step_times=got["step_times"], fired=fired,
                      hang_timeout_s=cfg.fault.hang_timeout_s, params_equal=equal, started=t0, ended=ended)


def servers_final(cfg: Config, run_dir: Path) -> bool:
    """A parameter server's rule (replica mode runs async or ssp: the workers' copies are as
    stale as their last pull, and agree with nobody's by design): the servers committed the final
    step, and every tensor of it is finite."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    from torch.utils._pytree import tree_leaves

    from allhands.checkpoint.safe import SafeFileSystemReader

    found = committed(run_dir / "ps-checkpoints")
    if not found or found[-1][0] != cfg.run.steps:
        return False
    state = _load_state_dict_from_keys(storage_reader=SafeFileSystemReader(found[-1][1]))
    tensors = [v for v in tree_leaves(state) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors)


def _kind(marker: str, workers: int) -> str:
    """A fired marker 'RANK:STEP:KIND' in the checker's words."""
    rank, _, kind = marker.split(":", 2)
    who = "server" if int(rank) >= workers else "worker"
    return {"SIGSTOP": "hang", "launcher-SIGKILL": "launcher", "ckpt": "ckpt"}.get(kind, who)
