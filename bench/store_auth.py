"""What the authenticated store (authstore.MACStore) and admission cost at a job's start-up.

Two figures, in three settings: ``insecure`` (no secret: a plain store, no admission, as
``--insecure``), ``mac`` (the store sealed under the secret, admission skipped: the MAC's own
share) and ``secret`` (both, as every allhands job):

- ops: microseconds per ``set`` + ``get`` of a 170-byte value (the size of a gloo connection
  record) through torch's ``PrefixStore`` on a TCPStore client over loopback, plain or sealed;
- start-up: in each of WORLD worker processes, from the moment all are up to the end of
  ``init_process_group`` and GROUPS further ``new_group`` calls (the mesh makes one per
  dimension), each group admitted (admission.admit_peers, two small all-gathers) in the
  ``secret`` setting. Interpreter and torch import times are not in it. The median over ranks,
  then over repeats (settings alternate, so a load change on the machine hits all alike).

    python bench/store_auth.py [--world 4] [--groups 4] [--repeats 5] [--ops 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from allhands.admission import admit_peers
from allhands.authstore import sealed

SECRET = "bench-secret-" + "x" * 32
SETTINGS = ("insecure", "mac", "secret")


def ops(n: int) -> dict[str, float]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    value = bytes(170)
    out = {}
    for name, store in (("insecure", client), ("mac", sealed(client, SECRET, "bench"))):
        prefixed = dist.PrefixStore(f"bench-{name}", store)
        t0 = time.perf_counter()
        for i in range(n):
            prefixed.set(f"k{i}", value)
            prefixed.get(f"k{i}")
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def worker(rank: int, world: int, port: int, groups: int, secret: str, out: str) -> None:
    """One rank of the start-up figure; writes its seconds to OUT/rank<R>."""
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    cpu = torch.device("cpu")
    # Start together (interpreters and torch imports finish at different times): every rank's
    # key in the plain store, outside the key space the process groups use.
    store.set(f"bench-up/{rank}", b"1")
    store.wait([f"bench-up/{r}" for r in range(world)])
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=sealed(store, secret or None, "bench"), rank=rank,
                            world_size=world)
    admit_peers(cpu)
    for _ in range(groups):
        admit_peers(cpu, dist.new_group(list(range(world))))
    took = time.perf_counter() - t0
    Path(out, f"rank{rank}").write_text(str(took))
    dist.destroy_process_group()


def startup(world: int, groups: int, setting: str) -> float:
    """The median over ranks of :func:`worker`'s seconds; the store is sealed unless
    ``insecure``, and admission (which reads the worker environment) runs only in ``secret``."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    admit = setting == "secret"
    secret = "" if setting == "insecure" else SECRET
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(server.port), ALLHANDS_SECRET=secret if admit else "",
               ALLHANDS_INSECURE="" if admit else "1")
    with tempfile.TemporaryDirectory() as out:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world),
                                   str(server.port), str(groups), secret, out], env=env)
                 for r in range(world)]
        if any(p.wait(timeout=300) for p in procs):
            raise SystemExit("a worker failed")
        return statistics.median(float(Path(out, f"rank{r}").read_text()) for r in range(world))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, world, port, groups, secret, out = sys.argv[2:8]
        return worker(int(r), int(world), int(port), int(groups), secret, out)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ops", type=int, default=2000)
    a = ap.parse_args()
    per_op = ops(a.ops)
    per_op["secret"] = per_op["mac"]  # admission adds no store operation
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(a.repeats):
        for name in SETTINGS:
            times[name].append(startup(a.world, a.groups, name))
    for name in SETTINGS:
        print(json.dumps({"setting": name, "set_get_us": round(per_op[name], 1),
                          "startup_ms": round(1e3 * statistics.median(times[name]), 1),
                          "startup_ms_all": [round(1e3 * t, 1) for t in times[name]],
                          "world": a.world, "groups": a.groups}), flush=True)


if __name__ == "__main__":
    main()
