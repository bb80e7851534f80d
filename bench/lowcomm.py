"""When the network is the bottleneck: two lab hosts joined by 100 Mbit/s links, one
worker each, the reference GPT sized so that its gradient all-reduce dominates the step; the same
seed, data order and token budget for every method, run one after the other in the same lab:

- DDP (synchronous all-reduce): bytes on the wire per step (the interfaces' kernel counters, as
  logged in metrics.jsonl) / the ring lower bound 2 (N-1)/N x 4P (target <= 1.05);
- DiLoCo (H inner steps), PowerSGD and bf16 compression against DDP: eval loss at equal tokens
  (target within 2%), bytes on the wire per step (DiLoCo: about 1/H), and the training wall time
  to reach DDP's final eval loss (target at least 10x faster for DiLoCo), from a second run of
  the last DiLoCo H, of PowerSGD and of bf16 with ``--reach-factor`` times the tokens (each on
  its own cosine schedule), since at equal tokens they end just above DDP's loss;
- a PNG of eval loss against training wall time for all runs (bench/figures/lowcomm.png).

Needs root (network namespaces). Wall time is training time: the sum of the logged step times
(each the slowest rank's; DiLoCo's outer syncs and synchronous warm-up steps included, evals and
process start-up excluded) up to the eval that reaches the loss. The speed-up bound printed per
DiLoCo run (DDP's median step / (inner step + outer sync / H)) shows what the machine's load
allows at equal tokens: the load slows compute, not the capped link, so it lowers the speed-up.

``--loopback`` runs the same jobs as 2 workers on this host without the lab (no root needed):
the losses are the lab's (same seed, data and arithmetic), wall times and bytes are not; it is
how the dependence of the eval-loss gap on H, batch, budget and warm-up was explored, and how
the learning rates and DiLoCo's outer optimizer were tuned (``--seeds``, ``--outer``,
``--diloco-set``, ``--final-eval``; BENCHMARKS.md has the protocol and every run).

The eval set is the whole held-out split (535 batches of 4 windows, 68k tokens), the same for
every seed: with 16 batches the subset moved with data.seed and added its own noise to the gap.

    sudo python bench/lowcomm.py [--steps 400] [--batch 4] [--diloco-h 20,50,100] [--warmup 0]
    python bench/lowcomm.py --loopback --final-eval --reach-factor 1 --seeds 1,2,3 --only 'DiLoCo*'
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
# Peak lr of AdamW, each tuned on seed 0 over the same grid {5e-4, 7e-4, 1e-3} (and 1.5e-3, 2e-3
# for DDP), eval loss at 400 steps on the whole val split (BENCHMARKS.md, 2026-12-02): DDP
# 2.6777 / 2.6759 / 2.8057 (2.8320, 3.0598: at 2e-3 it sits on a plateau near 3.3), so 7e-4;
# DiLoCo's inner AdamW is best at 5e-4 (each replica steps on half the batch). A weak
# baseline would flatter DiLoCo; PowerSGD and bf16 use DDP's.
LR = 7e-4
DILOCO_LR = 5e-4
# DiLoCo's outer optimizer, LR:MOMENTUM (Nesterov), tuned on seed 0 like the lr: the paper's 0.7
# with momentum 0.5 instead of 0.9. The paper's 0.9 (tuned for 8 replicas starting from a model
# pre-trained for 24k steps) lets the momentum sum ~10 rounds of pseudo-gradients; with 2
# replicas from a random init it overshoots: +4.9..9.7% eval loss vs DDP (mean of 3 seeds, lr 1e-3).
OUTER = "0.7:0.5"
# x BATCH samples per evaluation: 535 x 4 = 2140 windows of 32 tokens, the whole val split once.
EVAL_BATCHES = 535
# steps between DDP's (and PowerSGD's, bf16's) evals: the curve in the plot and the resolution
# of their time to DDP's final loss; 20 full evals of ~1-2 s each, outside the timed steps.
DDP_EVAL_EVERY = 20


def job_args(run_dir: Path, steps: int, extra: list[str], eval_every: int, batch: int,
             eval_batches: int) -> list[str]:
    sets = [*MODEL, f"run.steps={steps}", f"run.global_batch={batch}", f"run.eval_interval={eval_every}",
            f"data.eval_batches={eval_batches}", "checkpoint.interval=0", "checkpoint.at_end=false",
            "log.progress=false", "log.tensorboard=false", "log.interval=1", "optim.warmup_steps=10",
            f"optim.lr={LR}", "run.threads=1", f"run.dir={run_dir}", *extra]
    return [x for s in sets for x in ("--set", s)]


def run_job(lab, run_dir: Path, steps: int, extra: list[str], eval_every: int, port: int,
            batch: int, eval_batches: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               ALLHANDS_SECRET="bench-lowcomm-not-a-real-secret")
    procs = []
    if lab is None:  # --loopback: both workers on this host (losses only; no link, no wall-time claim)
        cmd = [sys.executable, "-m", "allhands.cli", "train", "--nproc", "2",
               *job_args(run_dir, steps, extra, eval_every, batch, eval_batches)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher picks eth0 from --local-addr
        endpoint = f"{lab.hosts[0].addr}:{port}"  # a fresh port per run: no TIME_WAIT clash
        for rank, host in enumerate(lab.hosts):
            cmd = [sys.executable, "-m", "allhands.cli", "train", "--nnodes", "2", "--node-rank",
                   str(rank), "--nproc", "1", "--rdzv-endpoint", endpoint, "--local-addr", host.addr,
                   *job_args(run_dir, steps, extra, eval_every, batch, eval_batches)]
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


def report(results: dict, loads: dict, seed: int, ring: float, analytic: dict, inner: dict,
           warmup: int) -> None:
    ddp = results["DDP"]
    ddp_final = ddp["evals"][-1][2]
    ddp_wire = statistics.median(sent(r) for r in ddp["steps"][1:])
    ddp_mean = sum(sent(x) for x in ddp["steps"]) / len(ddp["steps"])
    print(f"seed {seed}: DDP: bytes on the wire per step per rank {ddp_wire / 1e6:.3f} MB / ring lower "
          f"bound {ring / 1e6:.3f} MB = {ddp_wire / ring:.3f} (target <= 1.05)")
    print(f"{'method':<24} {'final eval':>10} {'vs DDP':>8} {'wire MB/step':>12} {'bytes/DDP':>9} "
          f"{'analytic':>8} {'train s':>8} {'t to DDP loss':>13} {'speed-up':>8} {'load':>5}")
    for name, r in results.items():
        final = r["evals"][-1][2]
        wire = sum(sent(x) for x in r["steps"]) / len(r["steps"])
        reach = next((t for _, t, loss in r["evals"] if loss <= ddp_final), None)
        speed = ddp["wall"] / reach if reach else float("nan")
        print(f"{name:<24} {final:>10.4f} {100 * (final / ddp_final - 1):>+7.2f}% {wire / 1e6:>12.3f} "
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
                                 if x["comm_bytes"] > 0 and x["step"] > warmup) - local
        print(f"{name}: median step DDP {ddp_step:.3f} s, inner step {local:.3f} s, outer sync "
              f"+{sync:.3f} s -> at most {ddp_step / (local + sync / h):.1f}x at equal tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--diloco-h", default="20,50,100")
    ap.add_argument("--outer", default=OUTER,
                    help="DiLoCo outer SGD settings LR:MOMENTUM[,...] (Nesterov), each run for every H; "
                         "LR:MOMENTUM@H applies to that H only")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=0,
                    help="DiLoCo: synchronous steps before the first round (sync.sync_warmup_steps)")
    ap.add_argument("--reach-factor", type=float, default=2,
                    help="also run the last DiLoCo H, PowerSGD and bf16 with this many times the "
                         "tokens, for their time to DDP's final loss (1: no)")
    ap.add_argument("--only", default="", help="comma-separated run names to run (DDP always runs); "
                                               "a name ending in * matches every run it starts")
    ap.add_argument("--batch", type=int, default=BATCH, help="global samples per step, every run")
    ap.add_argument("--seeds", default="0",
                    help="comma-separated seeds; seed s runs every job with run.seed=s (model init) "
                         "and data.seed=1234+s (sample order and eval subset)")
    ap.add_argument("--eval-batches", type=int, default=EVAL_BATCHES,
                    help="eval batches of --batch samples per evaluation (535 x 4 = the whole val split)")
    ap.add_argument("--final-eval", action="store_true",
                    help="evaluate only at start and end (loss sweeps: no curve, no time to DDP's loss)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="extra config override for every run (e.g. optim.lr=1e-3)")
    ap.add_argument("--diloco-set", action="append", default=[], dest="diloco_sets",
                    help="extra config override for the DiLoCo runs only (e.g. optim.lr=2e-3)")
    ap.add_argument("--loopback", action="store_true",
                    help="no lab: both workers on this host over loopback, to explore the losses "
                         "quickly (wall times and wire bytes are then not the link's)")
    ap.add_argument("--verbose", action="store_true", help="print each run's eval curve")
    ap.add_argument("--lab-tag", default="ahb", help="netlab name prefix (unique per concurrent lab)")
    ap.add_argument("--lab-prefix", default="10.55.0", help="netlab /24 address prefix")
    args = ap.parse_args()

    from allhands.data import load_token_splits, prepare_embedded
    from allhands.launch.rundir import _cache_dir
    from allhands.netlab import Lab, unavailable
    from allhands.config import load_config
    from allhands.job import build_reference_model

    reason = None if args.loopback else unavailable()
    if reason:
        raise SystemExit(f"bench/lowcomm.py: {reason}")
    data = prepare_embedded(_cache_dir() / "embedded-corpus-v1")
    cfg = load_config(overrides=[*MODEL, f"data.path={data}"])
    _, _, meta = load_token_splits(str(data), cfg.model.seq_len)
    n_params = sum(p.numel() for p in build_reference_model(cfg, meta["vocab_size"]).parameters())
    ring = 2 * (2 - 1) / 2 * 4 * n_params  # bytes per rank per step, fp32 all-reduce, N = 2

    hs = [int(h) for h in args.diloco_h.split(",")]
    outers: dict[int, list[tuple[float, float]]] = {h: [] for h in hs}
    for item in args.outer.split(","):
        setting, _, only_h = item.partition("@")
        lr, mom = (float(x) for x in setting.split(":"))
        for h in ([int(only_h)] if only_h else hs):
            if h in outers:
                outers[h].append((lr, mom))
    many = any(len(v) > 1 for v in outers.values())

    def diloco(h: int, lr: float, mom: float) -> list[str]:
        # DILOCO_LR unless the command sets every run's lr (--set optim.lr=...)
        own_lr = [] if any(x.startswith("optim.lr=") for x in args.sets) else [f"optim.lr={DILOCO_LR}"]
        return ["parallel.sync=diloco", f"sync.inner_steps={h}", f"sync.outer_lr={lr}",
                f"sync.outer_momentum={mom}", f"sync.sync_warmup_steps={args.warmup}",
                *own_lr, *args.diloco_sets]

    def dname(h: int, lr: float, mom: float) -> str:
        return f"DiLoCo H={h}" + (f" o{lr:g}/{mom:g}" if many else "")

    final = args.final_eval
    ev = lambda every: 0 if final else every  # noqa: E731
    # (name, overrides, eval interval, steps, H)
    runs = [("DDP", ["parallel.sync=allreduce"], ev(DDP_EVAL_EVERY), args.steps, None)]
    runs += [(dname(h, lr, m), diloco(h, lr, m), ev(h), args.steps, h) for h in hs for lr, m in outers[h]]
    if args.reach_factor > 1:  # the time to DDP's final loss, given more tokens if it needs them
        h = hs[-1]
        runs += [(f"{dname(h, lr, m)} x{args.reach_factor:g}", diloco(h, lr, m), ev(h),
                  round(args.steps * args.reach_factor), h) for lr, m in outers[h]]
    compressed = [(f"PowerSGD r={args.powersgd_rank}", ["sync.compress=powersgd",
                   f"sync.powersgd_rank={args.powersgd_rank}"]), ("bf16", ["sync.compress=bf16"])]
    runs += [(name, extra, ev(DDP_EVAL_EVERY), args.steps, None) for name, extra in compressed]
    if args.reach_factor > 1:  # the compressed runs end just above DDP's loss: their time to it
        runs += [(f"{name} x{args.reach_factor:g}", extra, ev(DDP_EVAL_EVERY),
                  round(args.steps * args.reach_factor), None) for name, extra in compressed]
    # bytes per step relative to DDP's, from the algorithm: DiLoCo sends one fp32 all-reduce of
    # the pseudo-gradient per H steps after W synchronous ones; bf16 halves every all-reduce.
    inner = {n: h for n, _, _, _, h in runs if h is not None}
    analytic = {n: f"{(args.warmup + (steps - args.warmup) / inner[n]) / steps:.3f}"
                for n, _, _, steps, _ in runs if n in inner}
    analytic.update({"DDP": "1", "bf16": "0.5", f"bf16 x{args.reach_factor:g}": "0.5"})
    if args.only:
        keep = ["DDP", *args.only.split(",")]
        runs = [r for r in runs if any(r[0] == k or (k.endswith("*") and r[0].startswith(k[:-1]))
                                       for k in keep)]
    seeds = [int(x) for x in args.seeds.split(",")]
    out = Path(tempfile.mkdtemp(prefix="allhands-bench-lowcomm-"))
    per_seed: dict[int, tuple[dict, dict]] = {}
    # One lab for all runs: the same links; 9000-byte MTU as on a cluster fabric.
    lab_cm = (contextlib.nullcontext() if args.loopback else
              Lab(2, rate_mbit=RATE_MBIT, tag=args.lab_tag, prefix=args.lab_prefix, mtu=9000))
    port = 29400
    with lab_cm as lab:
        for seed in seeds:
            results, loads = per_seed.setdefault(seed, ({}, {}))
            seed_sets = [f"run.seed={seed}", f"data.seed={1234 + seed}"]
            for name, extra, every, steps, _ in runs:
                slug = f"s{seed}-" + name.replace(" ", "_").replace("=", "").replace("/", "-")
                results[name] = run_job(lab, out / slug, steps,
                                        [f"data.path={data}", *seed_sets, *args.sets, *extra], every,
                                        port, args.batch, args.eval_batches)
                port += 1  # a fresh port per run: no TIME_WAIT clash in the lab
                loads[name] = os.getloadavg()[0]
                print(f"  ran {name} (seed {seed}): training {results[name]['wall']:.1f} s; load "
                      f"average (1 min) {loads[name]:.1f}", flush=True)
                if args.verbose:
                    print("    eval (step, s, loss): " + " ".join(
                        f"{s}:{t:.0f}:{v:.3f}" for s, t, v in results[name]["evals"]), flush=True)

    where = ("loopback (no lab: wall times and bytes are not the link's)" if args.loopback else
             f"two lab hosts x 1 worker, {RATE_MBIT} Mbit/s tbf each way, MTU 9000")
    outer_txt = "; ".join(f"H={h}: " + ", ".join(f"lr {lr:g} momentum {m:g}" for lr, m in v)
                          for h, v in outers.items())
    print(f"{where}; model {' '.join(MODEL)} ({n_params / 1e6:.2f}M parameters, "
          f"{4 * n_params / 1e6:.1f} MB fp32); {args.batch} samples x 32 tokens per step; "
          f"{args.steps} steps for every run (x{args.reach_factor:g} where marked); AdamW peak lr "
          f"{LR:g} (DiLoCo's inner {DILOCO_LR:g}) unless overridden below; eval {args.eval_batches} "
          f"batches ({args.eval_batches * args.batch} samples); "
          f"DiLoCo: outer Nesterov ({outer_txt}), {args.warmup} synchronous warm-up steps; "
          f"{' '.join(args.sets + args.diloco_sets) or 'no other overrides'}")
    for seed, (results, loads) in per_seed.items():
        report(results, loads, seed, ring, analytic, inner, args.warmup)
    if len(seeds) > 1:
        print(f"eval loss vs DDP over seeds {args.seeds}: mean, sample std, min..max")
        for name in per_seed[seeds[0]][0]:
            if name == "DDP":
                continue
            gaps = [100 * (per_seed[s][0][name]["evals"][-1][2] / per_seed[s][0]["DDP"]["evals"][-1][2] - 1)
                    for s in seeds]
            print(f"  {name:<24} {statistics.mean(gaps):+6.2f}%  std {statistics.stdev(gaps):5.2f}  "
                  f"{min(gaps):+6.2f}..{max(gaps):+6.2f}%  (" + " ".join(f"{g:+.2f}" for g in gaps) + ")")
    if final:
        return
    results = per_seed[seeds[0]][0]

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
    # The committed figure only from a whole lab run; loopback and --only runs plot beside their runs.
    fig_path = (out / "lowcomm.png" if args.loopback or args.only else
                ROOT / "bench" / "figures" / "lowcomm.png")
    fig_path.parent.mkdir(exist_ok=True)
    fig.savefig(fig_path, dpi=80)
    print(f"plot: {fig_path if args.loopback else fig_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
