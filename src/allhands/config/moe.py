"""The ``moe`` section: the mixture-of-experts feed-forward of the llama family (models/moe.py).
``n_experts = 0`` (the default) is a dense model and every other field is ignored."""

from __future__ import annotations

from dataclasses import dataclass

from allhands.config.check import check
from allhands.config.fields import _f
from allhands.errors import ConfigError


@dataclass
class MoEConfig:
    """Mixture of experts in the llama family's feed-forward (Mixtral, Qwen-MoE, DeepSeek-V3 style)."""

    n_experts: int = _f(0, "routed experts per MoE layer; 0 = a dense model (the rest of this section is ignored)")
    top_k: int = _f(2, "experts each token is sent to, in [1, n_experts]")
    ffn_hidden: int = _f(0, "width of one routed expert; 0 = model.ffn_hidden's")
    n_shared_experts: int = _f(0, "shared experts every token also passes through (DeepSeekMoE), >= 0")
    shared_ffn_hidden: int = _f(0, "width of the shared experts' SwiGLU; 0 = n_shared_experts x ffn_hidden")
    shared_gate: bool = _f(False, "scale the shared output by sigmoid(w . x) (Qwen2-MoE)")
    score: str = _f("softmax", "router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)")
    norm_topk: bool = _f(True, "renormalise each token's k routing weights to sum to 1")
    balance: str = _f("aux", "load balancing: aux (auxiliary loss), bias (DeepSeek-V3's "
                      "auxiliary-loss-free bias update) or none")
    aux_coef: float = _f(0.01, "balance=aux: weight of the auxiliary loss added to the training loss, >= 0")
    bias_rate: float = _f(1e-3, "balance=bias: bias update speed per optimizer step, > 0")
    every: int = _f(1, "layer i (from 0) is MoE when (i + 1) % every == 0, >= 1 (Qwen's decoder_sparse_step)")
    first_dense: int = _f(0, "the first this many layers stay dense (DeepSeek's first_k_dense_replace), >= 0")


def validate_moe(e: MoEConfig, family: str) -> None:
    """Raise ConfigError naming the first impossible ``moe.*`` value."""
    check(e.n_experts >= 0, "moe.n_experts", "must be >= 0 (0 = dense)", e.n_experts)
    if not e.n_experts:
        return
    check(family == "llama", "moe.n_experts", "MoE layers are in the llama family; set "
          "model.family=llama or moe.n_experts=0", e.n_experts)
    check(1 <= e.top_k <= e.n_experts, "moe.top_k", f"must be in [1, moe.n_experts={e.n_experts}]", e.top_k)
    for name in ("ffn_hidden", "n_shared_experts", "shared_ffn_hidden", "first_dense"):
        check(getattr(e, name) >= 0, f"moe.{name}", "must be >= 0", getattr(e, name))
    check(e.score in ("softmax", "sigmoid"), "moe.score", "allowed: softmax, sigmoid", e.score)
    check(e.balance in ("aux", "bias", "none"), "moe.balance", "allowed: aux, bias, none", e.balance)
    check(e.aux_coef >= 0, "moe.aux_coef", "must be >= 0", e.aux_coef)
    check(e.bias_rate > 0, "moe.bias_rate", "must be > 0", e.bias_rate)
    check(e.every >= 1, "moe.every", "must be >= 1", e.every)


def check_ep(p, e: MoEConfig, sizes: dict[str, int] | None = None) -> None:
    """``parallel.ep`` against the rest of the layout (``sizes``: the resolved mesh, when known)."""
    check(p.ep >= 1, "parallel.ep", "must be >= 1", p.ep)
    if p.ep == 1:
        return
    if not e.n_experts:
        raise ConfigError(f"parallel.ep: {p.ep} needs a mixture-of-experts model (moe.n_experts > 0), "
                          f"but this one is dense; set moe.n_experts (a multiple of {p.ep}) or parallel.ep=1")
    check(e.n_experts % p.ep == 0, "parallel.ep",
          f"must divide moe.n_experts={e.n_experts} (each rank holds n_experts / ep experts)", p.ep)
    check(getattr(p, "cp", 1) == 1, "parallel.ep", "is not supported with parallel.cp > 1 yet; set one of them to 1", p.ep)
    check(p.zero != 1, "parallel.ep", "is not supported with parallel.zero=1; use zero 0, 2 or 3", p.ep)
    check(p.sync == "allreduce", "parallel.ep", "needs parallel.sync=allreduce (the expert "
          "gradients are reduced every step)", p.ep)
    if sizes is None:
        return
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    if p.zero >= 2:
        check(sizes["dp_shard"] % p.ep == 0, "parallel.ep",
              f"must divide parallel.dp_shard={sizes['dp_shard']} under zero {p.zero} (the expert "
              f"ranks are carved out of the sharding ranks); make parallel.dp_shard a multiple of "
              f"{p.ep} (e.g. -1 with parallel.dp_replicate=1) or lower parallel.ep", p.ep)
    check(dp % p.ep == 0, "parallel.ep", f"must divide the {dp} data-parallel ranks (dp_replicate="
          f"{sizes['dp_replicate']} x dp_shard={sizes['dp_shard']}): expert parallelism borrows them and "
          f"adds none; make them a multiple of {p.ep} (more workers, or a smaller parallel.tp or "
          f"parallel.pp) or lower parallel.ep", p.ep)
