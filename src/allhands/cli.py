"""The ``allhands`` command: parses, validates and hands over; no training logic here.

Exit codes: 0 success, 1 a failed job (a worker, a checkpoint, a port), 2 invalid input
(config, arguments) detected before any worker started.

Each subcommand imports what it runs inside its own function, for start-up time: ``allhands
--help`` and ``allhands config show`` never import torch.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import importlib.metadata
import sys
import warnings
from pathlib import Path

from allhands import __version__
from allhands.config import load_config, to_toml, validate
from allhands.errors import AllhandsError, ConfigError, Interrupted

# Warnings a user of the command cannot act on, filtered here and nowhere else. DCP warns that
# it loads "in a single process" whenever no process group exists, which is what `export` and
# `drill` (reading the final weights) mean to do.
QUIET_WARNINGS = [
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized"),
]


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    # The second spellings are torchrun's, accepted where they mean the same here.
    g = p.add_argument_group("workers and nodes (torchrun's spellings are accepted too)")
    g.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", type=int, default=None,
                   metavar="N", help="worker processes on this node, >= 1 (default: one per GPU, or 2 on CPU)")
    g.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="nodes in the job (default 1); MIN:MAX lets it continue on fewer nodes")
    g.add_argument("--standalone", action="store_true",
                   help="one node with a rendezvous on a free local port: the default already")
    g.add_argument("--node-rank", "--node_rank", type=int, default=0,
                   help="this node's rank; node 0 hosts the rendezvous (unless --rdzv-store external)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="HOST:PORT of the c10d rendezvous on node 0 (multi-node), or of the "
                        "`allhands rendezvous-store` process with --rdzv-store external")
    g.add_argument("--rdzv-store", default="node0", choices=("node0", "external"),
                   help="who serves the rendezvous store: node 0 (default; losing node 0 ends "
                        "the job) or an `allhands rendezvous-store` process (any node may be lost)")
    g.add_argument("--local-addr", "--local_addr", default="",
                   help="this node's address as the other nodes reach it (multi-node)")
    g.add_argument("--port", "--master-port", "--master_port", type=int, default=0,
                   help="single-node rendezvous port on 127.0.0.1, 1-65535 (default: a free one)")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=None,
                   help="restart all workers this many times after a failure, >= 0 (default: "
                        "fault.max_restarts of the config, 3 unless set; 0 turns recovery off)")
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
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc: {args.nproc} is not allowed; must be >= 1 (leave it out for "
                          f"one worker per GPU, or 2 on CPU)")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max-restarts: {args.max_restarts} is not allowed; must be >= 0")
    if args.standalone and (int(hi or lo) > 1 or args.rdzv_endpoint):
        raise ConfigError("--standalone: means a single node; drop it, or drop --nnodes and "
                          "--rdzv-endpoint")
    return LaunchSpec(nproc=args.nproc or 0, nnodes=int(hi or lo), node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, local_addr=args.local_addr, port=args.port,
                      max_restarts=-1 if args.max_restarts is None else args.max_restarts,
                      min_nodes=int(lo) if hi else 0,
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
    from allhands.launch.rundir import completed_step

    cfg = _config_from(args)
    spec = _spec(args).validated()
    done = completed_step(args.resume, cfg.run.steps) if args.resume else None
    if done is not None:  # resuming would train nothing and log the last evaluation again
        print(f"allhands: {args.resume} is complete at step {done} (run.steps={cfg.run.steps}); "
              f"nothing to do. To train further: allhands train --resume {args.resume} --set "
              f"run.steps={2 * done}", file=sys.stderr)
        return 0
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


def _bpe_vocab(spec: str) -> int:
    kind, _, vocab = spec.partition(":")
    if kind != "bpe" or not vocab.isdigit():
        raise ConfigError(f"--train-tokenizer: {spec!r} is not allowed; use bpe:VOCAB, e.g. bpe:8192")
    return int(vocab)


def cmd_prepare(args: argparse.Namespace) -> int:
    from allhands.data.corpus import prepare_corpus, wrote
    from allhands.errors import DataError

    if args.workers < 0:
        raise ConfigError(f"--workers: {args.workers} is not allowed; must be >= 0 (0 = one per core)")
    try:
        meta = prepare_corpus(args.inputs, args.out, format=args.format, tokenizer=args.tokenizer,
                              field=args.field, eot=args.eot, val_fraction=args.val_fraction,
                              train_bpe_vocab=_bpe_vocab(args.train_tokenizer) if args.train_tokenizer else 0,
                              workers=args.workers, progress=not args.quiet and sys.stderr.isatty())
    except DataError as e:  # bad input found before any shard is written: invalid input, exit 2
        raise ConfigError(str(e)) from None
    except KeyboardInterrupt:
        print("allhands: interrupted; run the same command again to continue where it stopped",
              file=sys.stderr)
        return 130
    print(f"allhands: wrote {wrote(meta)} to {args.out} "
          f"(tokenizer {meta['tokenizer']}, vocabulary {meta['vocab_size']:,}, {meta['dtype']})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from allhands.report import make_report

    for path in make_report(Path(args.run_dir)):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from allhands.checkpoint.export import export_hf, export_weights
    from allhands.errors import DataError

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"export: {args.run_dir!r} is not a directory; pass a run directory")
    if args.format == "safetensors":
        out = export_weights(args.run_dir, args.out, step=args.step)
    else:
        try:
            out, note = export_hf(args.run_dir, args.out, step=args.step)
        except DataError as e:  # the tokenizers library is missing
            raise ConfigError(str(e)) from None
        if note:
            print(f"allhands: {note}", file=sys.stderr)
    print(f"allhands: wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from allhands.plan import parse_cluster, plan
    from allhands.plan.search import format_plan, to_row
    from allhands.plan.usermodel import plan_command

    cfg = load_config(args.config, args.set)
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


def _job_args(p: argparse.ArgumentParser, config_help: str = "") -> None:
    p.add_argument("config", nargs="?", help="TOML job config" + config_help)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="allhands", description="Distributed training on torch.distributed.")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (the embedded default job without CONFIG)")
    _job_args(t)
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _add_launch_args(t)
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("drill", help="run a job undisturbed and with seeded faults; compare recovery")
    _job_args(d)
    d.add_argument("--faults", type=int, default=3, help="faults to inject (default 3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the fault plan (default 0)")
    _add_launch_args(d)
    d.set_defaults(fn=cmd_drill)

    la = sub.add_parser("launch", help="run your own script that uses the Python API on N workers")
    _add_launch_args(la)
    la.add_argument("script", help="your Python script; it calls allhands.train on every worker")
    la.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
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
    _job_args(cs, " (default: the built-in defaults)")
    cs.add_argument("--docs", action="store_true", help="add each field's doc as a comment")
    cs.set_defaults(fn=cmd_config_show)

    p = sub.add_parser("prepare", help="turn a local corpus into token shards (started again, it continues)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, globs or directories: .txt (one document each), .jsonl[.gz|.zst], "
                        ".parquet, .arrow, or a datasets save_to_disk directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--field", "--column", dest="field", default="text",
                   help="JSON field or parquet/Arrow column holding the text (default: text)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|TOKENIZER_JSON|HF_DIR",
                   help="byte (default), a tokenizer.json, or a transformers tokenizer directory")
    p.add_argument("--format", default="auto", choices=("auto", "text", "instruct"),
                   help="instruct: prompt/response or chat rows, loss on the responses (docs/data.md)")
    p.add_argument("--train-tokenizer", default="", metavar="bpe:VOCAB",
                   help="train a byte-level BPE with VOCAB ids on the inputs and use it")
    p.add_argument("--eot", default="", metavar="TOKEN",
                   help="end-of-document token of --tokenizer (default: <|endoftext|>, </s>, ...)")
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: one per core)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none when stderr is no terminal)")
    p.set_defaults(fn=cmd_prepare)

    e = sub.add_parser("export", help="write a run's weights as one .safetensors file or a "
                                      "transformers GPT-2 directory (start a run from either "
                                      "with checkpoint.init_from)")
    e.add_argument("run_dir", help="a run directory made by `allhands train`")
    e.add_argument("--out", required=True, help="output file (its name must end in .safetensors), "
                                                "or a directory with --format hf")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors (allhands' names) or hf: config.json, model.safetensors and "
                        "the tokenizer, for GPT2LMHeadModel.from_pretrained")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    e.set_defaults(fn=cmd_export)

    pl = sub.add_parser("plan", help="predict every layout's per-rank memory, step time and MFU on "
                                     "a cluster before launch")
    _job_args(pl, " (model, batch, precision, optimizer)")
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

    r = sub.add_parser("report", help="draw PNG plots of a run")
    r.add_argument("run_dir", help="a run directory made by `allhands train`; plots go to RUN_DIR/report")
    r.set_defaults(fn=cmd_report)
    for name, parser in (*sub.choices.items(), ("show", cs)):
        parser.set_defaults(parser=parser)
    return ap


def _version() -> str:
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return f"allhands {__version__} (torch {torch})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse; an unknown flag is reported with the usage of the subcommand it was given to,
    and its closest spelling there."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        flags = [o for a in args.parser._actions for o in a.option_strings]
        close = difflib.get_close_matches(extra[0].split("=")[0], flags, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close and extra[0].startswith("-") else ""
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    try:
        return args.fn(args)
    except Interrupted as e:  # a stop on a signal is no error: its own line and exit code
        print(e, file=sys.stderr)
        return e.exit_code
    except AllhandsError as e:
        print(f"allhands: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("allhands: interrupted; the last committed checkpoint is intact", file=sys.stderr)
        return 130
    finally:
        if argv is None:  # the command itself, on every exit: skip a collection of torch's whole
            gc.freeze()   # heap (seconds on a loaded machine; everything is closed by now)


if __name__ == "__main__":
    sys.exit(main())
