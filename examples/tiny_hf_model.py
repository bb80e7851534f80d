"""A tiny transformers model directory to fine-tune, and chat data for it, made offline.

    python examples/tiny_hf_model.py tiny-llama --data chat.jsonl

writes ``tiny-llama/`` (config.json, model.safetensors with random weights, and a tokenizer:
tokenizer.json, a byte-level BPE trained here on a few sentences, plus tokenizer_config.json
with a ChatML chat template, as Qwen's) and ``chat.jsonl`` (conversations in the
``messages`` format). It stands in for a downloaded model such as Llama-3.2-1B-Instruct in
docs/data.md's "Fine-tune an imported model", so that section runs in seconds without a network.
Needs transformers and tokenizers (``pip install 'allhands[dev]'``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("the cat sat on a mat and we saw two red birds fly over green hills while one small "
         "dog ran home to eat").split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]


def make_tokenizer(out: Path, template: str | None = CHATML, **config) -> int:
    """Train a byte-level BPE on WORDS and save it into ``out`` with a tokenizer_config.json
    (``template``: its chat template, None for none; ``config``: more of its keys); returns
    the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant system"] * 5, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", **config}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def make_model(out: Path, vocab: int) -> None:
    """A 2-layer Llama with grouped-query attention and random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(out)


def make_chat(path: Path, n: int = 96) -> None:
    rng = random.Random(0)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))

    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": sentence(6)},
                                             {"role": "assistant", "content": sentence(8)}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the model directory to write")
    ap.add_argument("--data", default="chat.jsonl", help="the chat data to write (JSON lines)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    make_model(out, make_tokenizer(out))
    make_chat(Path(args.data))
    print(f"wrote {out}/ (a tiny random Llama and its tokenizer) and {args.data}")


if __name__ == "__main__":
    main()
