"""The workers' environment for a GPU cluster, checked on CPU: NCCL's bootstrap on the interface
the other nodes reach, torch's NCCL flight recorder dumping into the run's logs, threads from the
cores the launcher may use; each left alone where the user set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from allhands.launch.launcher import (LaunchSpec, flight_recorder_env, launch, socket_interfaces,
                                      worker_threads)

from conftest import ROOT

MULTI = LaunchSpec(nnodes=2, rdzv_endpoint="127.0.0.1:29400", local_addr="127.0.0.1")
FR_BUFFER, FR_FILE = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if torch.__version__ >= "2.11" \
    else ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def test_nccl_bootstraps_where_gloo_listens_unless_the_user_chose():
    both = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_interfaces(MULTI, {}) == both  # --local-addr 127.0.0.1 is on lo
    assert socket_interfaces(MULTI, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert socket_interfaces(MULTI, {"GLOO_SOCKET_IFNAME": "eth1"}) == {}  # both are the user's
    assert socket_interfaces(LaunchSpec(nproc=2), {}) == both
    assert socket_interfaces(LaunchSpec(nproc=2), {"NCCL_SOCKET_IFNAME": "ib0"})["NCCL_SOCKET_IFNAME"] == "ib0"


def test_the_flight_recorder_dumps_into_the_logs_unless_the_user_set_it():
    logs = Path("/runs/x/logs")
    assert flight_recorder_env(logs, {}) == {FR_BUFFER: "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                             FR_FILE: "/runs/x/logs/nccl_trace_rank_"}
    theirs = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/fr_"}
    assert flight_recorder_env(logs, theirs) == {}
    assert flight_recorder_env(logs, {"TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr_"}).keys() == {
        FR_BUFFER, "TORCH_NCCL_DUMP_ON_TIMEOUT"}


def test_threads_come_from_the_cpu_affinity_not_the_host():
    """One core allowed (Slurm's cgroup or taskset) of however many the host has: one thread."""
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from allhands.launch.launcher import worker_threads; print(worker_threads(1), os.cpu_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    threads, host = map(int, out.stdout.split())
    assert threads == 1 and host >= 1
    assert worker_threads(len(os.sched_getaffinity(0)) + 1) == 1  # never 0


PASSED = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_DUMP_ON_TIMEOUT", FR_BUFFER, FR_FILE)


def env_probe(out: str) -> None:
    """A worker's entry point: the variables above as it sees them."""
    Path(out, "env.json").write_text(json.dumps({k: os.environ.get(k) for k in PASSED}))


def test_the_workers_get_them_and_the_launcher_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's: kept
    monkeypatch.delenv(FR_FILE, raising=False)
    logs = tmp_path / "run" / "logs"
    launch(env_probe, (str(tmp_path),), LaunchSpec(nproc=1), threads=1, log_dir=logs)
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                    FR_BUFFER: "2000", FR_FILE: f"{logs}/nccl_trace_rank_"}
    assert logs.is_dir() and FR_FILE not in os.environ  # the next job's are its own
