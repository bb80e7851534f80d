"""The layout at launch, from the devices the job finds: ``parallel.layout = "auto"`` chooses the
planner's fastest layout that fits a rank's memory, and every job, chosen or set by hand, is
refused before any worker starts when its predicted memory per rank exceeds what a rank has.

A rank's memory is ``parallel.memory_gib`` when set, else the GPU's total memory (shared by the
workers that share a GPU), else on CPU the host's physical memory (or its cgroup's limit) divided
by the workers on the node. The prediction is estimate.py's for the config's own model (a preset
or a transformers directory resolved first); a model passed to the Python API is not priced.

Choosing takes the planner's figures for the device: a datasheet preset for a known GPU (every
node of one kind chooses alike), this machine measured on CPU (one node only: two CPU hosts
could measure differently and choose differently). It keeps ``run.compile`` and every
``parallel`` field the user set (TOML, ``--set``), and fits within the planner's usable share
of memory (90% on GPU, 80% on CPU). Refusing compares with the whole memory, and on CPU leaves out
the interpreter and torch (pages the forked workers share), because the estimate is within about
10% and a job it refuses must not be one that would have run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from allhands.config import (Config, given, mark_given, mesh_sizes, parse_mix, pp_microbatches,
                             pp_stages_per_rank, validate)
from allhands.data.shards import load_meta
from allhands.errors import AllhandsError, ConfigError, first_line
from allhands.flops import accelerator_peak
from allhands.models.resolve import resolve_model
from allhands.plan.cluster import PRESETS, Cluster, local_cluster
from allhands.plan.estimate import Estimate, Layout, estimate
from allhands.plan.search import plan, with_layout

GiB = 2 ** 30
# the parallel fields a layout sets, named in auto's line when the user set them
_KEPT = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "zero", "ep", "ac", "pp_microbatches", "pp_schedule",
         "pp_stages_per_rank")


@dataclass(frozen=True)
class Devices:
    """What one rank has: ``bytes`` of memory on ``device`` (cuda or cpu), and where the figure
    comes from, in words."""

    bytes: float
    device: str
    source: str
    name: str = ""  # the GPU's name (its datasheet figures rank the layouts)


def find_devices(cfg: Config, nproc: int) -> Devices | None:
    """One rank's memory for ``nproc`` workers on this node; None when ``run.device=cuda`` sees no
    GPU (the workers say so in one line)."""
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return None
    name, share = "", 1
    if device == "cuda":
        # The workers pick GPU local_rank % count (mesh.py). Reading the properties initialises
        # CUDA in the launcher; the workers' forkserver is a fresh process and inherits none of it.
        count = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(min(count, nproc))]
        share = -(-nproc // count)
        total, name = min(p.total_memory for p in props), props[0].name
        source = f"{name}, {total / GiB:.1f} GiB" + (f" / {share} workers" if share > 1 else "")
    else:
        total = _host_memory()
        share = nproc
        source = f"host {total / GiB:.1f} GiB / {nproc} workers"
    if cfg.parallel.memory_gib > 0:
        return Devices(cfg.parallel.memory_gib * GiB, device, "parallel.memory_gib", name)
    return Devices(total / share, device, source, name)


def _host_memory() -> float:
    """Physical memory, or the cgroup's limit where one is lower (a container, a Slurm job)."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
    return total


def cluster_for(devs: Devices, nproc: int, nnodes: int, *, measured: bool) -> Cluster:
    """The planner's cluster of ``nnodes x nproc`` ranks with ``devs.bytes`` each. GPU: the preset
    of its kind (A100, H100, H200; another GPU takes the H100's links with its own datasheet
    peak). CPU: this machine measured (``measured``, for ranking) or, for memory alone, no
    measurement and no runtime bytes (the refusal's rule in the module docstring)."""
    if devs.device == "cuda":
        kind = next((k for k in ("h200", "h100", "a100") if k in devs.name.lower()), "")
        base = PRESETS[kind or "h100"]
        if not kind and accelerator_peak(devs.name, "bf16"):
            base = dataclasses.replace(base, name=devs.name, peak_bf16=accelerator_peak(devs.name, "bf16"),
                                       peak_fp32=accelerator_peak(devs.name, "fp32"))
    elif measured:
        base = local_cluster(nproc)
    else:
        base = dataclasses.replace(PRESETS["h100"], name="cpu", device="cpu", runtime=0.0)
    return dataclasses.replace(base, nodes=nnodes, per_node=nproc, memory=devs.bytes)


def layout_of(cfg: Config, world: int) -> Layout:
    """The config's own layout on ``world`` ranks (its -1 resolved)."""
    p = cfg.parallel
    s = mesh_sizes(p, world)
    pp = s["pp"]
    kw = dict(microbatches=pp_microbatches(p, pp) if pp > 1 else 1, ac=p.ac, compile=cfg.run.compile,
              cp=s.get("cp", 1), ep=p.ep)
    if pp > 1:
        kw.update(schedule=p.pp_schedule, stages_per_rank=pp_stages_per_rank(p))
    return Layout(s["dp_replicate"], s["dp_shard"], s["tp"], pp, p.zero, **kw)


def fit(cfg: Config, *, nproc: int, nnodes: int = 1, own_model: bool = False,
        say: Callable[[str], None] = print) -> Config:
    """``cfg`` with its layout chosen (``parallel.layout=auto``) and checked against a rank's
    memory; raises ConfigError with one line when it cannot fit. ``own_model``: the Python API
    brought its own model, which the planner cannot price: nothing is chosen or checked."""
    p = cfg.parallel
    auto = p.layout == "auto"
    if own_model:
        if auto:
            raise ConfigError("parallel.layout: auto plans the shipped decoders (model section); with "
                              "a model of your own set the layout (allhands plan --model MODULE:BUILDER "
                              "ranks its data-parallel layouts)")
        return cfg
    if p.sync == "ps":  # servers hold the optimizer: not a layout the planner prices
        if auto:
            raise ConfigError("parallel.layout: auto plans the lock-step layouts; under parallel.sync=ps "
                              "set the layout by hand")
        return cfg
    if not (auto or p.memory_check):
        return cfg
    world = nproc * nnodes
    resolved = _priced(resolve_model(cfg))
    devs = find_devices(cfg, nproc)
    if devs is None:
        return cfg
    if auto:
        if devs.device == "cpu" and nnodes > 1:
            raise ConfigError("parallel.layout: auto on several CPU nodes could choose differently on "
                              "each (it measures the machine); set the layout by hand, e.g. from "
                              "`allhands plan --cluster local`")
        cfg = _choose(cfg, resolved, world, devs, cluster_for(devs, nproc, nnodes, measured=True), say)
        resolved = _priced(resolve_model(cfg))
    if p.memory_check:
        memory_only = cluster_for(devs, nproc, nnodes, measured=False)
        try:
            est = _estimate(resolved, world, devs, memory_only)
        except AllhandsError:
            raise
        except Exception as e:  # a layout the planner cannot price is no reason to stop a job
            say(f"allhands: note: the memory check could not price this layout ({first_line(e)}); "
                f"starting without it")
        else:
            _check(resolved, world, devs, est, memory_only)
    return cfg


def _priced(cfg: Config) -> Config:
    """``cfg`` with ``model.vocab_size`` 0 taken from the prepared data's meta.json, as the worker
    takes it, so that the embedding and head are priced at their size."""
    if cfg.model.vocab_size:
        return cfg
    paths = [d for d, _ in parse_mix(cfg.data.mix)] if cfg.data.mix else [cfg.data.path] if cfg.data.path else []
    try:
        vocab = max((int(load_meta(d)["vocab_size"]) for d in paths), default=0)
    except (AllhandsError, KeyError, ValueError, TypeError):  # said by the data checks that follow
        vocab = 0
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab)) if vocab else cfg


def _bf16(cfg: Config, device: str) -> bool:
    return cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and device == "cuda")


def _agrees(layout: Layout, cfg: Config, world: int) -> bool:
    """``layout`` is what ``cfg`` trains once the layout is applied, and valid: no field the user
    set (TOML, ``--set``; -1, "the rest", fits any size) changes it or conflicts with it."""
    if not given(cfg.parallel):  # the layout as the planner validated it
        return True
    applied = apply_layout(cfg, layout)
    try:
        validate(applied, world_size=world, need_data=False)
        return _key(layout_of(applied, world)) == _key(layout)
    except ConfigError:
        return False


def _key(layout: Layout) -> tuple:
    """What a config sets of a layout (a pipeline's microbatches and schedule only under pp)."""
    pipe = (layout.microbatches, layout.schedule, layout.stages_per_rank)
    return (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.cp, layout.zero, layout.ep,
            layout.ac, layout.compile, pipe if layout.pp > 1 else ())


def _choose(cfg: Config, resolved: Config, world: int, devs: Devices, cluster: Cluster,
            say: Callable[[str], None]) -> Config:
    p, mine = cfg.parallel, given(cfg.parallel)
    ac = (p.ac,) if "ac" in mine else ("none", "selective", "block")
    ranked = [e for e in plan(resolved, cluster, compile_options=(cfg.run.compile,), ac_options=ac)
              if _agrees(e.layout, resolved, world)]
    valid = [e for e in ranked if e.memory]
    kept = ", ".join(f"parallel.{n}" for n in _KEPT if n in mine)
    if not valid:
        if ranked:  # every candidate the user's fields leave is invalid: say the first reason
            raise ConfigError(f"parallel.layout: auto found no valid layout of {world} workers that keeps "
                              f"{kept or 'the config'}: {ranked[0].reason}")
        say(f"allhands: layout auto: the parallel fields set ({kept}) leave the planner no layout "
            f"to choose; training the config's own")
        return cfg
    fits = [e for e in valid if e.feasible]
    if fits:
        best = fits[0]
        why = f"the fastest of {len(fits)} that fit ({len(valid)} valid)"
    elif not p.memory_check:
        best = min(valid, key=lambda e: e.memory["total"])
        why = f"none of {len(valid)} fits; the smallest, as parallel.memory_check=false"
    else:
        small = min(valid, key=lambda e: e.memory["total"])
        raise ConfigError(f"parallel.layout: auto: no layout of {world} workers fits {_gib(devs.bytes)} "
                          f"a rank ({devs.source}); the smallest, {small.layout.name()}, needs "
                          f"{_gib(small.memory['total'])}: add workers or memory, or set "
                          f"parallel.memory_check=false to start it anyway")
    say(f"allhands: layout auto: {best.layout.name()}, {why} on {world} workers ({cluster.name} figures): "
        f"predicted {_gib(best.memory['total'])} a rank of {_gib(devs.bytes)} ({devs.source}), "
        f"{best.time['step']:.3g} s a step" + (f"; kept {kept}" if kept else ""))
    return apply_layout(cfg, best.layout)


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` training ``layout``, except in the parallel fields the user set (theirs win);
    ``dp_replicate`` is left as "the rest" (-1) where no other dim is, which is the same size
    here and lets an elastic job shrink as it would by default."""
    mine = given(cfg.parallel)
    par = with_layout(cfg, layout).parallel
    for name in mine:
        setattr(par, name, getattr(cfg.parallel, name))
    if "dp_replicate" not in mine and -1 not in (par.dp_shard, par.tp, par.pp, par.cp):
        par.dp_replicate = -1
    mark_given(par, mine)
    return dataclasses.replace(cfg, parallel=par)


def _estimate(cfg: Config, world: int, devs: Devices, cluster: Cluster) -> Estimate:
    validate(cfg, world_size=world, need_data=False)  # the usual line for an invalid layout first
    return estimate(cfg, layout_of(cfg, world), cluster, _bf16(cfg, devs.device))


def _check(cfg: Config, world: int, devs: Devices, est: Estimate, cluster: Cluster) -> None:
    """ConfigError with one line when the config's layout needs more memory a rank than it has."""
    layout, need = est.layout, est.memory["total"]
    if need <= devs.bytes:
        return
    model = cfg.model.preset or f"the {cfg.model.family} model"
    raise ConfigError(f"parallel: {model} ({_count(est.params)} parameters) under {layout.name()} on {world} "
                      f"workers needs {_gib(need)} a rank (predicted), but a rank has {_gib(devs.bytes)} "
                      f"({devs.source}); {_fix(cfg, cluster, world)}; or set parallel.memory_check=false "
                      f"to start it anyway")


def _fix(cfg: Config, cluster: Cluster, world: int) -> str:
    """A layout that fits, as the ``--set`` items that differ from ``cfg``, or why none does."""
    ests = plan(cfg, cluster, compile_options=(cfg.run.compile,))
    fits = [e for e in ests if e.feasible]
    if fits:
        best = fits[0]
        sets = _sets(cfg, best.layout)
        return (f"a layout that fits: {best.layout.name()} ({_gib(best.memory['total'])}): "
                f"{sets or 'the same fields'} (or --layout auto)")
    valid = [e for e in ests if e.memory]
    if not valid:
        return f"no layout of {world} workers is valid for this model"
    small = min(valid, key=lambda e: e.memory["total"])
    return (f"no layout of {world} workers fits (the smallest, {small.layout.name()}, needs "
            f"{_gib(small.memory['total'])}): add workers or devices with more memory")


def _sets(cfg: Config, layout: Layout) -> str:
    """The ``--set`` items that turn ``cfg``'s layout into ``layout``."""
    now = cfg.to_dict()
    new = apply_layout(Config.from_dict(_ungiven(now)), layout).to_dict()
    return " ".join(f"--set {sec}.{k}={_toml(v)}" for sec in ("parallel", "run") for k, v in new[sec].items()
                    if v != now[sec][k])


def _ungiven(d: dict) -> dict:
    """``d`` (a :meth:`Config.to_dict`) whose parallel fields count as not given, so that the
    suggested layout replaces them all."""
    record = getattr(d, "given", None)
    if record is not None:
        d.given = {**record, "parallel": frozenset()}
    return d


def _toml(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
