"""Muon against AdamW: the optimizer step under ZeRO-3 on 2 CPU ranks, and the loss at equal tokens.

Part 1: 2 gloo ranks hold a GPT (dim 256, 4 layers, seq 64; 16 hidden matrices of
0.07-0.26 M entries) sharded by FSDP2 (ZeRO-3). After one backward, the optimizer steps
``--steps`` times on those gradients, alternating AdamW, Muon with the spreading and Muon
without it (every rank orthogonalizing every matrix), ``--rounds`` times. Printed per variant:
the median step time, bytes a rank sends inside the step, and the ratios spread/AdamW and
spread/unspread (time), spread/unspread (bytes). At 2 ranks both Muons send the same bytes (the
pieces a rank lacks, and back, versus an all-gather): the formula, (W-1)/W of the matrices' fp32
bytes per rank and per direction in the spread case, is printed beside the measured figure.

Part 2 (skipped with ``--skip-loss``): the embedded default job (``allhands train``, 1 process) for ``--train-steps``
steps with optim.name=adamw and with muon, the same lr, data and tokens; the eval loss of each.

    python bench/muon.py [--rounds 3] [--steps 5] [--train-steps 150]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DIM, LAYERS, SEQ, VOCAB = 256, 4, 64, 257


def _rank(rank: int, world: int, port: int, steps: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from allhands.models.gpt import GPT, GPTConfig
    from allhands.muon import Muon, muon_matrices

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=LAYERS, n_head=4, n_embd=DIM, seq_len=SEQ, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    blocks = model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict) else model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(rank))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    hidden = {id(p) for p in muon_matrices(model)}
    mats = [p for p in model.parameters() if id(p) in hidden]
    rest = [p for p in model.parameters() if id(p) not in hidden]

    def build(name):
        if name == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=1e-3)
        return Muon([{"params": mats, "muon": True}, {"params": rest}], lr=1e-3,
                    ns_dtype="float32", spread=name == "muon-spread")

    names = ["adamw", "muon-spread", "muon-unspread"]
    opts = {n: build(n) for n in names}
    times = {n: [] for n in names}
    sent = {}
    for _ in range(rounds):
        for n in names:
            o = opts[n]
            o.step()  # the first step of each round allocates state and (Muon) plans the exchange
            before = getattr(o, "stats", {}).get("bytes_sent", 0)
            for _ in range(steps):
                dist.barrier()
                t = time.perf_counter()
                o.step()
                times[n].append(time.perf_counter() - t)
            sent[n] = (getattr(o, "stats", {}).get("bytes_sent", 0) - before) / steps
    counts = {n: opts[n].stats["matrices"] / opts[n].stats["steps"] for n in names[1:]}
    matrix_bytes = 4 * sum(p.numel() for p in mats)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"times": times, "sent": sent, "counts": counts, "matrix_bytes": matrix_bytes,
                   "n_matrices": len(mats)}, f)
    dist.barrier()
    os._exit(0)  # no teardown: gloo's threads can abort a process exiting normally (SIGABRT)


def step_bench(rounds: int, steps: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, port, steps, rounds, tmp), nprocs=2, start_method="spawn")
        res = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    med = {n: statistics.median(max(a, b) for a, b in zip(res[0]["times"][n], res[1]["times"][n]))
           for n in res[0]["times"]}
    sent = {n: max(r["sent"][n] for r in res) for n in med}
    w, mb = 2, res[0]["matrix_bytes"]
    print(f"ZeRO-3 on 2 ranks, {res[0]['n_matrices']} hidden matrices ({mb / 2**20:.2f} MiB fp32)")
    for n in med:
        print(f"  {n:14s} step {med[n] * 1e3:8.2f} ms   sent/rank {sent[n] / 2**20:6.3f} MiB")
    print(f"  matrices orthogonalized per rank and step: spread {[r['counts']['muon-spread'] for r in res]}, "
          f"unspread {[r['counts']['muon-unspread'] for r in res]}")
    formula = 2 * (w - 1) / w * mb / w  # gather + scatter, each (W-1)/W of a rank's 1/W share
    print(f"  spread bytes / formula 2 x (W-1)/W x matrices / W: {sent['muon-spread'] / formula:.3f}")
    print(f"  time: muon-spread / adamw {med['muon-spread'] / med['adamw']:.2f}; "
          f"muon-spread / muon-unspread {med['muon-spread'] / med['muon-unspread']:.2f}")
    print(f"  bytes: muon-spread / muon-unspread {sent['muon-spread'] / sent['muon-unspread']:.2f}")


def loss_bench(train_steps: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("adamw", "muon"):
            run = Path(tmp, name)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "allhands.cli", "train", "--set", f"optim.name={name}",
                            "--set", f"run.steps={train_steps}", "--set", f"run.dir={run}",
                            "--set", f"run.eval_interval={train_steps}", "--set", "log.progress=false"],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            ev = [x["eval_loss"] for x in lines if "eval_loss" in x]
            from allhands.config import load_config
            cfg = load_config(None)  # the embedded default job: tokens = steps x batch x seq_len
            tokens = train_steps * cfg.run.global_batch * cfg.model.seq_len
            out[name] = (ev[-1], tokens, time.perf_counter() - t)
    for name, (ev, tokens, secs) in out.items():
        print(f"  {name:6s} eval loss {ev:.4f} after {train_steps} steps ({tokens} tokens), {secs:.0f} s")
    print(f"  eval loss muon / adamw at equal tokens: {out['muon'][0] / out['adamw'][0]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--skip-loss", action="store_true")
    a = ap.parse_args()
    step_bench(a.rounds, a.steps)
    if not a.skip_loss:
        loss_bench(a.train_steps)


if __name__ == "__main__":
    main()
