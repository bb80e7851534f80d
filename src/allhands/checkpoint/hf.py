"""A run's model as a transformers directory, for every family: ``allhands export --format hf``
writes what ``AutoModelForCausalLM.from_pretrained`` opens offline (GPT2LMHeadModel for the
reference GPT; LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM for the Llama family),
with the tokenizer the run trained with. The name maps and the file format are the models'
(models/gpt_hf.py, models/llama_hf.py, models/hf.py); this module adds the run's config and
tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from allhands.config import ModelConfig, MoEConfig
from allhands.models.build import family_config
from allhands.models.hf import hf_config_json, hf_tensors, write_hf_dir


def write_hf(out: Path, sd: dict[str, torch.Tensor], m: ModelConfig, step: int,
             tokenizer: tuple[str, str, int] | None, max_shard_size: str | int = "5GB",
             moe: MoEConfig | None = None) -> None:
    """Write the directory: config.json, the weights (sharded above ``max_shard_size``) and,
    with ``tokenizer`` = (tokenizer.json text, end-of-document token, its id), the tokenizer
    files. ``sd``: the full state dict of the model ``m`` (and ``moe``) describes."""
    fc = family_config(m, sd["tok_emb.weight"].shape[0], moe)
    eot = tokenizer[2] if tokenizer else None
    config = hf_config_json(fc, m.max_positions, eot, eot)
    write_hf_dir(out, hf_tensors(sd, fc), config, max_shard_size, {"allhands_step": str(step)})
    if tokenizer:
        text, token, _ = tokenizer
        (out / "tokenizer.json").write_text(text)
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token, "eos_token": token,
            "unk_token": token, "model_max_length": m.seq_len}, indent=1))
