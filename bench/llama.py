"""The Llama family on this CPU, in one run, three parts:

1. Tokens/s and MFU of a small Llama (grouped-query attention, SwiGLU, RMSNorm, RoPE) against
   the reference GPT of the same width and depth, one process, one thread, AdamW; the two
   alternate round by round so machine noise hits both alike. MFU: torch's FlopCounterMode
   count of a step over the cached CPU GEMM peak (allhands.flops).
2. Step time of the same Llama under FSDP (ZeRO-3, 2 gloo ranks), allhands' Trainer step against
   a hand-written ``fully_shard`` step (each block, then the root; AdamW; clip) on the same module
   and the same batches (the trainer's own sampler), alternating step by step in the same processes.
   Figure: median step, allhands / hand-written; target <= 1.00.
3. One profiled forward + backward of the Llama (torch.profiler): which attention kernel runs and
   the copy ops (copy_, clone, cat, contiguous, _to_copy) per block, with the module they come from.

    python bench/llama.py [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import TIMING_ONLY  # noqa: E402  (bench/ is sys.path[0])

WIDTH, LAYERS, HEADS, KV_HEADS, SEQ, BATCH = 256, 4, 4, 2, 128, 8
LLAMA = ["model.family=llama", f"model.n_embd={WIDTH}", f"model.n_layer={LAYERS}",
         f"model.n_head={HEADS}", f"model.n_kv_head={KV_HEADS}", f"model.seq_len={SEQ}",
         "model.tie_embeddings=false", "model.bias=false"]


def _models():
    from allhands.models import GPT, GPTConfig, Llama, LlamaConfig

    return {
        "gpt": lambda: GPT(GPTConfig(vocab_size=257, seq_len=SEQ, n_layer=LAYERS, n_head=HEADS,
                                     n_embd=WIDTH, bias=False)),
        "llama": lambda: Llama(LlamaConfig(vocab_size=257, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS,
                                           n_kv_heads=KV_HEADS, seq_len=SEQ)),
    }


def throughput(rounds: int, steps: int) -> dict:
    """Part 1: median step per round of each model, tokens/s and MFU of the median round."""
    import torch

    from allhands.flops import count_flops, cpu_gemm_peak
    from allhands.job import lm_loss

    torch.set_num_threads(1)
    peak = cpu_gemm_peak(1, "fp32")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 257, (BATCH, SEQ), generator=g)
    y = torch.randint(0, 257, (BATCH, SEQ), generator=g)
    out = {}
    live = {}
    for name, build in _models().items():
        torch.manual_seed(0)
        model = build()
        live[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        out[name] = {"params": sum(p.numel() for p in model.parameters()),
                     "flops_per_step": count_flops(build, x, y, lm_loss), "rounds": []}
    for _ in range(rounds):
        for name, (model, opt) in live.items():
            times = []
            for _ in range(steps + 2):
                t0 = time.perf_counter()
                lm_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
            out[name]["rounds"].append(statistics.median(times[2:]))
    for r in out.values():
        step = statistics.median(r["rounds"])
        r.update(step=step, tokens_per_s=BATCH * SEQ / step, mfu=r["flops_per_step"] / step / peak)
    out["peak"] = peak
    return out


# --------------------------------------------------------------------------- part 2 (2 ranks)


class HandwrittenFSDP:
    """The minimal FSDP2 step over the trainer's module (the same builder and seed) and batches
    (the same sampler): fully_shard each block, then the root; AdamW; clip."""

    def __init__(self, cfg, mesh, train_ds):
        import torch
        from torch.distributed.fsdp import fully_shard

        from allhands.data import GlobalSampler
        from allhands.job import build_reference_model

        torch.manual_seed(cfg.run.seed)
        self.model = build_reference_model(cfg, 257)
        dmesh = mesh.submesh("dp_shard")
        for block in self.model.blocks.values():
            fully_shard(block, mesh=dmesh)
        fully_shard(self.model, mesh=dmesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr,
                                     weight_decay=cfg.optim.weight_decay)
        self.sampler = GlobalSampler(len(train_ds), cfg.run.global_batch, cfg.data.seed)
        self.cfg, self.mesh, self.train_ds = cfg, mesh, train_ds

    def train_step(self, step: int) -> None:
        import torch

        from allhands.data.sampler import collate
        from allhands.job import lm_loss

        idx = self.sampler.local_micro_batches(step, self.mesh.rank, self.mesh.world_size, 1)[0]
        x, y = collate(self.train_ds, idx)
        lm_loss(self.model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def fsdp_worker(cfg_dict: dict, rounds: int, steps: int, out: str) -> None:
    """allhands' Trainer step (``Trainer.train_step``: its layout, clip, non-finite vote, update)
    and the hand-written one alternate step by step, so load hits both alike."""
    import torch
    import torch.distributed as dist

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.mesh import Mesh
    from allhands.trainer import Job, Trainer

    cfg = Config.from_dict(cfg_dict)
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=1, dp_shard=-1, timeout_s=120)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, Job(), mesh, Path(out))
    trainer.layout.train()
    hand = HandwrittenFSDP(cfg, mesh, trainer.train_ds)
    results = {"allhands": [], "handwritten": []}
    step = 0
    for _ in range(rounds):
        times = {"allhands": [], "handwritten": []}
        for _ in range(steps):
            for name, run in (("allhands", trainer.train_step), ("handwritten", hand.train_step)):
                dist.barrier()
                t0 = time.perf_counter()
                run(step)
                times[name].append(time.perf_counter() - t0)
            step += 1
        for name, ts in times.items():
            results[name].append(statistics.median(ts[2:]))
    if mesh.rank == 0:
        Path(out, "result.json").write_text(json.dumps(results))
    mesh.destroy()


def fsdp_ratio(rounds: int, steps: int) -> dict:
    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-llama-")
    cfg = load_config(overrides=[*LLAMA, f"run.steps={steps}", f"run.global_batch={BATCH}",
                                 "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.zero=3",
                                 "run.threads=1", *TIMING_ONLY, f"run.dir={out}/resolve"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    launch(fsdp_worker, (cfg.to_dict(), rounds, steps, out), LaunchSpec(nproc=2))
    return json.loads(Path(out, "result.json").read_text())


# --------------------------------------------------------------------------- part 3 (profile)

COPIES = ("aten::copy_", "aten::clone", "aten::cat", "aten::contiguous", "aten::_to_copy")


def _is_tensor_copy(ev) -> bool:
    """A copy op over a tensor, not a 0-dim scalar cast (aten::_fused_rms_norm casts the mean's
    divisor and eps that way)."""
    if ev.name not in COPIES:
        return False
    if ev.name == "aten::copy_" and ev.cpu_parent is not None and ev.cpu_parent.name in COPIES:
        return False  # the copy inside a clone or _to_copy counted already
    first = (ev.input_shapes or [[]])[0]
    return ev.name == "aten::cat" or (isinstance(first, list) and math.prod(first) > 1 and len(first) > 0)


def profile() -> dict:
    """Attention kernels and tensor copies of one forward + backward of the Llama, per block,
    each with the module whose forward (or the autograd node whose backward) made it."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    from allhands.job import lm_loss

    torch.manual_seed(0)
    model = _models()["llama"]()
    x = torch.randint(0, 257, (BATCH, SEQ))
    lm_loss(model(x), x).backward()  # warm-up
    labels = ("attn_norm", "mlp_norm", "attn", "mlp")
    blocks = list(model.blocks.values())
    for block in blocks:
        for name in labels:
            mod = getattr(block, name)
            mod.forward = (lambda f, tag: lambda *a, **k: _tagged(record_function, tag, f, a, k))(
                mod.forward, name)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        lm_loss(model(x), x).backward()
    attention, copies = set(), {}
    for ev in prof.events():
        if "scaled_dot_product" in ev.name:
            attention.add(ev.name)
        if _is_tensor_copy(ev):
            where = _origin(ev, labels)
            copies[f"{ev.name} in {where}"] = copies.get(f"{ev.name} in {where}", 0) + 1
    n = len(blocks)
    return {"attention_ops": sorted(attention),
            "copies_per_block": {k: v / n for k, v in sorted(copies.items(), key=lambda kv: -kv[1])}}


def _origin(ev, labels) -> str:
    """The labelled module whose forward ran ``ev``, or the autograd node whose backward did."""
    e = ev.cpu_parent
    while e is not None:
        if e.name in labels:
            return f"{e.name} forward"
        if e.name.startswith("autograd::engine::evaluate_function: "):
            return e.name.split(": ", 1)[1]
        e = e.cpu_parent
    return "forward (unlabelled)"


def _tagged(record_function, tag, fn, args, kwargs):
    with record_function(tag):
        return fn(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parts", default="throughput,fsdp,profile", help="which of the three to run")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"model: {LAYERS} layers x {WIDTH} wide, {HEADS} heads (llama: {KV_HEADS} kv heads, SwiGLU "
          f"8/3 C, untied head), seq {SEQ}, batch {BATCH}, AdamW, 1 thread, fp32")
    if "throughput" in parts:
        tp = throughput(args.rounds, args.steps)
        for name in ("gpt", "llama"):
            r = tp[name]
            print(f"  {name:>5}: {r['params'] / 1e6:.2f}M params, {r['flops_per_step'] / 1e9:.2f} GFLOP/step, "
                  f"step {r['step']:.4f} s (rounds " + " ".join(f"{v:.4f}" for v in r["rounds"])
                  + f"), {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%")
        print(f"  llama / gpt: tokens/s {tp['llama']['tokens_per_s'] / tp['gpt']['tokens_per_s']:.3f}, "
              f"MFU {tp['llama']['mfu'] / tp['gpt']['mfu']:.3f} (peak {tp['peak'] / 1e9:.1f} GFLOP/s)")
    if "fsdp" in parts:
        res = fsdp_ratio(args.rounds, args.steps)
        a, h = statistics.median(res["allhands"]), statistics.median(res["handwritten"])
        print("FSDP (ZeRO-3, 2 ranks), per-round median step (s): allhands "
              + " ".join(f"{v:.4f}" for v in res["allhands"]) + "; hand-written fully_shard "
              + " ".join(f"{v:.4f}" for v in res["handwritten"]))
        print(f"  ratio allhands / hand-written = {a / h:.3f} (target <= 1.00)")
    if "profile" in parts:
        prof = profile()
        print(f"profile: attention ops {', '.join(prof['attention_ops'])}")
        print("  tensor copies per block (forward + backward), by where they run:")
        for k, v in prof["copies_per_block"].items():
            print(f"    {v:5.2f}  {k}")


if __name__ == "__main__":
    main()
