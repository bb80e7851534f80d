"""``allhands train``, ``drill``, ``launch`` and ``rendezvous-store``: the commands that start
workers, with the worker and node flags they share (torchrun's spellings accepted)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from allhands.cli.common import job_args
from allhands.config import apply_override, load_config, validate
from allhands.errors import ConfigError


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
                        "`allhands rendezvous-store` process with --rdzv-store external; node 0 "
                        "may be given port 0 (a free one, said in its 'listening on' line)")
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
                      rdzv_store=args.rdzv_store, verbose=getattr(args, "verbose", False))


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
    t0 = time.time()
    from allhands.launch.launcher import train_job
    from allhands.launch.rundir import completed_step

    if args.verbose:  # the rest of the start-up is said by the launcher and rank 0
        print(f"allhands: importing torch and the launcher took {time.time() - t0:.3f} s",
              file=sys.stderr, flush=True)

    cfg = _config_from(args)
    if args.layout:
        apply_override(cfg, f"parallel.layout={args.layout}")
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
    from allhands.launch.rundir import with_data

    if args.faults < 1:
        raise ConfigError(f"--faults: {args.faults} is not allowed; must be >= 1")
    cfg = with_data(load_config(args.config, args.set))  # its comparisons read the data too
    validate(cfg)
    if args.chaos is not None:
        from allhands.chaos.run import run_chaos

        if args.chaos <= 0:
            raise ConfigError(f"--chaos: {args.chaos:g} is not allowed; must be > 0 seconds")
        return 0 if run_chaos(cfg, _spec(args), config_path=args.config, sets=args.set,
                              duration_s=args.chaos, seed=args.seed) else 1
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


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a model (the embedded default job without CONFIG)")
    job_args(t)
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--layout", choices=("auto", "manual"), default=None,
                   help="auto: train the fastest layout the planner predicts to fit the devices found "
                        "(parallel.* fields you set still win); the same as --set parallel.layout=auto")
    t.add_argument("--verbose", action="store_true",
                   help="say how long each start-up phase took, from the command to the first step")
    _add_launch_args(t)
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("drill", help="run a job undisturbed and with seeded faults; compare recovery")
    job_args(d)
    d.add_argument("--faults", type=int, default=3, help="faults to inject (default 3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the fault plan (default 0)")
    d.add_argument("--chaos", type=float, default=None, metavar="SECONDS",
                   help="chaos mode: one random fault of any kind per 10 s of SECONDS over one run, "
                        "then the invariant checker's table (docs/faults.md)")
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
    rs.add_argument("--port", type=int, default=29400,
                    help="port (default 29400; 0: a free one, said in its 'listening on' line)")
    rs.set_defaults(fn=cmd_rendezvous_store)
