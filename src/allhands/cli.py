"""The ``allhands`` command: parses, validates and hands over; no training logic here.

Exit codes: 0 success, 1 a failed job (a worker, a checkpoint, a port), 2 invalid input
(config, arguments) detected before any worker started.

Each subcommand imports what it runs inside its own function, for start-up time: ``allhands
--help`` and ``allhands config show`` never import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from allhands.config import load_config, to_toml, validate
from allhands.errors import AllhandsError, ConfigError


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers and nodes")
    g.add_argument("--nproc", type=int, default=0,
                   help="worker processes on this node (default: one per GPU, or 2 on CPU)")
    g.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="nodes in the job (default 1); MIN:MAX lets it continue on fewer nodes")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank; node 0 hosts the rendezvous (unless --rdzv-store "
                        "external)")
    g.add_argument("--rdzv-endpoint", default="",
                   help="HOST:PORT of the c10d rendezvous on node 0 (multi-node), or of the "
                        "`allhands rendezvous-store` process with --rdzv-store external")
    g.add_argument("--rdzv-store", default="node0", choices=("node0", "external"),
                   help="who serves the rendezvous store: node 0 (default; losing node 0 ends "
                        "the job) or an `allhands rendezvous-store` process (any node may be lost)")
    g.add_argument("--local-addr", default="",
                   help="this node's address as the other nodes reach it (multi-node)")
    g.add_argument("--port", type=int, default=0,
                   help="single-node rendezvous port on 127.0.0.1 (default: a free one)")
    g.add_argument("--max-restarts", type=int, default=-1,
                   help="restart all workers this many times after a failure (default: "
                        "fault.max_restarts of the config, else 0)")
    s = p.add_argument_group("security (SECURITY.md)")
    s.add_argument("--bind", default="", metavar="ADDR",
                   help="address this node's listeners bind to (default: 127.0.0.1 on one node; "
                        "the --rdzv-endpoint host or --local-addr on many); 0.0.0.0 = every "
                        "interface")
    s.add_argument("--secret-file", default="", metavar="PATH",
                   help="file with the job secret, the same on every node (multi-node; or set "
                        "ALLHANDS_SECRET / ALLHANDS_SECRET_FILE); must not be world-readable")
    s.add_argument("--insecure", action="store_true",
                   help="no job secret: any process that reaches the stores can join (not advised)")


def _spec(args: argparse.Namespace):
    from allhands.launch.launcher import LaunchSpec

    lo, _, hi = str(args.nnodes).partition(":")
    if not (lo.isdigit() and (hi or lo).isdigit()):
        raise ConfigError(f"--nnodes: {args.nnodes!r} is not N or MIN:MAX, e.g. 2 or 1:2")
    return LaunchSpec(nproc=args.nproc, nnodes=int(hi or lo), node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, local_addr=args.local_addr, port=args.port,
                      max_restarts=args.max_restarts, min_nodes=int(lo) if hi else 0,
                      bind=args.bind, secret_file=args.secret_file, insecure=args.insecure,
                      rdzv_store=args.rdzv_store)


def _config_from(args: argparse.Namespace):
    """--resume RUN_DIR takes the run's own resolved config; --set still overrides it."""
    path = args.config
    if getattr(args, "resume", None):
        resolved = Path(args.resume) / "config.resolved.toml"
        if not resolved.is_file():
            raise ConfigError(f"--resume: {args.resume!r} has no config.resolved.toml; "
                              f"pass a run directory made by `allhands train`")
        if path:
            raise ConfigError("--resume: takes the run's own config; drop CONFIG or use --set")
        path = resolved
    return load_config(path, args.set)


def cmd_train(args: argparse.Namespace) -> int:
    from allhands.launch.launcher import train_job

    cfg = _config_from(args)
    spec = _spec(args).validated()
    train_job(cfg, spec, resume=args.resume)
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    from allhands.drill import run_drill

    if args.faults < 1:
        raise ConfigError(f"--faults: {args.faults} is not allowed; must be >= 1")
    cfg = load_config(args.config, args.set)
    validate(cfg)
    return 0 if run_drill(cfg, _spec(args), faults=args.faults, seed=args.seed) else 1


def cmd_launch(args: argparse.Namespace) -> int:
    from allhands.launch.launcher import launch

    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {args.script!r} does not exist; pass the path of a Python file")
    launch(sys.executable, ("-u", str(script), *args.script_args), _spec(args))
    return 0


def cmd_rendezvous_store(args: argparse.Namespace) -> int:
    from allhands.launch.launcher import check_bind
    from allhands.launch.rendezvous import serve_store

    check_bind(args.bind)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not allowed; must be in [0, 65535]")
    serve_store(args.bind, args.port)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    validate(cfg, need_data=False)
    sys.stdout.write(to_toml(cfg, with_docs=args.docs))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from allhands.data import prepare

    texts = []
    for name in args.text_files:
        p = Path(name)
        if not p.is_file():
            raise ConfigError(f"text file {name!r} does not exist; pass existing UTF-8 text files")
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"text file {name!r} is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val-fraction: {args.val_fraction} is not allowed; must be in (0, 1)")
    meta = prepare(texts, args.out, val_fraction=args.val_fraction)
    n = {k: sum(e["tokens"] for e in v) for k, v in meta["splits"].items()}
    print(f"allhands: wrote {n['train']:,} train and {n['val']:,} val tokens to {args.out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from allhands.report import make_report

    for path in make_report(Path(args.run_dir)):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from allhands.checkpoint.export import export_weights

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"export: {args.run_dir!r} is not a directory; pass a run directory")
    out = export_weights(args.run_dir, args.out, step=args.step)
    print(f"allhands: wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from allhands.plan import parse_cluster, plan
    from allhands.plan.search import format_plan, to_row

    cfg = load_config(args.config, args.set)
    validate(cfg, need_data=False)
    if args.nproc < 1 or args.top < 1 or args.tokens < 0:
        raise ConfigError("--nproc and --top must be >= 1 and --tokens >= 0")
    if args.cluster.partition(",")[0].partition(":")[0] == "local":
        from allhands.plan.calibrate import calibrate
        from allhands.plan.localtime import cached_calibration, calibration_path

        if cached_calibration(args.nproc) is None:
            print(f"allhands plan: measuring this machine for {args.nproc} workers once (about a "
                  f"minute; cached in {calibration_path()})", file=sys.stderr, flush=True)
        calibrate(args.nproc)  # once per machine: gloo, step overheads, worker memory (cached)
    if args.check:
        from allhands.plan.check import check, format_check

        if args.cluster != "local":
            raise ConfigError(f"--check runs layouts on this machine; drop --cluster {args.cluster} "
                              f"(or pass --cluster local)")
        cluster = parse_cluster("local", args.nproc)
        rows = check(cfg, plan(cfg, cluster, compile_options=(False,), ac_options=("none",)),
                     cluster, steps=args.steps)
        print(json.dumps([c.row() for c in rows], indent=1) if args.json else format_check(rows))
        return 0
    cluster = parse_cluster(args.cluster, args.nproc)
    estimates = plan(cfg, cluster)
    if args.json:
        print(json.dumps({"cluster": vars(cluster), "layouts": [to_row(e, args.tokens) for e in estimates]}))
    else:
        print(format_plan(estimates, cluster, top=args.top, tokens=args.tokens))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="allhands", description="Distributed training on torch.distributed.")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (the embedded default job without CONFIG)")
    t.add_argument("config", nargs="?", help="TOML job config")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _add_launch_args(t)
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("drill", help="run a job undisturbed and with seeded faults; compare recovery")
    d.add_argument("config", nargs="?", help="TOML job config")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    d.add_argument("--faults", type=int, default=3, help="faults to inject (default 3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the fault plan (default 0)")
    _add_launch_args(d)
    d.set_defaults(fn=cmd_drill)

    la = sub.add_parser("launch", help="run your own script that uses the Python API on N workers")
    _add_launch_args(la)
    la.add_argument("script")
    la.add_argument("script_args", nargs=argparse.REMAINDER)
    la.set_defaults(fn=cmd_launch)

    rs = sub.add_parser("rendezvous-store",
                        help="serve a job's rendezvous store apart from its nodes, so that any "
                             "node may be lost (train --rdzv-store external on every node)")
    rs.add_argument("--bind", required=True, metavar="ADDR",
                    help="address to listen on, one the training nodes reach")
    rs.add_argument("--port", type=int, default=29400, help="port (default 29400)")
    rs.set_defaults(fn=cmd_rendezvous_store)

    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the resolved config")
    cs.add_argument("config", nargs="?")
    cs.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    cs.add_argument("--docs", action="store_true", help="add each field's doc as a comment")
    cs.set_defaults(fn=cmd_config_show)

    p = sub.add_parser("prepare", help="turn text files into token shards")
    p.add_argument("text_files", nargs="+")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of tokens")
    p.set_defaults(fn=cmd_prepare)

    e = sub.add_parser("export", help="write a run's weights as one .safetensors file "
                                      "(start a run from it with checkpoint.init_from)")
    e.add_argument("run_dir")
    e.add_argument("--out", required=True, help="output .safetensors file")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    e.set_defaults(fn=cmd_export)

    pl = sub.add_parser("plan", help="predict every layout's per-rank memory, step time and MFU on "
                                     "a cluster before launch")
    pl.add_argument("config", nargs="?", help="TOML job config (model, batch, precision, optimizer)")
    pl.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
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
    pl.set_defaults(fn=cmd_plan)

    r = sub.add_parser("report", help="draw PNG plots of a run")
    r.add_argument("run_dir")
    r.set_defaults(fn=cmd_report)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AllhandsError as e:
        print(f"allhands: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("allhands: interrupted; the last committed checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
