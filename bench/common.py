"""What the timing benchmarks share: config overrides that leave only the training steps to time.

Each script runs as ``python bench/NAME.py``, so this folder is on ``sys.path``.
"""

# No evaluation, no checkpoint, no progress bar, no TensorBoard: nothing but the steps.
TIMING_ONLY = ["run.eval_interval=0", "data.eval_batches=0", "checkpoint.interval=0",
               "checkpoint.at_end=false", "log.progress=false", "log.tensorboard=false"]

# The checkpoint benchmarks' GPT: 4 layers, 256 wide, seq 64 (a 37.9 MiB model + AdamW state).
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.seq_len=64"]


class CheckpointBenchJob:
    """The checkpoint benchmarks' worker state (bench/checkpoint.py, bench/checkpoint_profile.py):
    the reference GPT under DDP + AdamW on this launcher-started rank, with the allhands state
    that a Checkpointer saves (model + optimizer, step, RNG; 37.9 MiB for ``MODEL``).
    A step is ``backward()``, then the caller's hook (the trainer's ``before_update``), then
    ``update()``."""

    def __init__(self, cfg_dict: dict):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from allhands.checkpoint import ModelOptimState, RNGState, TrainState
        from allhands.config import Config
        from allhands.data import load_token_splits
        from allhands.env import worker_env
        from allhands.mesh import Mesh
        from allhands.job import build_reference_model

        self.cfg = cfg = Config.from_dict(cfg_dict)
        env = worker_env()
        self.mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                               device="cpu", backend="gloo", dp_replicate=-1, timeout_s=300)
        torch.set_num_threads(1)
        self.train_ds, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
        torch.manual_seed(0)
        self.model = DDP(build_reference_model(cfg, 257))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ts = TrainState()
        self.state = {"model": ModelOptimState(self.model, self.opt), "train": self.ts,
                      "rng": RNGState(self.mesh.rank)}
        self.per_rank = cfg.run.global_batch // self.mesh.world_size
        self.g = torch.Generator().manual_seed(self.mesh.rank)

    def backward(self) -> None:
        import torch
        import torch.nn.functional as F

        idx = torch.randint(len(self.train_ds), (self.per_rank,), generator=self.g).tolist()
        x = torch.stack([self.train_ds[i][0] for i in idx])
        y = torch.stack([self.train_ds[i][1] for i in idx])
        F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()).backward()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ts.step += 1
