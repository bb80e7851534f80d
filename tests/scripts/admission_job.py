"""A job for the security tests: build the mesh (so admission runs), all_reduce, report.

    allhands launch --nproc N tests/scripts/admission_job.py OUT_DIR [HOLD_S [STRANGER]]

Each rank writes OUT_DIR/rank<R>.json with the all_reduce result of (rank + 1), over a second
process group admitted like the default one, and then, if
HOLD_S > 0, waits up to HOLD_S seconds for OUT_DIR/go, so a test can inspect the live job.
STRANGER makes the last rank a process outside the job: "wrong-secret" runs allhands with
another secret; "raw" skips allhands and all_reduces 1000 at once, as a stranger
would (it writes OUT_DIR/stranger.json if its all_reduce completes).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from allhands.admission import admit_peers
from allhands.env import worker_env
from allhands.worker import reported_failures
from allhands.mesh import Mesh

out, hold = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
stranger = sys.argv[3] if len(sys.argv) > 3 else ""
env = worker_env()
if stranger and env.rank == env.world_size - 1:
    if stranger == "wrong-secret":
        os.environ["ALLHANDS_SECRET"] = "not-the-secret-of-this-job"
    elif stranger == "raw":
        import datetime

        # The job's own worker store and keys (a TCPStore client without a prefix, as allhands'
        # workers have it; plain env:// would prefix them and never meet the job's).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              env.world_size, False, timeout=datetime.timedelta(seconds=5))
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=5))
        poison = torch.tensor([1000.0])
        dist.all_reduce(poison)
        (out / "stranger.json").write_text(json.dumps({"sum": poison.item()}))
        sys.exit(0)
with reported_failures():  # as `allhands train` workers: a refusal is one summary line
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device="cpu", backend="gloo", dp_replicate=-1, timeout_s=60)
    # A group made after Mesh.build has connections of its own (as a mesh dimension's group
    # does): it is admitted by the same check before its first collective.
    group = dist.new_group(list(range(mesh.world_size)))
    admit_peers(mesh.device, group)
t = torch.tensor([float(mesh.rank + 1)])
dist.all_reduce(t, group=group)
(out / f"rank{mesh.rank}.json").write_text(json.dumps({"sum": t.item(), "pid": os.getpid(),
                                                       "world": mesh.world_size}))
deadline = time.monotonic() + hold
while hold and not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
mesh.destroy()
