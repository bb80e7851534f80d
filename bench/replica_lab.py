"""Replica mode against restart mode across 2 hosts of the network lab (needs root), the link
capped as a slow cluster fabric (``tc qdisc ... tbf rate 100mbit burst 64kb latency 50ms`` on
both ends of each host's veth, netlab.py).

The job of bench/replica.py (reference GPT, 2 workers, global batch 16), one worker per lab host
(``--nnodes 2 --nproc 1``): undisturbed, then with a SIGKILL of worker (replica group) 1, the one
on host 1, every ``--every`` steps, once with ``fault.mode = "replica"`` (the quorum store on host
0's rendezvous endpoint, the cross-group all-reduce and the heal over the capped link) and once
with ``fault.mode = "restart"`` (torch's agents restart both hosts' workers from the last
checkpoint, every ``--ckpt`` steps). Figures as bench/replica.py: survivor stall, replacement
back, recovery, goodput.

    python bench/replica_lab.py [--faults 2] [--every 100] [--ckpt 10] [--rate 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from replica import MODEL, after, pace, steps_of  # noqa: E402 - the same job and figures as one host


def run_on_lab(lab, sets: list[str], secret: str) -> None:
    """One job, node r on lab host r; raises with the tail of a node's output if one failed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", ALLHANDS_SECRET=secret)
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = [host.popen([sys.executable, "-m", "allhands.cli", "train", "--nnodes", "2", "--node-rank",
                         str(r), "--nproc", "1", "--rdzv-endpoint", f"{lab.hosts[0].addr}:29400",
                         "--local-addr", host.addr, *(x for s in sets for x in ("--set", s))],
                        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r, host in enumerate(lab.hosts)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a node failed (exit {p.returncode}):\n{out[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--faults", 2), ("--every", 100), ("--ckpt", 10), ("--rate", 100)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lab-tag", default="ahrb", help="prefix of the lab's namespace and link names")
    ap.add_argument("--lab-prefix", default="10.68.0", help="the lab hosts' /24")
    ap.add_argument("--out", default="", help="where the runs go (default: a new temporary directory)")
    args = ap.parse_args()

    from allhands.faults import fired_at
    from allhands.netlab import Lab, unavailable

    if unavailable():
        sys.exit(f"replica_lab: {unavailable()}")
    out = Path(args.out or tempfile.mkdtemp(prefix="allhands-bench-replica-lab-"))
    steps = args.every * (args.faults + 1)
    inject = ",".join(f"1:{args.every * (i + 1)}:SIGKILL" for i in range(args.faults))
    base = [*MODEL, f"run.steps={steps}", "run.global_batch=16", "run.eval_interval=0",
            "data.eval_batches=0", f"checkpoint.interval={args.ckpt}", "fault.backoff_s=0.5",
            "log.tensorboard=false", "log.progress=false", f"fault.max_restarts={args.faults + 1}",
            "run.threads=1"]
    runs = {"undisturbed": ["fault.mode=replica"], "replica": ["fault.mode=replica", f"fault.inject={inject}"],
            "restart": ["fault.mode=restart", f"fault.inject={inject}"]}
    print(f"faults={args.faults} every={args.every} steps={steps} checkpoint every {args.ckpt} 2 hosts x 1 "
          f"worker, link tbf rate {args.rate}mbit burst 64kb latency 50ms, model={' '.join(MODEL)} "
          f"global_batch=16 in {out}", flush=True)
    rows = {}
    with Lab(2, rate_mbit=args.rate, tag=args.lab_tag, prefix=args.lab_prefix) as lab:
        for name, extra in runs.items():
            run_on_lab(lab, [*base, *extra, f"run.dir={out / name}"], "bench-replica-lab-" + "x" * 16)
            rows[name] = steps_of(out / name / "metrics.jsonl")
    step_time = statistics.median(dt for _, _, dt in rows["undisturbed"])
    per_step = pace(rows["undisturbed"])[1]  # the reference of goodput: bench/replica.py
    print(f"undisturbed median step time {step_time:.3f} s, wall time per step {per_step:.3f} s")
    for name in ("replica", "restart"):
        kills = sorted(fired_at(out / name).values())
        stalls = [after(rows[name], t) for t in kills]
        line = f"{name}: goodput {steps * per_step / pace(rows[name])[0]:.2f}; "
        line += ("survivor stall " if name == "replica" else "recovery ") + ", ".join(
            f"{s:.2f} s" if s is not None else "none" for s in stalls)
        if name == "replica":
            back = [after(steps_of(out / name / "replicas" / "group-1" / "metrics.jsonl"), t) for t in kills]
            line += "; replacement back " + ", ".join(f"{b:.2f} s" if b is not None else "never" for b in back)
        print(line, flush=True)


if __name__ == "__main__":
    main()
