# torchft evaluation: one replica group (1 process) training a tiny MLP with
# torchft Manager + ProcessGroupGloo + torchft DDP/Optimizer wrappers, on CPU.
# Launched by torchrun --nproc_per_node=1 (as torchft's README does) or plain python
# (then it starts its own TCPStore). Logs one JSON line per step to $LOG.
import hashlib
import json
import logging
import os
import time
from datetime import timedelta

import torch
from torch import nn, optim

torch.set_num_threads(1)

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

RG = int(os.environ.get("REPLICA_GROUP_ID", 0))
STEPS = int(os.environ.get("STEPS", 200))
SLEEP = float(os.environ.get("STEP_SLEEP", 0.1))
LOG = os.environ.get("LOG", os.path.join(os.path.dirname(os.path.abspath(__file__)), "logs", f"rg{RG}.jsonl"))

if "MASTER_PORT" not in os.environ:  # plain python: host our own store
    from torch.distributed import TCPStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + RG), RANK="0", WORLD_SIZE="1")
    _store = TCPStore("127.0.0.1", 29600 + RG, is_master=True, wait_for_workers=False)

torch.manual_seed(1234 + RG)  # deliberately different init per group: step-0 sync must fix it
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt_inner = optim.AdamW(model.parameters(), lr=1e-2)


def state_dict():
    return {"model": model.state_dict(), "optim": opt_inner.state_dict()}


def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    opt_inner.load_state_dict(sd["optim"])


pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
manager = Manager(
    pg=pg,
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"rg{RG}",
    timeout=timedelta(seconds=10),
    quorum_timeout=timedelta(seconds=30),
)
ddp = DistributedDataParallel(manager, model)
opt = Optimizer(manager, opt_inner)


def phash_safe():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(repr(p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


os.makedirs(os.path.dirname(LOG), exist_ok=True)
logf = open(LOG, "a", buffering=1)
logf.write(json.dumps({"event": "start", "t": time.time(), "pid": os.getpid(), "rg": RG}) + "\n")
w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
while manager.current_step() < STEPS:
    t0 = time.time()
    g = torch.Generator().manual_seed(RG * 100000 + manager.current_step())
    x = torch.randn(32, 16, generator=g)
    y = x @ w
    opt.zero_grad()  # starts (async) quorum
    loss = nn.functional.mse_loss(ddp(x), y)
    if RG == 1 and manager.current_step() == int(os.environ.get("PAUSE_STEP", -1)):
        # fault-drill hook: stall before backward so the peer blocks inside the gradient allreduce
        logf.write(json.dumps({"event": "paused", "t": time.time(), "step": manager.current_step()}) + "\n")
        time.sleep(3)
    loss.backward()  # allreduce via torchft comm hook
    pre = manager.current_step()
    opt.step()  # commits only if should_commit()
    logf.write(json.dumps({
        "event": "step", "t": time.time(), "dt": time.time() - t0, "step_before": pre,
        "step": manager.current_step(), "participants": manager.num_participants(),
        "loss": round(loss.item(), 6), "phash": phash_safe(),
    }) + "\n")
    time.sleep(SLEEP)
logf.write(json.dumps({"event": "done", "t": time.time(), "step": manager.current_step(), "phash": phash_safe()}) + "\n")
torch.save(model.state_dict(), LOG.replace(".jsonl", ".final.pt"))
manager.shutdown()
