# torchft evaluation, DiLoCo variant: one replica group (1 process) training a tiny MLP with
# torchft Manager (sync quorum) + ProcessGroupGloo + torchft.local_sgd.DiLoCo (sync_every inner steps).
# manager.current_step() counts outer (sync) steps. Logs one JSON line per inner step to $LOG.
import hashlib, json, logging, os, time
from datetime import timedelta

import torch
from torch import nn, optim

torch.set_num_threads(1)
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
RG = int(os.environ.get("REPLICA_GROUP_ID", 0))
STEPS = int(os.environ.get("STEPS", 30))  # outer steps
SYNC_EVERY = int(os.environ.get("SYNC_EVERY", 10))
SLEEP = float(os.environ.get("STEP_SLEEP", 0.1))
LOG = os.environ.get("LOG", os.path.join(os.path.dirname(os.path.abspath(__file__)), "logs", f"diloco_rg{RG}.jsonl"))

torch.manual_seed(1234 + RG)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
inner = optim.AdamW(model.parameters(), lr=1e-2)
outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)


def state_dict():
    return {"model": model.state_dict(), "inner_optim": inner.state_dict()}


def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["inner_optim"])


manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, use_async_quorum=False,
    load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"rg{RG}",
    timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30),
)


def phash():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(repr(p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


os.makedirs(os.path.dirname(LOG), exist_ok=True)
logf = open(LOG, "a", buffering=1)
logf.write(json.dumps({"event": "start", "t": time.time(), "pid": os.getpid(), "rg": RG}) + "\n")
w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
inner_i = 0
with DiLoCo(manager, [model], inner, outer, sync_every=SYNC_EVERY, backup_device=torch.device("cpu"), pin_memory=False):
    while manager.current_step() < STEPS:
        t0 = time.time()
        g = torch.Generator().manual_seed(RG * 100000 + inner_i)
        inner_i += 1
        x = torch.randn(32, 16, generator=g)
        inner.zero_grad()
        loss = nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        pre = manager.current_step()
        inner.step()  # DiLoCo post-hook: quorum + pseudo-gradient allreduce + outer step every SYNC_EVERY
        rec = {"event": "step", "t": time.time(), "dt": time.time() - t0, "step_before": pre,
               "step": manager.current_step(), "participants": manager.num_participants(), "loss": round(loss.item(), 6)}
        if rec["step"] > pre:
            rec["phash"] = phash()  # right after a committed sync all replicas must hold the same params
        logf.write(json.dumps(rec) + "\n")
        time.sleep(SLEEP)
logf.write(json.dumps({"event": "done", "t": time.time(), "step": manager.current_step(), "phash": phash()}) + "\n")
torch.save(model.state_dict(), LOG.replace(".jsonl", ".final.pt"))
manager.shutdown()
