"""The reference GPT under transformers' GPT-2 names, both ways: the name map, the tensor
layout changes, and config.json <-> GPTConfig (GPT2LMHeadModel).

The two models compute the same function: learned positions, pre-LayerNorm blocks, GELU (exact
erf, transformers' ``"gelu"``, or GPT-2's own tanh ``"gelu_new"``: ``model.activation``),
1/sqrt(head_dim) attention scaling. Three differences are in the layout of the tensors only:

- transformers' GPT-2 uses ``Conv1D`` (transformers/pytorch_utils.py), a linear layer whose
  weight is stored ``(in, out)``: every projection is transposed;
- its fused ``c_attn`` holds ``[q | k | v]`` over all heads, where allhands' ``qkv`` holds them
  head by head (``[q_h0 k_h0 v_h0 | q_h1 ...]``, see models/gpt.py): rows are regrouped;
- GPT-2 always has biases: a model trained with ``model.bias=false`` exports zeros.
"""

from __future__ import annotations

import torch

from allhands.errors import CheckpointError, ConfigError
from allhands.models.gpt import GPTConfig

# allhands name -> GPT-2 name, per block (``h.{i}.``) and for the rest of the model
BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
         "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
TOP = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
       "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
       "lm_head.weight": "lm_head.weight"}
# transformers' names of GPT-2's tanh GELU; "gelu" is the exact one
_TANH = ("gelu_new", "gelu_pytorch_tanh")


def _heads(t: torch.Tensor, n_head: int, to_gpt2: bool) -> torch.Tensor:
    """Regroup qkv rows between head-major (allhands) and q|k|v-major (GPT-2)."""
    rest = t.shape[1:]
    if to_gpt2:
        return t.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return t.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def name_map(n_layer: int) -> dict[str, str]:
    out = dict(TOP)
    for i in range(n_layer):
        for ours, theirs in BLOCK.items():
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    return out


def to_gpt2(sd: dict[str, torch.Tensor], n_layer: int, n_head: int,
            tie: bool) -> dict[str, torch.Tensor]:
    """GPT-2 tensors of an allhands state dict; absent biases become zeros."""
    out = {}
    for ours, theirs in name_map(n_layer).items():
        if ours == "lm_head.weight" and tie:
            continue  # tied to wte; transformers ties it again on load (tie_word_embeddings)
        t = sd.get(ours)
        if t is None:
            if not ours.endswith(".bias"):
                raise CheckpointError(f"export: the checkpoint has no tensor {ours!r}; it is not "
                                      f"the reference GPT (model.*), so it cannot be a GPT-2")
            width = sd[ours[:-4] + "weight"].shape[0]
            t = torch.zeros(width, dtype=sd["tok_emb.weight"].dtype)
        if ".qkv." in ours:
            t = _heads(t, n_head, to_gpt2=True)
        if t.dim() == 2 and ours.startswith("blocks."):
            t = t.t()  # Conv1D stores (in, out)
        out[theirs] = t.contiguous()
    return out


def from_gpt2(sd: dict[str, torch.Tensor], n_layer: int, n_head: int,
              own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The allhands state dict (keys of ``own``) from GPT-2 tensors; biases the model lacks
    must be zero in the file."""
    sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
          for k, v in sd.items()}  # a bare GPT2Model's keys have no "transformer." prefix
    out = {}
    for ours, theirs in name_map(n_layer).items():
        t = sd.get(theirs)
        if ours == "lm_head.weight" and t is None:
            t = sd.get("transformer.wte.weight")  # tied
        if t is None:
            continue  # named as missing by the caller's shape check
        if t.dim() == 2 and ours.startswith("blocks."):
            t = t.t()
        if ".qkv." in ours:
            t = _heads(t, n_head, to_gpt2=False)
        if ours not in own:
            if ours.endswith(".bias") and not t.any():
                continue  # the zeros a bias-free model exported
            raise CheckpointError(f"checkpoint.init_from: {theirs!r} is not zero but the model "
                                  f"has no biases; set model.bias=true")
        out[ours] = t.contiguous()
    return out


def gpt2_config(m, vocab_size: int, eot: int | None) -> dict:
    """transformers' GPT2Config of the reference GPT ``m`` (a GPTConfig or ModelConfig)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_positions": m.seq_len, "n_ctx": m.seq_len, "n_embd": m.n_embd,
            "n_layer": m.n_layer, "n_head": m.n_head, "n_inner": m.ffn_hidden or None,
            "activation_function": m.activation, "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": m.tie_embeddings,
            "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32"}


def from_gpt2_config(c: dict, bias: bool = True, dropout: float = 0.0) -> GPTConfig:
    """Our GPTConfig of a GPT-2 config.json; ``bias``: whether the model keeps biases (a
    bias-free model exports zeros, which then load into it). ConfigError names a field we do
    not implement."""
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu", *_TANH):
        raise ConfigError(f"checkpoint.init_from: config.json activation_function={act!r} is not "
                          f"supported (implemented: gelu, gelu_new)")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if c.get(key, want) != want:
            raise ConfigError(f"checkpoint.init_from: config.json {key}={c[key]!r} is not "
                              f"supported (only {want!r} is implemented)")
    return GPTConfig(vocab_size=c.get("vocab_size", 50257), seq_len=c.get("n_positions", 1024),
                     n_layer=c.get("n_layer", 12), n_head=c.get("n_head", 12),
                     n_embd=c.get("n_embd", 768), dropout=dropout, bias=bias,
                     tie_embeddings=c.get("tie_word_embeddings", True),
                     ffn_hidden=c.get("n_inner") or 0,
                     norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                     activation="gelu_new" if act in _TANH else "gelu")
