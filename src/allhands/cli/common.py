"""What the command groups share: the job arguments (CONFIG and ``--set``)."""

from __future__ import annotations

import argparse


def job_args(p: argparse.ArgumentParser, config_help: str = "") -> None:
    p.add_argument("config", nargs="?", help="TOML job config" + config_help)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable)")
