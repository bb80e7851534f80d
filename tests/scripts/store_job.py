"""A job for tests/test_security_local.py: admitted workers, then a pause in which a test lets
an attacker at the stores, then a new process group and an all_reduce of rank + 1.

    allhands launch --nproc N tests/scripts/store_job.py OUT_DIR

Each rank writes OUT_DIR/ready<R> once admitted and waits up to 120 s for OUT_DIR/go; rank 1
then waits 1 s more (so rank 0 reads rank 1's connection record of the new group before rank 1
writes it), and each writes OUT_DIR/rank<R>.json with the result.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from allhands.admission import admit_peers
from allhands.env import worker_env
from allhands.mesh import Mesh
from allhands.worker import reported_failures

out = Path(sys.argv[1])
env = worker_env()
with reported_failures():
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device="cpu", backend="gloo", dp_replicate=-1, timeout_s=60)
    (out / f"ready{mesh.rank}").touch()
    deadline = time.monotonic() + 120
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0 * mesh.rank)
    group = dist.new_group(list(range(mesh.world_size)))
    admit_peers(mesh.device, group)
    t = torch.tensor([float(mesh.rank + 1)])
    dist.all_reduce(t, group=group)
    (out / f"rank{mesh.rank}.json").write_text(json.dumps({"sum": t.item()}))
    mesh.destroy()
