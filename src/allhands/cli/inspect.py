"""``allhands config show`` and ``allhands plan``: look at a job before it runs."""

from __future__ import annotations

import argparse
import sys

from allhands.cli.common import job_args
from allhands.config import load_config, to_toml, validate
from allhands.errors import ConfigError


def cmd_config_show(args: argparse.Namespace) -> int:
    from allhands.models.resolve import resolve_model  # here, not at the top: it imports torch

    cfg = resolve_model(load_config(args.config, args.set))  # the shape a preset or init_from sets
    validate(cfg, need_data=False)
    sys.stdout.write(to_toml(cfg, with_docs=args.docs))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from allhands.plan import parse_cluster, plan
    from allhands.plan.search import format_plan, to_row
    from allhands.plan.usermodel import plan_command

    from allhands.models.resolve import resolve_model  # here, not at the top: it imports torch

    cfg = resolve_model(load_config(args.config, args.set))  # a preset's or init_from's shape
    validate(cfg, need_data=False)
    if args.nproc < 1 or args.top < 1 or args.tokens < 0:
        raise ConfigError("--nproc and --top must be >= 1 and --tokens >= 0")
    if args.model and args.check:
        raise ConfigError("--check trains the reference GPT's layouts; drop --model, or train the "
                          "chosen layout of your model with the Python API")
    if args.model:  # a user's model, measured on the meta device: data-parallel layouts
        print(plan_command(cfg, args.model, args.input, parse_cluster(args.cluster, args.nproc),
                           top=args.top, as_json=args.json))
        return 0
    if args.check and cfg.model.family == "llama" and cfg.moe.n_experts:
        raise ConfigError("--check trains dense models' layouts; a mixture of experts' predictions are "
                          "checked by bench/moe.py: drop --check or set moe.n_experts=0")
    if args.cluster.partition(",")[0].partition(":")[0] == "local":
        from allhands.plan.calibrate import calibrate, recalibrated

        calibrate(args.nproc)  # once per machine: gloo, step overheads, worker memory (cached)
    if args.check:
        from allhands.plan.check import check, format_check

        if args.cluster != "local":
            raise ConfigError(f"--check runs layouts on this machine; drop --cluster {args.cluster} "
                              f"(or pass --cluster local)")
        cluster = parse_cluster("local", args.nproc)
        rows = check(cfg, plan(cfg, cluster, compile_options=(False,), ac_options=("none",)),
                     cluster, steps=args.steps, refresh=recalibrated(cfg, args.nproc))
        print(json.dumps([c.row() for c in rows], indent=1) if args.json else format_check(rows))
        return 0
    cluster = parse_cluster(args.cluster, args.nproc)
    estimates = plan(cfg, cluster)
    print(json.dumps({"cluster": vars(cluster), "layouts": [to_row(e, args.tokens) for e in estimates]})
          if args.json else format_plan(estimates, cluster, top=args.top, tokens=args.tokens))
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the resolved config")
    job_args(cs, " (default: the built-in defaults)")
    cs.add_argument("--docs", action="store_true", help="add each field's doc as a comment")
    cs.set_defaults(fn=cmd_config_show, parser=cs)  # its own flags for "did you mean"

    pl = sub.add_parser("plan", help="predict every layout's per-rank memory, step time and MFU on "
                                     "a cluster before launch")
    job_args(pl, " (model, batch, precision, optimizer)")
    pl.add_argument("--cluster", default="local", metavar="SPEC",
                    help="PRESET[:NODES][,KEY=VALUE...]: a100, h100, h200 (8 per node) or local "
                         "(this machine, measured), e.g. h100:16 or h100:4,inter_gbs=25")
    pl.add_argument("--nproc", type=int, default=2, help="workers of --cluster local and --check (default 2)")
    pl.add_argument("--tokens", type=float, default=0, help="token budget: time and accelerator-hours for it")
    pl.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    pl.add_argument("--json", action="store_true", help="every layout as JSON")
    pl.add_argument("--check", action="store_true",
                    help="train each layout that fits this machine a few steps; predicted vs measured")
    pl.add_argument("--steps", type=int, default=6, help="steps per layout under --check (default 6)")
    pl.add_argument("--model", default="", metavar="MODULE:BUILDER",
                    help="your model: a function (config) -> nn.Module (data-parallel layouts)")
    pl.add_argument("--input", default="", metavar="SHAPE[:DTYPE]",
                    help="one sample for --model, e.g. 3x32x32 or 128:int64 (default: token ids)")
    pl.set_defaults(fn=cmd_plan)
