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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: Config, world: int, per_node: int, *, compile_options=(False, True),
            ac_options=("none", "selective", "block")) -> Iterator[Layout]:
    """Candidate layouts of ``world`` ranks: tp inside a node and dividing the heads, pp up to the
    layers, the rest data parallel as DDP/ZeRO-1 (replicated), ZeRO-2/3 (sharded) or hybrid
    (ZeRO-2/3 sharded inside groups, replicated across them); 1F1B with pp, 2pp, 4pp microbatches.
    A Llama's tp also divides its key/value heads (each rank holds whole grouped-query groups).
    A mixture of experts also tries each expert-parallel size ``ep`` that divides the experts and
    the data-parallel ranks (under ZeRO-2/3 the sharding ranks; not with ZeRO-1 or cp)."""
    m = cfg.model
    kv = (m.n_kv_head or m.n_head) if m.family == "llama" else m.n_head
    for tp, cp in _tp_cp(cfg, world, per_node, kv):
        for pp in _divisors(min(m.n_layer, world // (tp * cp))) if cp == 1 else [1]:
            if (world // (tp * cp)) % pp:
                continue
            dp = world // (tp * pp * cp)
            splits = [(dp, 1, 0)] + [(dp // s, s, z) for s in _divisors(dp) if s > 1 for z in (1, 2, 3)
                                     if z >= 2 or s == dp]
            for rep, shard, zero in splits:
                for ep in _eps(cfg, dp, shard, zero, cp):
                    for micro in ([pp, 2 * pp, 4 * pp] if pp > 1 else [1]):
                        for ac in ac_options:
                            for comp in compile_options:
                                yield Layout(rep, shard, tp, pp, zero, micro, ac, comp, cp, ep)


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
                              pp_schedule="1f1b", pp_stages_per_rank=0,
                              pp_microbatches=layout.microbatches if layout.pp > 1 else 0)
    run = dataclasses.replace(cfg.run, compile=layout.compile)
    return dataclasses.replace(cfg, parallel=par, run=run)


def plan(cfg: Config, cluster: Cluster, **kw: Any) -> list[Estimate]:
    """Every candidate layout estimated: feasible ones by step time, then the infeasible ones
    with the validator's or the memory model's reason. A ``model.preset`` is resolved first."""
    cfg = dataclasses.replace(cfg, model=with_preset(cfg.model), moe=moe_preset(cfg.model, cfg.moe))
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
        if tokens and e.tokens_per_s:
            hours = tokens / e.tokens_per_s / 3600
            row.update(train_hours=hours, accelerator_hours=hours * e.layout.world)
    return row


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
            f"{'comm':>6} {'bubble':>6} {'tok/s':>10} {'MFU':>6}" + (f" {'hours':>8} {'acc-h':>9}" if tokens else ""))
    lines += [head, "-" * len(head)]
    for i, e in enumerate(ok[:top], 1):
        m, t = e.memory, e.time
        state = m["params"] + m["grads"] + m["optim"]
        line = (f"{i:>3} {e.layout.name():<{w}} {m['total'] / 2**30:>8.2f} {state / 2**30:>7.2f} "
                f"{m['activations'] / 2**30:>6.2f} {t['step']:>8.3f} {t['comm_exposed']:>6.3f} "
                f"{t['bubble']:>6.3f} {e.tokens_per_s:>10,.0f} {100 * e.mfu:>5.1f}%")
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
    if ok:
        lines.append("train the first with: " + " ".join(f"--set {s}" for s in ok[0].layout.overrides()))
    return "\n".join(lines)
