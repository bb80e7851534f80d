"""Peak memory per rank when 2 gloo ranks import a sharded transformers checkpoint.

A random Llama-family model (default about 160M parameters, 640 MB in fp32) is written as a
transformers directory in shards (``to_hf``, ``--shard-mb``). Then, in fresh processes, each of
2 ranks builds the model on the meta device, shards it with FSDP2 ``fully_shard``, allocates
its shards and fills them with ``load_hf``, which reads only this rank's slices
(``safe_open(...).get_slice``) and unmaps each file when done; for comparison each rank also
does what a plain load does, the whole model in memory (``from_hf``), in a second pair of
processes. Printed per rank: peak RSS growth (VmHWM after loading minus before building) over the full model's bytes. Target for the sharded import: <= 1/2 + 10% = 0.60.

    python bench/hf_import.py [--dim 1024 --layers 8 --vocab 32000 --shard-mb 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from allhands.models.hf import from_hf, hf_config, load_hf, to_hf  # noqa: E402
from allhands.models.llama import Llama, LlamaConfig  # noqa: E402


def _rss_mb() -> float:
    """This process's peak RSS in MiB: VmHWM, the high-water mark of this address space
    (ru_maxrss is not reset by exec, so a spawned child would report its parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (this bench needs Linux)")


def _rank(rank: int, src: str, store: str, sharded: bool, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    fc, _ = hf_config(Path(src), seq_len=256)
    before = _rss_mb()
    if sharded:
        with torch.device("meta"):
            model = Llama(fc)
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_buffers()
        load_hf(model, Path(src))
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    else:
        model = from_hf(src, seq_len=256)
        local = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = _rss_mb()
    Path(f"{out}.{rank}").write_text(f"{peak - before} {local}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=64)
    a = ap.parse_args()
    fc = LlamaConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128,
                     n_kv_heads=max(1, a.dim // 512), ffn_hidden=int(a.dim * 2.75), seq_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = Llama(fc)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        to_hf(model, Path(tmp) / "hf", max_shard_size=a.shard_mb * 1_000_000)
        del model
        shards = len([f for f in os.listdir(Path(tmp) / "hf") if f.endswith(".safetensors")])
        print(f"model: {full / 2**20:.0f} MiB fp32 in {shards} shard(s) of <= {a.shard_mb} MB; 2 ranks")
        for sharded in (True, False):
            out = str(Path(tmp) / ("sharded" if sharded else "plain"))
            mp.spawn(_rank, args=(str(Path(tmp) / "hf"), out + ".store", sharded, out), nprocs=2)
            for r in range(2):
                grow, local = Path(f"{out}.{r}").read_text().split()
                ratio = float(grow) * 2**20 / full
                print(f"{'sharded import (load_hf after fully_shard)' if sharded else 'plain import (from_hf)':44s} "
                      f"rank {r}: peak RSS +{float(grow):.0f} MiB = {ratio:.2f} of the model "
                      f"(holds {int(local) / full:.2f} of it)"
                      + (f"; target <= 0.60: {'met' if ratio <= 0.60 else 'NOT met'}" if sharded else ""))


if __name__ == "__main__":
    main()
