"""Context parallelism: activation memory per rank, the longest sequence under a memory cap,
and the bytes its collectives move, at cp=1 and cp=2 (2 CPU processes, gloo).

Activation memory is what autograd saves for backward during one forward (unique storages,
counted by ``torch.autograd.graph.saved_tensors_hooks``): the part of a step's memory that
grows with the sequence and that context parallelism divides. Communication is every byte this
rank receives in the cp group's collectives over one forward and backward (the k/v all-gather
forward, its reduce-scatter backward: an all_to_all on gloo), against the formula
``layers x 2 (k, v) x B x kv_heads x T x head_dim x 4 bytes x (cp - 1) / cp`` per direction.

    python bench/context_parallel.py [--seq-len 2048] [--cap-mib 48]
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

LAYERS, DIM, HEADS, KV, B = 8, 128, 8, 2, 1


def model(seq_len: int):
    from allhands.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=257, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV,
                             seq_len=seq_len))


def saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


class Counting:
    """Bytes this rank receives in all_gather_into_tensor and all_to_all_single while active
    (the cp group's k/v gather forward and its reduce-scatter backward on gloo)."""

    def __init__(self):
        self.received = 0

    def __enter__(self):
        self.saved = dist.all_gather_into_tensor, dist.all_to_all_single
        me = self

        def gather(out, t, group=None, async_op=False):
            me.received += out.numel() * out.element_size() - t.numel() * t.element_size()
            return me.saved[0](out, t, group=group, async_op=async_op)

        def exchange(out, t, *args, group=None, **kw):
            n = dist.get_world_size(group)
            me.received += out.numel() * out.element_size() * (n - 1) // n
            return me.saved[1](out, t, *args, group=group, **kw)

        dist.all_gather_into_tensor, dist.all_to_all_single = gather, exchange
        return self

    def __exit__(self, *exc):
        dist.all_gather_into_tensor, dist.all_to_all_single = self.saved


def worker(rank: int, world: int, port: int, seq_len: int, cap: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from allhands.mesh import Mesh
    from allhands.parallel.context import ContextParallel

    dist.init_process_group("gloo", rank=rank, world_size=world)  # a private job: no admission
    mesh = Mesh.build(rank=rank, world_size=world, local_rank=rank, device="cpu", backend="gloo",
                      dp_replicate=1, cp=world)
    cp = ContextParallel(mesh) if world > 1 else None

    def step(T: int, count: Counting | None = None) -> int:
        m = model(T)
        x = torch.randint(0, 257, (B, T))
        y = torch.randint(0, 257, (B, T))

        def fwd():
            if cp is None:
                return F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            xl, yl, kw = cp.shard(x, y)
            with cp.attention():
                return F.cross_entropy(m(xl, **kw).flatten(0, 1), yl.flatten())

        if count is None:
            return saved_bytes(fwd)
        with count:
            fwd().backward()
        return count.received

    act = step(seq_len)
    count = step(seq_len, Counting()) if cp is not None else 0
    longest, T = 0, 256
    while T <= 1 << 16:  # doubling: the longest power-of-two sequence whose activations fit the cap
        if step(T) > cap:
            break
        longest, T = T, T * 2
    if rank == 0:
        out.update(act=act, received=count, longest=longest)
    mesh.destroy()


def run(world: int, seq_len: int, cap: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(world, port, seq_len, cap, out), nprocs=world)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--cap-mib", type=float, default=48)
    a = ap.parse_args()
    cap = int(a.cap_mib * 2**20)
    one, two = run(1, a.seq_len, cap), run(2, a.seq_len, cap)
    print(f"Llama {LAYERS} x {DIM}, {HEADS} heads / {KV} kv heads, batch {B}, seq_len {a.seq_len}")
    print(f"activation memory per rank: cp=1 {one['act'] / 2**20:.1f} MiB, cp=2 {two['act'] / 2**20:.1f} MiB,"
          f" ratio {two['act'] / one['act']:.3f} (target <= 0.55)")
    print(f"longest seq_len with activations <= {a.cap_mib:g} MiB: cp=1 {one['longest']}, cp=2 {two['longest']}")
    formula = 2 * LAYERS * 2 * B * KV * a.seq_len * (DIM // HEADS) * 4 * (2 - 1) / 2  # both directions
    print(f"bytes received by a rank per step: {two['received']:,} against the formula {formula:,.0f}:"
          f" {two['received'] / formula:.3f}")


if __name__ == "__main__":
    main()
