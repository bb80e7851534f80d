"""The ``allhands`` command: parses, validates and hands over; no training logic here. One module
per command group (jobs.py: train, drill, launch, rendezvous-store; inspect.py: config show,
plan; data.py: prepare, export, report); this one builds the parser and runs a command.

Exit codes: 0 success, 1 a failed job (a worker, a checkpoint, a port), 2 invalid input
(config, arguments) detected before any worker started.

Each subcommand imports what it runs inside its own function, for start-up time: ``allhands
--help`` and ``allhands config show`` never import torch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import gc
import importlib.metadata
import os
import sys
import threading
import warnings
from typing import NoReturn

from allhands import __version__
from allhands.cli import data, inspect, jobs
from allhands.errors import AllhandsError, Interrupted
from allhands.launch import owner

# Warnings a user of the command cannot act on, filtered here and nowhere else. DCP warns that
# it loads "in a single process" whenever no process group exists, which is what `export` and
# `drill` (reading the final weights) mean to do.
QUIET_WARNINGS = [
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized"),
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="allhands", description="Distributed training on torch.distributed.")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", required=True)
    for group in (jobs, inspect, data):
        group.add_parsers(sub)
    for parser in sub.choices.values():
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
    if argv is None:  # the command itself: the process is ours (launch/owner.py)
        owner.mark_own()
    code = _run(argv)
    if argv is None:  # the command itself
        _leave(code)
    return code


def _run(argv: list[str] | None) -> int:
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


def _leave(code: int) -> NoReturn:
    """End the command with ``code`` and without the interpreter's teardown. Python's exit
    handlers still run (multiprocessing removes its temporary directory), then ``os._exit``:
    ``exit()`` would also run torch's C++ static destructors, and one of them can meet a thread
    still running (a TCPStore server torch keeps for reuse) and abort the process ("terminate
    called without an active exception", exit 134) after the job's last line was said, turning
    a requeue's 75 or a success's 0 into a crash. Skipping the teardown also skips collecting
    torch's whole heap (seconds on a loaded machine; everything is closed by now)."""
    gc.freeze()
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()  # what the interpreter's own shutdown waits for
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
