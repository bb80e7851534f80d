"""Every layout of a job on a cluster: enumerated, checked by the config validator, estimated
(estimate.py) and ranked, fastest feasible first; infeasible ones keep their reason."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from allhands.config import Config, validate
from allhands.errors import ConfigError
from allhands.models.build import moe_preset, with_preset
from allhands.plan.cluster import Cluster
from allhands.plan.estimate import Estimate, Layout, estimate
from allhands.plan.schedule import SEARCHED


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: Config, world: int, per_node: int, *, compile_options=(False, True),
            ac_options=("none", "selective", "block"), schedules=SEARCHED) -> Iterator[Layout]:
    """Candidate layouts of ``world`` ranks: tp inside a node and dividing the heads, pp any divisor
    of the ranks left up to the layers (stages of unequal blocks when pp does not divide them, cut
    as the trainer cuts them: schedule.py), the rest data parallel as DDP/ZeRO-1 (replicated),
    ZeRO-2/3 (sharded) or hybrid (ZeRO-2/3 sharded inside groups, replicated across them); each
    pipeline schedule of ``schedules`` ((name, stages per rank); default 1F1B, interleaved 1F1B
    and ZB-V) whose stages the layers fill, with pp, 2pp, 4pp microbatches.
    A Llama's tp also divides its key/value heads (each rank holds whole grouped-query groups).
    A mixture of experts also tries each expert-parallel size ``ep`` that divides the experts and
    the data-parallel ranks (under ZeRO-2/3 the sharding ranks; not with ZeRO-1 or cp)."""
    m = cfg.model
    kv = (m.n_kv_head or m.n_head) if m.family == "llama" else m.n_head
    for tp, cp in _tp_cp(cfg, world, per_node, kv):
        for pp in [p for p in _divisors(world // (tp * cp)) if p <= m.n_layer] if cp == 1 else [1]:
            dp = world // (tp * pp * cp)
            splits = [(dp, 1, 0)] + [(dp // s, s, z) for s in _divisors(dp) if s > 1 for z in (1, 2, 3)
                                     if z >= 2 or s == dp]
            for rep, shard, zero in splits:
                for ep in _eps(cfg, dp, shard, zero, cp):
                    for sched, v in [s for s in schedules if pp * s[1] <= m.n_layer] if pp > 1 else [("1f1b", 1)]:
                        for micro in ([pp, 2 * pp, 4 * pp] if pp > 1 else [1]):
                            for ac in ac_options:
                                for comp in compile_options:
                                    yield Layout(rep, shard, tp, pp, zero, micro, ac, comp, cp, ep, sched, v)


def _eps(cfg: Config, dp: int, shard: int, zero: int, cp: int) -> list[int]:
    """Expert-parallel sizes for a data-parallel split (config/moe.py's ``check_ep``)."""
    e = cfg.moe.n_experts if cfg.model.family == "llama" else 0
    if not e or zero == 1 or cp > 1:
        return [1]
    return [ep for ep in _divisors(dp) if e % ep == 0 and (zero < 2 or shard % ep == 0)]


def _tp_cp(cfg: Config, world: int, per_node: int, kv: int) -> Iterator[tuple[int, int]]:
    """(tp, cp) pairs: tp inside a node dividing the heads; context parallelism (the Llama family,
    parallel/context.py) for cp dividing the world and cutting seq_len into 2 cp (x tp) chunks, so
    a sequence whose activations do not fit one rank is cut over several."""
    m = cfg.model
    for tp in _divisors(min(per_node, m.n_head)):
        if m.n_head % tp or kv % tp or world % tp:
            continue
        yield tp, 1
        if m.family != "llama":
            continue
        for cp in _divisors(world // tp)[1:]:
            if m.seq_len % (2 * cp * tp) == 0 and cp <= 16:
                yield tp, cp


def with_layout(cfg: Config, layout: Layout) -> Config:
    """A copy of ``cfg`` that trains ``layout`` (only the sections it changes are copied)."""
    par = dataclasses.replace(cfg.parallel, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                              tp=layout.tp, pp=layout.pp, zero=layout.zero, ac=layout.ac, cp=layout.cp, ep=layout.ep,
                              pp_schedule=layout.schedule if layout.pp > 1 else "1f1b",
                              pp_stages_per_rank=layout.stages_per_rank if layout.pp > 1 else 0,
                              pp_microbatches=layout.microbatches if layout.pp > 1 else 0)
    run = dataclasses.replace(cfg.run, compile=layout.compile)
    return dataclasses.replace(cfg, parallel=par, run=run)


def plan(cfg: Config, cluster: Cluster, **kw: Any) -> list[Estimate]:
    """Every candidate layout estimated: feasible ones by step time, then the infeasible ones
    with the validator's or the memory model's reason. A ``model.preset`` is resolved first. This
    machine's calibration composes 1F1B steps only (localtime.py), so ``--cluster local`` searches
    1F1B; a GPU cluster every schedule of schedule.py's ``SEARCHED``."""
    cfg = dataclasses.replace(cfg, model=with_preset(cfg.model), moe=moe_preset(cfg.model, cfg.moe))
    kw.setdefault("schedules", SEARCHED if cluster.calib is None else (("1f1b", 1),))
    bf16 = cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and cluster.device == "cuda")
    out = []
    for layout in layouts(cfg, cluster.world, cluster.per_node, **kw):
        try:
            validate(with_layout(cfg, layout), world_size=cluster.world, need_data=False)
        except ConfigError as e:
            est = Estimate(layout, reason=str(e))
        else:
            est = estimate(cfg, layout, cluster, bf16)
        out.append(est)
    out.sort(key=lambda e: (not e.feasible, e.time.get("step", float("inf")), e.layout.name()))
    return out


def to_row(e: Estimate, tokens: float = 0.0) -> dict[str, Any]:
    """One layout as JSON: its overrides, memory (bytes), time (seconds), throughput and, for a
    token budget, the training time and accelerator-hours."""
    row: dict[str, Any] = {"layout": e.layout.name(), "set": e.layout.overrides(), "feasible": e.feasible}
    if e.params:
        row.update(params=e.params, active_params=e.active)
    if e.reason:
        row["reason"] = e.reason
    if e.memory:
        row.update(memory=e.memory, time=e.time, tokens_per_s=e.tokens_per_s, mfu=e.mfu)
        if e.interval[1]:
            row["tokens_per_s_interval"] = list(e.interval)
    if e.unverified:
        row["unverified"] = e.unverified
        if tokens and e.tokens_per_s:
            hours = tokens / e.tokens_per_s / 3600
            row.update(train_hours=hours, accelerator_hours=hours * e.layout.world)
    return row


def _range(e: Estimate) -> str:
    return f"{e.interval[0]:,.0f}-{e.interval[1]:,.0f}" if e.interval[1] else "-"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_plan(estimates: list[Estimate], cluster: Cluster, *, top: int = 10, tokens: float = 0.0) -> str:
    ok = [e for e in estimates if e.feasible]
    bad = [e for e in estimates if not e.feasible]
    lines = [f"allhands plan: {len(estimates)} layouts on {cluster.nodes} x {cluster.per_node} "
             f"{cluster.name}: {len(ok)} fit, {len(bad)} do not; the fastest {min(top, len(ok))}:"]
    sized = [e for e in estimates if e.params]
    if sized and sized[0].active != sized[0].params:  # a mixture of experts
        e = sized[0]
        lines.append(f"mixture of experts: {_count(e.params)} parameters, {_count(e.active)} active "
                     f"a token; all_to_all is the time each step spends in expert dispatch and combine")
    w = max([32] + [len(e.layout.name()) for e in ok[:top]])
    head = (f"{'#':>3} {'layout':<{w}} {'GiB/rank':>8} {'(state':>7} {'act)':>6} {'step s':>8} "
            f"{'comm':>6} {'bubble':>6} {'tok/s':>10} {'(range)':>17} {'MFU':>6}"
            + (f" {'hours':>8} {'acc-h':>9}" if tokens else ""))
    lines += [head, "-" * len(head)]
    for i, e in enumerate(ok[:top], 1):
        m, t = e.memory, e.time
        state = m["params"] + m["grads"] + m["optim"]
        line = (f"{i:>3} {e.layout.name():<{w}} {m['total'] / 2**30:>8.2f} {state / 2**30:>7.2f} "
                f"{m['activations'] / 2**30:>6.2f} {t['step']:>8.3f} {t['comm_exposed']:>6.3f} "
                f"{t['bubble']:>6.3f} {e.tokens_per_s:>10,.0f} {_range(e):>17} {100 * e.mfu:>5.1f}%")
        if tokens:
            hours = tokens / e.tokens_per_s / 3600
            line += f" {hours:>8.1f} {hours * e.layout.world:>9,.0f}"
        lines.append(line)
    reasons: dict[str, int] = {}
    for e in bad:
        key = e.reason if e.reason.startswith("needs") is False else "does not fit in memory"
        reasons[key] = reasons.get(key, 0) + 1
    if bad:
        lines.append("infeasible (count: reason):")
        lines += [f"  {n}: {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:top]]
    if cluster.interval[1] and any(e.interval[1] for e in ok):
        lo, hi = cluster.interval
        lines.append(f"range: measured / predicted tokens/s was {lo:.2f}-{hi:.2f} over published {cluster.name} "
                     f"runs the terms were not fitted on (docs/plan.md); a layout unlike them may fall outside")
    elif cluster.device == "cuda":
        lines.append("range: unknown for these layouts (no published runs like them priced the terms)")
    else:
        lines.append("range: not given on this machine; --check trains the layouts and compares")
    if ok and ok[0].unverified:
        lines.append(f"every layout here is verified only by reading (allhands has not trained on a GPU "
                     f"yet, docs/gpu.md); the first uses: {ok[0].unverified.split(': ', 1)[1]}")
    if ok:
        lines.append("train the first with: " + " ".join(f"--set {s}" for s in ok[0].layout.overrides()))
    return "\n".join(lines)
