"""PNG plots of a run directory from its metrics.jsonl: loss (train and eval), throughput with
MFU, step time per rank (a straggler shows as one line above the others), and communication: bytes
per step (collective payload, its ring lower bound, and the interfaces' counters when the run
had a non-loopback interface) beside the exposed share of step time; for a parameter-server run
(``ps/server<i>.json``) the staleness histogram of the updates and each server's load and bytes;
for a mixture-of-experts run the load of every expert of every layer and its spread over steps."""

from __future__ import annotations

import json
from pathlib import Path

from allhands.errors import DataError, cannot_write
from allhands.metrics import throughput


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{str(path)!r} not found; pass a run directory made by `allhands train`")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise DataError(f"{str(path)!r} line {n} is not JSON; the file is damaged") from None
    return rows


def make_report(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    if not train and not evals:
        raise DataError(f"{str(run_dir / 'metrics.jsonl')!r} holds no step yet; train first")
    out_dir = run_dir / "report"
    try:
        out_dir.mkdir(exist_ok=True)
        with open(out_dir / ".writable", "w"):  # fail here, not after the first plot
            pass
        (out_dir / ".writable").unlink()
    except OSError as e:
        raise DataError(f"report: {cannot_write(out_dir, e)}; make the run directory writable or "
                        f"copy it somewhere writable") from None
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_title("loss"), ax.legend(), ax.grid(alpha=0.3)
    save(fig, "loss.png")

    if train:
        fig, ax = plt.subplots(figsize=(7, 4))
        unit = throughput(train[-1])[1]
        ax.plot([r["step"] for r in train], [throughput(r)[0] for r in train], lw=1)
        ax.set_xlabel("step"), ax.set_ylabel(unit), ax.set_title("throughput"), ax.grid(alpha=0.3)
        mfu = [r for r in train if "mfu" in r]
        if mfu:  # model FLOPs utilisation (flops.py) on a second axis
            bx = ax.twinx()
            bx.plot([r["step"] for r in mfu], [100 * r["mfu"] for r in mfu], "C1", lw=1)
            bx.set_ylabel("MFU (%)", color="C1")
        save(fig, "throughput.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        n_ranks = max(len(r.get("step_time_rank", [])) for r in train)
        for rank in range(n_ranks):
            pts = [(r["step"], r["step_time_rank"][rank]) for r in train
                   if len(r.get("step_time_rank", [])) > rank]
            ax.plot([p[0] for p in pts], [p[1] * 1000 for p in pts], lw=1, label=f"rank {rank}")
        ax.set_xlabel("step"), ax.set_ylabel("step time (ms)"), ax.set_title("step time per rank")
        ax.legend(), ax.grid(alpha=0.3)
        save(fig, "step_time.png")

    comm = [r for r in train if "comm_bytes" in r]
    if comm:
        save(plot_comm(plt, comm), "communication.png")
    moe = [r for r in train if r.get("moe_load")]
    if moe:
        save(plot_moe(plt, moe), "experts.png")
    servers = [json.loads(p.read_text()) for p in sorted((run_dir / "ps").glob("server*.json"))]
    if servers:
        save(plot_ps(plt, servers), "ps.png")
    return written


def plot_ps(plt, servers: list[dict]):
    """Staleness of the updates (updates applied to a shard between a worker's pull and its
    push, summed over servers; ssp's clock gaps beside) and each server's load and bytes."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("staleness", "staleness (updates)"), ("clock_gap", "ssp clock gap (steps)")):
        hist: dict[int, int] = {}
        for s in servers:
            for v, n in s.get(key, {}).items():
                hist[int(v)] = hist.get(int(v), 0) + n
        if hist:
            ax.bar([v + (0.2 if key == "clock_gap" else -0.2) for v in hist], list(hist.values()),
                   width=0.4, label=label)
    ax.set_xlabel("staleness"), ax.set_ylabel("updates"), ax.set_title("staleness per update")
    ax.legend(), ax.grid(alpha=0.3)
    idx = [s["server"] for s in servers]
    bx.bar([i - 0.2 for i in idx], [s["bytes_in"] / 1e6 for s in servers], width=0.4, label="MB in")
    bx.bar([i + 0.2 for i in idx], [s["bytes_out"] / 1e6 for s in servers], width=0.4, label="MB out")
    for s in servers:
        bx.annotate(f"load {100 * s['busy_s'] / max(s.get('wall_s', 0), 1e-12):.0f}%",
                    (s["server"], 0), ha="center", va="bottom")
    bx.set_xlabel("server"), bx.set_ylabel("MB"), bx.set_title("per-server bytes and load")
    bx.legend(), bx.grid(alpha=0.3)
    return fig


def plot_moe(plt, rows: list[dict]):
    """Expert load: the routed (token, expert) pairs per step of each expert of each MoE layer,
    over the run, as a share of a perfectly balanced layer's (1.0 everywhere when balanced), and
    the least and most loaded expert per logged step with the balancing loss beside."""
    import numpy as np

    load = np.mean([np.asarray(r["moe_load"], dtype=float) for r in rows], axis=0)  # (layers, E)
    rel = load / np.maximum(load.mean(axis=1, keepdims=True), 1e-12)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    im = ax.imshow(rel, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=max(2.0, float(rel.max())))
    fig.colorbar(im, ax=ax, label="load / balanced load")
    ax.set_xlabel("expert"), ax.set_ylabel("MoE layer"), ax.set_title("expert load over the run")
    steps = [r["step"] for r in rows]
    bx.plot(steps, [r["moe_tokens_per_expert_max"] for r in rows], lw=1, label="most loaded expert")
    bx.plot(steps, [r["moe_tokens_per_expert_min"] for r in rows], lw=1, label="least loaded expert")
    bx.set_xlabel("step"), bx.set_ylabel("routed tokens per step"), bx.grid(alpha=0.3)
    bx.set_title("expert load per step"), bx.legend(loc="upper left")
    aux = [(r["step"], r["moe_aux_loss"]) for r in rows if "moe_aux_loss" in r]
    if aux:
        cx = bx.twinx()
        cx.plot([a[0] for a in aux], [a[1] for a in aux], "C2--", lw=1)
        cx.set_ylabel("balancing loss", color="C2")
    return fig


def plot_comm(plt, rows: list[dict]):
    steps = [r["step"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, [r["comm_bytes"] / 1e6 for r in rows], lw=1, label="collective payload / rank")
    ax.plot(steps, [r["comm_wire_bytes"] / 1e6 for r in rows], "--", lw=1,
            label="ring lower bound / rank")
    if any("net_tx_bytes" in r for r in rows):
        n_ranks = max(len(r.get("step_time_rank", [1])) for r in rows)
        ax.plot(steps, [r.get("net_tx_bytes", float("nan")) / 1e6 / n_ranks for r in rows], lw=1,
                label="interface tx / rank")
    ax.set_xlabel("step"), ax.set_ylabel("MB per step"), ax.set_title("bytes sent per step")
    ax.legend(), ax.grid(alpha=0.3)
    bx.plot(steps, [100 * r["comm_exposed_frac"] for r in rows], lw=1, label="exposed")
    bx.plot(steps, [100 * min(1.0, r["comm_time"] / max(r["step_time"], 1e-12)) for r in rows],
            lw=1, label="in flight")
    bx.set_xlabel("step"), bx.set_ylabel("% of step time"), bx.set_ylim(0, 100)
    bx.set_title("communication time"), bx.legend(), bx.grid(alpha=0.3)
    return fig
