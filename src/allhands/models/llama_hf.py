"""The Llama family under transformers' names, both ways: the parameter name map (a pure dict,
torchtune's convert_weights / torchtitan's state_dict_adapter) and config.json <-> LlamaConfig
for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

The tensors themselves need no change: our RoPE uses transformers' rotate-half convention
(layers.apply_rope), so q_proj and k_proj load as stored, without the row permutation that
Meta-format checkpoints need. A config.json field we do not implement is a ConfigError naming it.
"""

from __future__ import annotations

import re

from allhands.errors import ConfigError
from allhands.models.llama import LlamaConfig

# ours (under "blocks.{i}.") -> transformers (under "model.layers.{i}.")
BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "lm_head.weight": "lm_head.weight"}
TIED = ("lm_head.weight", "model.embed_tokens.weight")  # absent from a tied file: read the embedding

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")


def hf_name(ours: str) -> str:
    """The transformers name of our parameter ``ours``."""
    if ours in TOP:
        return TOP[ours]
    m = _BLOCK_RE.match(ours)
    if m is None or m.group(2) not in BLOCK:
        raise KeyError(ours)
    return f"model.layers.{m.group(1)}.{BLOCK[m.group(2)]}"


# transformers' class defaults, for fields config.json may leave out
_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False, "hidden_act": "silu", "pretraining_tp": 1}


def _rope(c: dict) -> dict:
    """RoPE settings in transformers 5's spelling (``rope_parameters``) from either spelling
    (transformers 4: ``rope_theta`` + ``rope_scaling``); its ``_at`` names the key they were under."""
    if c.get("rope_parameters"):
        return {"_at": "rope_parameters", **c["rope_parameters"]}
    out = {"_at": "rope_scaling", "rope_theta": c.get("rope_theta", 10000.0)}
    out.update(c.get("rope_scaling") or {})
    if "type" in out and "rope_type" not in out:  # the older key of transformers 4
        out["rope_type"] = out.pop("type")
    return out


def _refuse(path: str, value, why: str) -> None:
    raise ConfigError(f"checkpoint.init_from: config.json {path}={value!r} is not supported ({why})")


def from_hf_config(c: dict, seq_len: int | None = None) -> LlamaConfig:
    """Our config of a transformers config.json ``c``; ``seq_len`` (the RoPE table's length)
    defaults to max_position_embeddings. Raises ConfigError naming an unsupported field."""
    kind = c.get("model_type")
    c = {**_DEFAULTS, **c}
    for key, want in (("hidden_act", "silu"), ("mlp_bias", False), ("pretraining_tp", 1)):
        if c[key] != want and not (key == "pretraining_tp" and c[key] is None):
            _refuse(key, c[key], f"only {want!r} is implemented")
    bias = kind == "qwen2"  # Qwen2 always has q, k, v biases; Llama/Qwen3's flag covers o_proj too
    if kind != "qwen2" and c["attention_bias"]:
        _refuse("attention_bias", True, "a bias on o_proj is not implemented; Qwen2's q/k/v bias is")
    r = _rope(c)
    kind_rope = r.get("rope_type", "default")
    if kind_rope not in ("default", "llama3"):
        _refuse(f"{r['_at']}.rope_type", kind_rope, "implemented: default, llama3")
    if float(r.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse("partial_rotary_factor", r["partial_rotary_factor"], "RoPE on every dimension only")
    positions = int(c.get("max_position_embeddings") or 2048)
    seq = seq_len or positions
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True) and window < seq:
        _refuse("sliding_window", window, f"sliding-window attention is not implemented; it equals "
                f"full attention for sequences up to {window} tokens: set model.seq_len <= {window}")
    if c.get("use_sliding_window") and any(t != "full_attention" for t in c.get("layer_types") or ()):
        _refuse("layer_types", c["layer_types"], "sliding-window layers are not implemented")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or (128 if kind == "qwen3" else c["hidden_size"] // heads)
    try:
        out = LlamaConfig(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=0 if head_dim * heads == c["hidden_size"] else head_dim,
            ffn_hidden=c["intermediate_size"], seq_len=seq, norm_eps=float(c["rms_norm_eps"]),
            rope_theta=float(r.get("rope_theta", 10000.0)),
            rope_scaling="llama3" if kind_rope == "llama3" else "",
            rope_factor=float(r.get("factor", 8.0)),
            rope_low_freq_factor=float(r.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(r.get("high_freq_factor", 4.0)),
            rope_original_seq_len=int(r.get("original_max_position_embeddings", 8192)),
            qkv_bias=bias, qk_norm=kind == "qwen3", tie_embeddings=bool(c["tie_word_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"checkpoint.init_from: config.json has no {e.args[0]!r}; it is not a "
                          f"complete {ARCHITECTURES.get(kind, kind)} config") from None
    try:
        out.check()
    except ValueError as e:
        raise ConfigError(f"checkpoint.init_from: config.json: {e}") from None
    return out


def to_hf_config(fc: LlamaConfig, max_positions: int = 0, bos: int | None = None,
                 eos: int | None = None) -> dict:
    """transformers' config.json of ``fc``: Qwen3 for q/k norms, Qwen2 for q/k/v biases, Llama
    otherwise (Mistral without a sliding window is the same function as Llama). RoPE is written
    in both spellings, so transformers 4 and 5 read it."""
    if fc.qk_norm and fc.qkv_bias:
        raise ConfigError("export: model.qk_norm with model.qkv_bias has no transformers "
                          "architecture (Qwen3's attention_bias also puts a bias on o_proj)")
    kind = "qwen3" if fc.qk_norm else "qwen2" if fc.qkv_bias else "llama"
    rope = {"rope_type": fc.rope_scaling or "default", "rope_theta": fc.rope_theta}
    if fc.rope_scaling == "llama3":
        rope.update(factor=fc.rope_factor, low_freq_factor=fc.rope_low_freq_factor,
                    high_freq_factor=fc.rope_high_freq_factor,
                    original_max_position_embeddings=fc.rope_original_seq_len)
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"} if fc.rope_scaling else None
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
           "vocab_size": fc.vocab_size, "hidden_size": fc.dim, "intermediate_size": fc.hidden,
           "num_hidden_layers": fc.n_layers, "num_attention_heads": fc.n_heads,
           "num_key_value_heads": fc.kv_heads, "head_dim": fc.hd, "hidden_act": "silu",
           "max_position_embeddings": max_positions or fc.seq_len, "rms_norm_eps": fc.norm_eps,
           "rope_parameters": rope, "rope_theta": fc.rope_theta, "rope_scaling": legacy,
           "tie_word_embeddings": fc.tie_embeddings, "attention_dropout": 0.0,
           "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        if kind == "qwen3":
            out["attention_bias"] = False
    return out
