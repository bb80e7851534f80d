"""Shared fixtures: a tiny job and a small token directory, so every launch stays a few seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from allhands.config import Config, apply_override
from allhands.data import prepare
from allhands.data.shards import embedded_text
from allhands.launch.launcher import LaunchSpec, train_job

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
    out = tmp_path_factory.mktemp("tokens")
    docs = embedded_text().split("\n\n")[:300]
    prepare(docs, out, val_fraction=0.1)
    return out


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

# The network-lab job of test_node_loss and test_multinode_store: 8 steps, a checkpoint every 2,
# node loss noticed in 3 s. One thread per worker on every side, so that an in-process reference
# sums alike (bit-exact).
LAB_JOB = ["run.steps=8", "checkpoint.interval=2", "checkpoint.keep_last=5", "run.threads=1",
           "fault.max_restarts=2", "fault.backoff_s=0.5", "fault.node_timeout_s=3",
           "fault.rdzv_last_call_s=3"]


@pytest.fixture(scope="session")
def lab_undisturbed(token_dir, tmp_path_factory) -> Config:
    """The lab job undisturbed at the same world size (2 workers, in-process on this host): what
    a job whose lost host was started again must end bit-identical to. Trained once for the
    tests that only read its parameters (they use ``lab``, so they share a pytest worker)."""
    return train_job(tiny_config(token_dir, tmp_path_factory.mktemp("lab") / "undisturbed", *LAB_JOB),
                     LaunchSpec(nproc=2))


# Module-scoped fixtures that train a job or build a network lab, used by a few long tests. Under
# pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) each worker would build its own copy;
# the tests that use one go to one worker instead, so the job trains once. All lab users share
# one group: two labs at once would double the CPU load on tests whose keep-alive timeouts are
# seconds. (test_bad_inputs' `finished` is not here: its table of ~75 short commands gains more
# from two workers than a second tiny run costs.)
SHARED_FIXTURES = {"undisturbed": None, "lab": "netlab", "lab_undisturbed": "netlab"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        shared = sorted(set(SHARED_FIXTURES) & set(item.fixturenames))
        if shared and not item.get_closest_marker("xdist_group"):
            name = SHARED_FIXTURES[shared[0]] or f"{item.module.__name__}:{shared[0]}"
            item.add_marker(pytest.mark.xdist_group(name))
