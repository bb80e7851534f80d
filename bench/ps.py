"""Parameter-server benchmarks (parallel.sync=ps), each a ratio of runs made side by side in one
invocation on this host (the machine is shared and noisy: compare ratios, not absolute rates):

(a) stragglers: 3 workers, rank 2 slowed 3x (``fault.inject=2:2:slow=3``), each step 100 ms of
    device time (a sleep) plus a small CPU step so that the workers do not contend for the
    cores: throughput of async (Downpour) and ssp (bounded staleness) parameter servers /
    synchronous DDP's (target >= 1.8), and each run's eval loss and job time at the end (equal
    samples per worker; the straggler bounds every run's length, so about equal time too).
    Ideal: async (2 + 1/3) / 1 = 2.33; ssp 1, since a permanently slow worker paces it;
(b) sparse: the DLRM-style click model of bench/ps_click.py (its table > 99% of the
    parameters), 2 workers: bytes per worker and step with the table moved by row / DDP's
    all-reduce payload (target <= 1/20), and eval loss at equal samples against DDP's (target
    within 2%), for ps sync and ps async;
(c) 1 vs 2 servers, 2 async workers of a wide GPT on one 8-token sample each (server-bound):
    throughput with 2 / with 1, server load and server milliseconds per push.

Throughput of an asynchronous run comes from the servers' push times (ps/server<i>.json): the
samples pushed while every worker was still running (between the last worker's 3rd push and the
first worker's last push) over that window, since a worker that finishes early idles until the
job ends; DDP's is the global batch over its median step time.

    python bench/ps.py [--steps 30] [--only straggler,sparse,servers]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ps_click
from common import TIMING_ONLY

from allhands.config import Config, apply_override
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.trainer import Job

GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.seq_len=32", "model.bias=false",
       "run.threads=1", "optim.warmup_steps=2"]


def run(tmp: Path, name: str, nproc: int, sets: list[str], job: Job | None = None):
    cfg = Config()
    for s in [*TIMING_ONLY, *sets, f"run.dir={tmp / name}"]:
        apply_override(cfg, s)
    t0 = time.perf_counter()
    done = train_job(cfg, LaunchSpec(nproc=nproc), job=job)
    wall = time.perf_counter() - t0
    d = Path(done.run.dir)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    servers = [json.loads(p.read_text()) for p in sorted((d / "ps").glob("server*.json"))]
    return done, rows, servers, wall


def ddp_rate(cfg, rows) -> float:
    times = [r["step_time"] for r in rows if "step_time" in r][2:]
    return cfg.run.global_batch / statistics.median(times)


def ps_rate(cfg, servers, workers: int, skip: int = 3) -> float:
    """Samples per second while every worker was pushing (see the module docstring)."""
    pushes = [sorted(t) for t in servers[0]["push_t"].values()]
    start, end = max(t[skip - 1] for t in pushes), min(t[-1] for t in pushes)
    n = sum(1 for t in pushes for x in t if start < x <= end)
    return n * cfg.run.global_batch / workers / (end - start)


def eval_loss(rows) -> float:
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


def stragglers(tmp: Path, steps: int) -> None:
    """Each step is ps_click.DEVICE_S of device time (a sleep) plus a small CPU step, so the 3
    workers do not contend for the 2 cores and a 3x straggler's sleep is time the others can use
    only if they need not wait for it: the ratio measures the algorithm, not the CPU share."""
    job = Job(model=ps_click.device_timed_model, data=ps_click.data, loss=ps_click.loss)
    common = [f"run.steps={steps}", "run.global_batch=12", "optim.name=sgd", "optim.lr=0.6",
              "optim.weight_decay=0", "optim.warmup_steps=0", "data.eval_batches=8", "run.threads=1",
              "fault.inject=2:2:slow=3"]
    # A push is one worker's 4 samples, applied alone: a third of DDP's learning rate gives each
    # sample the step size it has under DDP (0.6 over the mean of 12).
    per_push = ["parallel.sync=ps", "ps.lr=0.2", f"log.interval={steps}"]
    print(f"(a) stragglers: 3 workers, rank 2 slowed 3x (sleeps 2x its step's time), {steps} steps "
          f"each; a step is {1000 * ps_click.DEVICE_S:.0f} ms of device time (a sleep) plus the click "
          f"model's CPU step (4 samples)")
    cfg, rows, _, wall = run(tmp, "ddp", 3, common, job)
    base = ddp_rate(cfg, rows)
    print(f"    DDP            {base:8.1f} samples/s  eval loss {eval_loss(rows):.4f}  job {wall:.0f} s")
    for label, sets in (("ps async", ["ps.mode=async"]), ("ps ssp s=2", ["ps.mode=ssp", "ps.max_staleness=2"])):
        cfg, rows, servers, wall = run(tmp, label.replace(" ", "_").replace("=", ""), 4,
                                 [*common, *per_push, *sets], job)
        rate = ps_rate(cfg, servers, 3)
        print(f"    {label:14} {rate:8.1f} samples/s  eval loss {eval_loss(rows):.4f}  job {wall:.0f} s  "
              f"throughput / DDP {rate / base:.2f} (target >= 1.8)  server load "
              f"{100 * servers[0]['busy_s'] / servers[0]['wall_s']:.0f}%")


def sparse(tmp: Path, steps: int) -> None:
    job = Job(model=ps_click.model, data=ps_click.data, loss=ps_click.loss)
    common = [f"run.steps={steps}", "run.global_batch=64", "optim.name=sgd", "optim.lr=2.0",
              "optim.weight_decay=0", "optim.warmup_steps=0", "data.eval_batches=8", "run.threads=1"]
    m = ps_click.ClickModel()
    total = sum(p.numel() for p in m.parameters())
    print(f"(b) sparse: click model, table {m.emb.weight.numel() / total:.1%} of {total:,} parameters, "
          f"2 workers, {steps} steps")
    cfg, rows, _, _ = run(tmp, "click_ddp", 2, common, job)
    ddp_bytes = statistics.median(r["comm_bytes"] for r in rows if "comm_bytes" in r)
    ddp_loss = eval_loss(rows)
    print(f"    DDP            all-reduce payload {ddp_bytes / 1e6:7.3f} MB/step/worker  eval loss {ddp_loss:.4f}")
    for mode in ("sync", "async"):
        cfg, rows, servers, _ = run(tmp, f"click_{mode}", 3, [*common, "parallel.sync=ps", f"ps.mode={mode}",
                                                           "ps.sparse=auto", f"log.interval={steps}"], job)
        moved = sum(s["bytes_in"] + s["bytes_out"] for s in servers) / steps / 2
        loss = eval_loss(rows)
        print(f"    ps {mode:11} {moved / 1e6:7.3f} MB/step/worker (/ DDP {moved / ddp_bytes:.4f}, target "
              f"<= 0.05)  eval loss {loss:.4f} ({100 * (loss / ddp_loss - 1):+.2f}% vs DDP, target within 2%)")


def servers(tmp: Path, steps: int) -> None:
    """Server-bound: a wide GPT (6.4 M parameters, 25.6 MB) on one 8-token sample per worker, so
    a worker's step is mostly moving the parameters while a server's is receiving a push,
    AdamW over its shard and sending it back, for every worker's every step."""
    common = [*GPT, "model.n_embd=512", "model.n_head=8", "model.seq_len=8", f"run.steps={steps}",
              "run.global_batch=2", "parallel.sync=ps", "ps.mode=async", f"log.interval={steps}",
              "data.eval_batches=0"]
    rates = {}
    print(f"(c) 2 async workers of a GPT (2 layers, 512 wide: 25.6 MB of parameters; 1 sample of "
          f"8 tokens per worker and step), {steps} steps each, 1 vs 2 servers")
    for n in (1, 2):
        cfg, _, srv, _ = run(tmp, f"servers{n}", 2 + n, [*common, f"ps.servers={n}"])
        rates[n] = ps_rate(cfg, srv, 2)
        load = ", ".join(f"{100 * s['busy_s'] / s['wall_s']:.0f}%" for s in srv)
        per_push = ", ".join(f"{1000 * s['busy_s'] / s['pushes']:.0f}" for s in srv)
        print(f"    {n} server(s)     {rates[n]:8.1f} samples/s  server load {load}  server ms per "
              f"push {per_push}")
    print(f"    throughput with 2 servers / 1 server {rates[2] / rates[1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="straggler,sparse,servers")
    args = ap.parse_args()
    runs = Path(__file__).resolve().parents[1] / "runs"  # not the shared /tmp
    runs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-ps-", dir=runs) as tmp:
        for name, fn in (("straggler", stragglers), ("sparse", sparse), ("servers", servers)):
            if name in args.only.split(","):
                fn(Path(tmp), args.steps)
                sys.stdout.flush()


if __name__ == "__main__":
    main()
