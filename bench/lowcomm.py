"""When the network is the bottleneck (issue 5): two lab hosts joined by 100 Mbit/s links, one
worker each, the reference GPT sized so that its gradient all-reduce dominates the step; the same
seed, data order and token budget for every method, run one after the other in the same lab:

- DDP (synchronous all-reduce): bytes on the wire per step (the interfaces' kernel counters, as
  logged in metrics.jsonl) / the ring lower bound 2 (N-1)/N x 4P (target <= 1.05);
- DiLoCo (H inner steps), PowerSGD and bf16 compression against DDP: eval loss at equal tokens
  (target within 2%), bytes on the wire per step (DiLoCo: about 1/H), and the training wall time
  to reach DDP's final eval loss (target at least 10x faster for DiLoCo);
- a PNG of eval loss against training wall time for all runs (bench/figures/lowcomm.png).

Needs root (network namespaces). Wall time is training time: the sum of the logged step times
(each the slowest rank's; DiLoCo's outer syncs and synchronous warm-up steps included, evals and
process start-up excluded) up to the eval that reaches the loss. The speed-up bound printed per
DiLoCo run (DDP's median step / (inner step + outer sync / H)) shows what the machine's load
allows at equal tokens: the load slows compute, not the capped link, so it lowers the speed-up.

``--loopback`` runs the same jobs as 2 workers on this host without the lab (no root needed):
the losses are the lab's (same seed, data and arithmetic), wall times and bytes are not; it is
how the dependence of the eval-loss gap on H, batch, budget and warm-up was explored.

    sudo python bench/lowcomm.py [--steps 400] [--batch 4] [--diloco-h 20,50,100] [--warmup 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# 4 x 12 x 224^2 ~ 2.5M weights: ~10 MB of fp32 gradient per step, ~0.8 s at 100 Mbit/s. DDP's
# comm/compute ratio grows as tokens per worker per step shrink (comm ~ 8P / 12.5 MB/s, compute
# ~ 6 P tokens / FLOPS): 2 x 32 tokens per worker is ~0.04 s of compute on a quiet core (~0.09 s
# with the machine loaded 6x), so all-reduce is ~90% of DDP's step.
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=224", "model.seq_len=32",
         "model.bias=false"]
RATE_MBIT = 100
BATCH = 4  # global samples per step, every method: 2 x 32 tokens per worker
# Peak lr of every method's (inner) AdamW, tuned for the DDP baseline at this batch: at 2e-3 DDP
# sat on a loss plateau near 3.3 for 250 of its 400 steps and ended at 3.087, at 1e-3 it ends at
# 2.828 (`--loopback --set optim.lr=...`, 2026-12-02); a weak baseline would flatter DiLoCo.
LR = 1e-3


def job_args(run_dir: Path, steps: int, extra: list[str], eval_every: int, batch: int) -> list[str]:
    sets = [*MODEL, f"run.steps={steps}", f"run.global_batch={batch}", f"run.eval_interval={eval_every}",
            "data.eval_batches=16", "checkpoint.interval=0", "checkpoint.at_end=false",
            "log.progress=false", "log.tensorboard=false", "log.interval=1", "optim.warmup_steps=10",
            f"optim.lr={LR}", "run.threads=1", f"run.dir={run_dir}", *extra]
    return [x for s in sets for x in ("--set", s)]


def run_job(lab, run_dir: Path, steps: int, extra: list[str], eval_every: int, port: int,
            batch: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               ALLHANDS_SECRET="bench-lowcomm-not-a-real-secret")
    procs = []
    if lab is None:  # --loopback: both workers on this host (losses only; no link, no wall-time claim)
        cmd = [sys.executable, "-m", "allhands.cli", "train", "--nproc", "2",
               *job_args(run_dir, steps, extra, eval_every, batch)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher picks eth0 from --local-addr
        endpoint = f"{lab.hosts[0].addr}:{port}"  # a fresh port per run: no TIME_WAIT clash
        for rank, host in enumerate(lab.hosts):
            cmd = [sys.executable, "-m", "allhands.cli", "train", "--nnodes", "2", "--node-rank",
                   str(rank), "--nproc", "1", "--rdzv-endpoint", endpoint, "--local-addr", host.addr,
                   *job_args(run_dir, steps, extra, eval_every, batch)]
            procs.append(host.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True))
            time.sleep(0.5)
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):  # one node failed: stop the other
            for p in procs:
                p.kill()
        time.sleep(0.2)
    for p in procs:
        if p.returncode != 0:
            raise SystemExit(f"job {extra} failed:\n{p.stdout.read()[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "loss" in r]
    # Training wall time up to each step: the sum of the step times (log.interval=1; each the
    # slowest rank's, outer syncs and warm-up all-reduces included), evaluations excluded, so
    # that DDP's more frequent evals do not count against it.
    t_at, t = {0: 0.0}, 0.0
    for r in steps_rows:
        t += r["step_time"]
        t_at[r["step"]] = t
    evals = [(r["step"], t_at[r["step"]], r["eval_loss"]) for r in rows if "eval_loss" in r]
    return {"steps": steps_rows, "evals": evals, "wall": t}


def sent(row: dict) -> float:
    """Bytes one rank sent in a step: the interfaces' counters (summed over both hosts) in the
    lab; over loopback (no counter of our own) the collectives' payload per rank."""
    return row["net_tx_bytes"] / 2 if "net_tx_bytes" in row else row["comm_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--diloco-h", default="20,50,100")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=0,
                    help="DiLoCo: synchronous steps before the first round (sync.sync_warmup_steps)")
    ap.add_argument("--reach-factor", type=float, default=2,
                    help="also run the last DiLoCo H with this many times the tokens (1: no)")
    ap.add_argument("--only", default="", help="comma-separated run names to run (DDP always runs)")
    ap.add_argument("--batch", type=int, default=BATCH, help="global samples per step, every run")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="extra config override for every run (e.g. optim.lr=1e-3)")
    ap.add_argument("--loopback", action="store_true",
                    help="no lab: both workers on this host over loopback, to explore the losses "
                         "quickly (wall times and wire bytes are then not the link's)")
    ap.add_argument("--verbose", action="store_true", help="print each run's eval curve")
    ap.add_argument("--lab-tag", default="ahb", help="netlab name prefix (unique per concurrent lab)")
    ap.add_argument("--lab-prefix", default="10.55.0", help="netlab /24 address prefix")
    args = ap.parse_args()

    from allhands.data import load_token_splits, prepare_embedded
    from allhands.launch import _cache_dir
    from allhands.netlab import Lab, unavailable
    from allhands.config import load_config
    from allhands.trainer import build_reference_model

    reason = None if args.loopback else unavailable()
    if reason:
        raise SystemExit(f"bench/lowcomm.py: {reason}")
    data = prepare_embedded(_cache_dir() / "embedded-corpus-v1")
    cfg = load_config(overrides=[*MODEL, f"data.path={data}"])
    _, _, meta = load_token_splits(str(data), cfg.model.seq_len)
    n_params = sum(p.numel() for p in build_reference_model(cfg, meta["vocab_size"]).parameters())
    ring = 2 * (2 - 1) / 2 * 4 * n_params  # bytes per rank per step, fp32 all-reduce, N = 2

    hs = [int(h) for h in args.diloco_h.split(",")]
    diloco = lambda h: ["parallel.sync=diloco", f"sync.inner_steps={h}",  # noqa: E731
                        f"sync.sync_warmup_steps={args.warmup}"]
    # (name, overrides, eval interval, steps)
    runs = [("DDP", ["parallel.sync=allreduce"], 10, args.steps)]
    runs += [(f"DiLoCo H={h}", diloco(h), h, args.steps) for h in hs]
    if args.reach_factor > 1:  # the time to DDP's final loss, given more tokens if it needs them
        runs.append((f"DiLoCo H={hs[-1]} x{args.reach_factor:g}", diloco(hs[-1]), hs[-1],
                     round(args.steps * args.reach_factor)))
    runs += [(f"PowerSGD r={args.powersgd_rank}", ["sync.compress=powersgd",
              f"sync.powersgd_rank={args.powersgd_rank}"], 10, args.steps),
             ("bf16", ["sync.compress=bf16"], 10, args.steps)]
    # bytes per step relative to DDP's, from the algorithm: DiLoCo sends one fp32 all-reduce of
    # the pseudo-gradient per H steps after W synchronous ones; bf16 halves every all-reduce.
    inner = {n: int(x[1].split("=")[1]) for n, x, *_ in runs if x[0] == "parallel.sync=diloco"}
    analytic = {n: f"{(args.warmup + (steps - args.warmup) / inner[n]) / steps:.3f}"
                for n, _, _, steps in runs if n in inner}
    analytic.update({"DDP": "1", "bf16": "0.5"})
    if args.only:
        keep = {"DDP", *args.only.split(",")}
        runs = [r for r in runs if r[0] in keep]
    out = Path(tempfile.mkdtemp(prefix="allhands-bench-lowcomm-"))
    results, loads = {}, {}
    # One lab for all runs: the same links; 9000-byte MTU as on a cluster fabric.
    lab_cm = (contextlib.nullcontext() if args.loopback else
              Lab(2, rate_mbit=RATE_MBIT, tag=args.lab_tag, prefix=args.lab_prefix, mtu=9000))
    with lab_cm as lab:
        for i, (name, extra, ev, steps) in enumerate(runs):
            results[name] = run_job(lab, out / name.replace(" ", "_").replace("=", ""), steps,
                                    [f"data.path={data}", *args.sets, *extra], ev, 29400 + i,
                                    args.batch)
            loads[name] = os.getloadavg()[0]
            print(f"  ran {name}: training {results[name]['wall']:.1f} s; load average (1 min) "
                  f"{loads[name]:.1f}", flush=True)
            if args.verbose:
                print("    eval (step, s, loss): " + " ".join(
                    f"{s}:{t:.0f}:{v:.3f}" for s, t, v in results[name]["evals"]), flush=True)

    where = ("loopback (no lab: wall times and bytes are not the link's)" if args.loopback else
             f"two lab hosts x 1 worker, {RATE_MBIT} Mbit/s tbf each way, MTU 9000")
    print(f"{where}; model {' '.join(MODEL)} ({n_params / 1e6:.2f}M parameters, "
          f"{4 * n_params / 1e6:.1f} MB fp32); {args.batch} samples x 32 tokens per step; "
          f"{args.steps} steps for every run (x{args.reach_factor:g} where marked); DiLoCo: outer "
          f"Nesterov lr 0.7 momentum 0.9, {args.warmup} synchronous warm-up steps; "
          f"{' '.join(args.sets) or 'no other overrides'}")
    ddp = results["DDP"]
    ddp_final = ddp["evals"][-1][2]
    ddp_wire = statistics.median(sent(r) for r in ddp["steps"][1:])
    ddp_mean = sum(sent(x) for x in ddp["steps"]) / len(ddp["steps"])
    print(f"DDP: bytes on the wire per step per rank {ddp_wire / 1e6:.3f} MB / ring lower bound "
          f"{ring / 1e6:.3f} MB = {ddp_wire / ring:.3f} (target <= 1.05)")
    print(f"{'method':<17} {'final eval':>10} {'vs DDP':>8} {'wire MB/step':>12} {'bytes/DDP':>9} "
          f"{'analytic':>8} {'train s':>8} {'t to DDP loss':>13} {'speed-up':>8} {'load':>5}")
    for name, r in results.items():
        final = r["evals"][-1][2]
        wire = sum(sent(x) for x in r["steps"]) / len(r["steps"])
        reach = next((t for _, t, loss in r["evals"] if loss <= ddp_final), None)
        speed = ddp["wall"] / reach if reach else float("nan")
        print(f"{name:<17} {final:>10.4f} {100 * (final / ddp_final - 1):>+7.2f}% {wire / 1e6:>12.3f} "
              f"{wire / ddp_mean:>9.3f} {analytic.get(name, '-'):>8} {r['wall']:>8.1f} "
              f"{(f'{reach:.1f}' if reach else 'not reached'):>13} "
              f"{(f'{speed:.1f}x' if reach else '-'):>8} {loads[name]:>5.1f}")
    # What bounds DiLoCo's speed-up on this machine at this moment: DDP's step (link-bound)
    # against an inner step (compute only) plus 1/H of an outer sync.
    ddp_step = statistics.median(x["step_time"] for x in ddp["steps"])
    for name, r in results.items():
        h = inner.get(name)
        if h is None:
            continue
        local = statistics.median(x["step_time"] for x in r["steps"] if x["comm_bytes"] == 0)
        sync = statistics.median(x["step_time"] for x in r["steps"]
                                 if x["comm_bytes"] > 0 and x["step"] > args.warmup) - local
        print(f"{name}: median step DDP {ddp_step:.3f} s, inner step {local:.3f} s, outer sync "
              f"+{sync:.3f} s -> at most {ddp_step / (local + sync / h):.1f}x at equal tokens")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results.items():
        ax.plot([t for _, t, _ in r["evals"]], [loss for _, _, loss in r["evals"]], "o-", ms=3,
                lw=1, label=name)
    ax.set_xlabel("training wall time (s)"), ax.set_ylabel("eval loss")
    ax.set_title(f"2 hosts, {RATE_MBIT} Mbit/s links, equal tokens"), ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig_path = out / "lowcomm.png" if args.loopback else ROOT / "bench" / "figures" / "lowcomm.png"
    fig_path.parent.mkdir(exist_ok=True)
    fig.savefig(fig_path, dpi=80)
    print(f"plot: {fig_path if args.loopback else fig_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
