"""Recovery time after losing a whole host, in the network lab (needs root).

Two lab hosts x 1 worker train the tiny job (``--nnodes 1:2``); once the step-4 checkpoint is
committed, every process of host 1 (launcher, torch's agent, worker) is SIGKILLed and host 1
stays down. In the ``node0-external`` setting a third host serves the rendezvous store
(``allhands rendezvous-store``, both nodes ``--rdzv-store external``) and the host killed is the
one with node rank 0 (worker rank 0, the first round's worker store), which the default layout
cannot lose. The survivor's figures, per setting of the rendezvous timeouts:

- detect: from the kill to the survivor's one-line failure report (gloo's connection reset,
  then ``fault.backoff_s``);
- rendezvous: the survivor's re-rendezvous, as it reports it (the dead node's keep-alives
  expiring after ``fault.node_timeout_s``, then ``fault.rdzv_last_call_s``);
- recover: from the kill to the first step completed at the smaller world size (detection,
  rendezvous, a new worker, checkpoint load, one step).

    python bench/node_loss.py [--repeats 2] [--lab-tag ahm --lab-prefix 10.61.0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

SETTINGS = {  # name: (fault.node_timeout_s, fault.rdzv_last_call_s, external store)
    "defaults": (15, 10, False),
    "short": (3, 3, False),
    "node0-external": (3, 3, True),
}


def one_run(lab, token_dir: Path, work: Path, node_timeout: float, last_call: float,
            external: bool = False) -> dict:
    from allhands.checkpoint import committed
    from conftest import ALLHANDS, TINY

    run_dir = work / "run"
    sets = [*TINY, f"data.path={token_dir}", f"run.dir={run_dir}", "run.steps=8",
            "checkpoint.interval=2", "checkpoint.keep_last=5",
            # the worker of the host to be killed stalls before step 5: the kill lands after step 4
            f"fault.inject={0 if external else 1}:5:hang",
            "fault.max_restarts=2", "fault.backoff_s=0.5", f"fault.node_timeout_s={node_timeout}",
            f"fault.rdzv_last_call_s={last_call}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               ALLHANDS_SECRET="bench-node-loss-" + "x" * 16)
    env.pop("GLOO_SOCKET_IFNAME", None)

    store_host = lab.hosts[2]
    endpoint = f"{store_host.addr if external else lab.hosts[0].addr}:29400"

    def start(rank: int, **kw) -> subprocess.Popen:
        host = lab.hosts[rank]
        cmd = [*ALLHANDS, "train", "--nnodes", "1:2", "--node-rank", str(rank), "--nproc", "1",
               "--rdzv-endpoint", endpoint, "--local-addr", host.addr,
               *(["--rdzv-store", "external"] if external else []),
               *(x for s in sets for x in ("--set", s))]
        return host.popen(cmd, env=env, text=True, **kw)

    # Both nodes dial the rendezvous store until it listens, so they join it together.
    lost, survivor = (0, 1) if external else (1, 0)
    lost_p = start(lost, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    surv_p = start(survivor, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    store = None
    if external:
        time.sleep(2)
        store = store_host.popen([*ALLHANDS, "rendezvous-store", "--bind", store_host.addr],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in surv_p.stdout:
            lines.append((time.time(), line))

    import threading

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not any(s >= 4 for s, _ in committed(run_dir / "checkpoints")):
        if surv_p.poll() is not None:
            raise RuntimeError("the survivor ended before the kill:\n" + "".join(x for _, x in lines)[-2000:])
        time.sleep(0.1)
    killed = time.time()
    os.killpg(lost_p.pid, signal.SIGKILL)
    lost_p.wait()
    if surv_p.wait(timeout=600) != 0:
        raise RuntimeError("the survivor failed:\n" + "".join(x for _, x in lines)[-2000:])
    reader.join(timeout=10)
    if store is not None:
        store.terminate()
        store.wait(timeout=30)
    detect = next(t for t, x in lines if "restart 1/2" in x) - killed
    rdzv = float(re.search(r"re-rendezvous done in ([\d.]+) s", "".join(x for _, x in lines)).group(1))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = min(r["time"] for r in recs if "loss" in r and len(r["step_time_rank"]) == 1)
    if any(len(r["step_time_rank"]) != 2 for r in recs if "loss" in r and r["step"] <= 4):
        raise RuntimeError("the job did not start with both nodes")
    return {"detect": detect, "rendezvous": rdzv, "recover": first - killed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lab-tag", default="ahm", help="prefix of the lab's namespace and link names")
    ap.add_argument("--lab-prefix", default="10.61.0", help="the lab hosts' /24")
    args = ap.parse_args()

    from allhands.data import prepare
    from allhands.data.shards import embedded_text
    from allhands.netlab import Lab, unavailable

    if unavailable():
        sys.exit(f"node_loss: {unavailable()}")
    work = Path(tempfile.mkdtemp(prefix="allhands-bench-node-loss-"))
    token_dir = work / "tokens"
    prepare(embedded_text().split("\n\n")[:300], token_dir, val_fraction=0.1)
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with Lab(3, tag=args.lab_tag, prefix=args.lab_prefix) as lab:  # host 2: the external store
        for i in range(args.repeats):  # the settings alternate, so the machine's load hits all
            for name, (node_timeout, last_call, external) in SETTINGS.items():
                results[name].append(one_run(lab, token_dir, work / f"{name}-{i}", node_timeout,
                                             last_call, external))
    print(f"{'setting':<15} {'node_timeout_s':>14} {'last_call_s':>11}   median s: detect  rendezvous  "
          f"recover   (runs)")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("detect", "rendezvous", "recover")}
        nt, lc, _ = SETTINGS[name]
        print(f"{name:<15} {nt:>14} {lc:>11}   {med['detect']:16.1f} {med['rendezvous']:11.1f} "
              f"{med['recover']:8.1f}   ({', '.join('%.1f' % r['recover'] for r in runs)})")


if __name__ == "__main__":
    main()
