"""The llama family's MoE layers under transformers' names, both ways, for MixtralForCausalLM,
Qwen3MoeForCausalLM and Qwen2MoeForCausalLM: config.json <-> LlamaConfig (the dense part is
llama_hf's) and the parameter name map.

Files store one tensor per expert (``...experts.{e}.w1.weight`` (hidden, dim)); ours stacks
them ``(E, hidden, dim)`` (models/moe.py), so one parameter of ours is ``E`` tensors of theirs:
:func:`expert_names` lists them, and reading a slice of ours reads the same slice of each.
The routers compute the same function: softmax over all experts, top-k of the probabilities,
renormalised (Mixtral always; Qwen when ``norm_topk_prob``); Qwen2-MoE adds one shared SwiGLU
scaled by ``sigmoid(shared_expert_gate . x)``.
"""

from __future__ import annotations

import dataclasses
import re

from allhands.errors import ConfigError
from allhands.models import llama_hf
from allhands.models.llama import LlamaConfig
from allhands.models.moe import MoEArgs

# model_type -> (architecture, the dense family its attention is, the MoE block's module name)
KINDS = {"mixtral": ("MixtralForCausalLM", "mistral", "block_sparse_moe"),
         "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3", "mlp"),
         "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2", "mlp")}
# our stacked expert matrix -> each family's per-expert name
_EXPERT = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
           "qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}}
_EXPERT["qwen2_moe"] = _EXPERT["qwen3_moe"]
_MOE_RE = re.compile(r"^blocks\.(\d+)\.mlp\.(router|experts|shared|shared_gate)\.(.+)$")


def _refuse(path: str, value, why: str) -> None:
    raise ConfigError(f"checkpoint.init_from: config.json {path}={value!r} is not supported ({why})")


def from_hf_config(c: dict, seq_len: int | None = None) -> LlamaConfig:
    """Our config of a Mixtral / Qwen3-MoE / Qwen2-MoE config.json ``c``."""
    kind = c["model_type"]
    _, dense_kind, _ = KINDS[kind]
    experts = c.get("num_local_experts") or c.get("num_experts")
    if kind == "mixtral":
        moe = MoEArgs(n_experts=experts, top_k=c["num_experts_per_tok"], norm_topk=True,
                      aux_coef=float(c.get("router_aux_loss_coef", 0.001)))
        hidden = c["intermediate_size"]
    else:
        if c.get("mlp_only_layers"):
            _refuse("mlp_only_layers", c["mlp_only_layers"], "dense layers are chosen by "
                    "decoder_sparse_step only")
        shared = int(c.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
        moe = MoEArgs(n_experts=experts, top_k=c["num_experts_per_tok"],
                      hidden=c["moe_intermediate_size"], norm_topk=bool(c.get("norm_topk_prob")),
                      shared_hidden=shared, n_shared=1 if shared else 0, shared_gate=bool(shared),
                      aux_coef=float(c.get("router_aux_loss_coef", 0.001)),
                      every=int(c.get("decoder_sparse_step") or 1))
        hidden = c["intermediate_size"]
    dense = llama_hf.from_hf_config({**c, "model_type": dense_kind, "intermediate_size": hidden},
                                    seq_len)
    out = dataclasses.replace(dense, moe=moe)
    try:
        out.check()
    except ValueError as e:
        raise ConfigError(f"checkpoint.init_from: config.json: {e}") from None
    return out


def kind_of(fc: LlamaConfig) -> str:
    """The transformers family that holds ``fc``'s MoE shape, or ConfigError saying why none."""
    a = fc.moe

    def no(why: str) -> None:
        raise ConfigError(f"export: this MoE shape has no transformers architecture: {why}")
    if a.score != "softmax":
        no("moe.score=sigmoid (Mixtral and Qwen-MoE route by softmax)")
    if a.balance == "bias":
        no("moe.balance=bias (their routers have no balancing bias to carry it)")
    if a.first_dense:
        no("moe.first_dense > 0")
    if fc.qk_norm:
        kind = "qwen3_moe"
    elif a.shared_gate or fc.qkv_bias:
        kind = "qwen2_moe"
    else:
        kind = "mixtral"
    if kind == "mixtral" and not (a.norm_topk and a.every == 1 and a.expert_hidden(fc.hidden) == fc.hidden):
        kind = "qwen2_moe" if fc.qkv_bias else no(
            "Mixtral renormalises the top-k weights and has every layer MoE at model.ffn_hidden")
    if kind == "qwen2_moe" and a.shared_width(fc.hidden) and not a.shared_gate:
        no("Qwen2-MoE's shared expert has a sigmoid gate (set moe.shared_gate=true)")
    if kind == "qwen2_moe" and not fc.qkv_bias:
        no("Qwen2-MoE has q/k/v biases (model.qkv_bias=true)")
    if kind == "qwen3_moe" and a.shared_width(fc.hidden):
        no("Qwen3-MoE has no shared experts")
    return kind


def to_hf_config(fc: LlamaConfig, max_positions: int = 0, bos: int | None = None,
                 eos: int | None = None) -> dict:
    kind = kind_of(fc)
    arch, dense_kind, _ = KINDS[kind]
    out = llama_hf.to_hf_config(dataclasses.replace(fc, moe=MoEArgs()), max_positions, bos, eos)
    a = fc.moe
    out.update(architectures=[arch], model_type=kind, num_experts_per_tok=a.top_k,
               router_aux_loss_coef=a.aux_coef, output_router_logits=False)
    if kind == "mixtral":
        out.update(num_local_experts=a.n_experts, router_jitter_noise=0.0, sliding_window=None)
        for k in ("use_sliding_window", "attention_bias", "mlp_bias"):
            out.pop(k, None)
    else:
        out.update(num_experts=a.n_experts, moe_intermediate_size=a.expert_hidden(fc.hidden),
                   norm_topk_prob=a.norm_topk, decoder_sparse_step=a.every, mlp_only_layers=[])
        if kind == "qwen2_moe":
            out.update(shared_expert_intermediate_size=a.shared_width(fc.hidden), qkv_bias=True)
    return out


def is_moe_name(ours: str) -> bool:
    return _MOE_RE.match(ours) is not None


def expert_names(ours: str, kind: str, n_experts: int) -> list[str] | None:
    """transformers' names of our parameter ``ours`` of an MoE layer: one for the router and
    shared parts, ``n_experts`` (in expert order) for a stacked expert matrix, None for the
    balancing bias (not in their files)."""
    m = _MOE_RE.match(ours)
    if m is None:
        raise KeyError(ours)
    layer, part, rest = m.groups()
    pre = f"model.layers.{layer}.{KINDS[kind][2]}"
    if part == "router":
        return None if rest == "expert_bias" else [f"{pre}.gate.weight"]
    if part == "shared":
        return [f"{pre}.shared_expert.{rest}"]
    if part == "shared_gate":
        return [f"{pre}.shared_expert_gate.{rest}"]
    theirs = _EXPERT[kind][rest]
    return [f"{pre}.experts.{e}.{theirs}.weight" for e in range(n_experts)]
