"""Shared fixtures: a tiny job and a small token directory, so every launch stays a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from allhands.config import Config, apply_override
from allhands.data import prepare
from allhands.data.shards import embedded_text
from allhands.launch.launcher import LaunchSpec, train_job

import isolation
import zygote
from isolation import shared_once

# `python -m allhands.cli ...` children forked from a server that imported torch once (zygote.py)
zygote.install()

# The isolation plugin's hooks and fixture (tests/isolation.py), registered as this conftest's.
pytest_configure = isolation.pytest_configure
pytest_collection_modifyitems = isolation.pytest_collection_modifyitems
pytest_sessionstart = isolation.pytest_sessionstart
pytest_sessionfinish = isolation.pytest_sessionfinish
_exclusive_marked = isolation._exclusive_marked

ROOT = Path(__file__).resolve().parents[1]

# model.bias=false: the key projection's bias cannot change any output (it adds the same q.b_k to
# every score of a softmax row), so its true gradient is 0 and its computed one is rounding noise
# that Adam's normalisation turns into lr-sized steps. That one parameter, not data parallelism,
# would decide a parity comparison; without biases every parameter is identifiable.
TINY = [
    "model.bias=false", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.seq_len=16",
    "run.steps=4", "run.global_batch=12", "run.eval_interval=0", "run.seed=3",
    "optim.warmup_steps=2", "optim.lr=1e-2", "data.eval_batches=1",
    "checkpoint.interval=0", "log.progress=false", "log.tensorboard=false",
    "log.interval=1",  # a record per step, which many tests read (the default logs every 10th)
]


@pytest.fixture(autouse=True)
def _no_stop_left_over():
    """The process's stop flag starts clear: a test that stopped a job in-process (the API's
    Ctrl-C) leaves it set, and a later test in the same pytest worker would see a stop."""
    from allhands.stopflag import FLAG
    FLAG.signum = 0
    yield


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory) -> Path:
    """300 documents of the embedded corpus as token shards, prepared once per test run."""
    def build(directory: Path) -> str:
        prepare(embedded_text().split("\n\n")[:300], directory, val_fraction=0.1)
        return str(directory)
    return Path(shared_once(tmp_path_factory, "tokens", build))


def tiny_config(token_dir: Path, run_dir: Path, *extra: str) -> Config:
    cfg = Config()
    for item in (*TINY, f"data.path={token_dir}", f"run.dir={run_dir}", *extra):
        apply_override(cfg, item)
    return cfg


@pytest.fixture
def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


ALLHANDS = [sys.executable, "-m", "allhands.cli"]


def cli(argv: list[str], capfd) -> subprocess.CompletedProcess:
    """``allhands ARGV`` in this process, through the command's own entry (its parsing, its
    one error line, its exit code), with what it and its workers wrote: for the tests whose
    point is the command, not its process (a process of its own costs about 4 s of CPU to import
    torch and the trainer again)."""
    from allhands.cli import main

    capfd.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)

# The network-lab job of test_node_loss and test_multinode_store: 8 steps, a checkpoint every 2,
# node loss noticed in 3 s. One thread per worker on every side, so that an in-process reference
# sums alike (bit-exact).
LAB_JOB = ["run.steps=8", "checkpoint.interval=2", "checkpoint.keep_last=5", "run.threads=1",
           "fault.max_restarts=2", "fault.backoff_s=0.5", "fault.node_timeout_s=3",
           "fault.rdzv_last_call_s=3"]


@pytest.fixture(scope="session")
def lab_undisturbed(token_dir, tmp_path_factory) -> Config:
    """The lab job undisturbed at the same world size (2 workers, in-process on this host): what
    a job whose lost host was started again must end bit-identical to. Trained once per test
    run, whichever worker asks first, for the tests that only read its parameters."""
    def build(directory: Path) -> dict:
        return train_job(tiny_config(token_dir, directory / "undisturbed", *LAB_JOB),
                         LaunchSpec(nproc=2)).to_dict()
    return Config.from_dict(shared_once(tmp_path_factory, "lab_undisturbed", build))
