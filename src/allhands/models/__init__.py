"""The models allhands ships: the reference GPT and the Llama family (Llama 2/3, Mistral, Qwen2,
Qwen3, and their mixtures of experts) built from shared layers, their named presets, the way from
a config section to a module, and transformers directories in and out (``from_hf``, ``to_hf``,
``load_hf``: models/hf.py)."""

from allhands.models.gpt import GPT, GPTConfig
from allhands.models.llama import Llama, LlamaConfig
from allhands.models.presets import PRESETS, preset

_HF = ("from_hf", "load_hf", "to_hf")


def __getattr__(name: str):
    # models/hf.py loads on first use: it imports safetensors and DTensor, about a second more
    # than the models themselves, which `import allhands.models` does not pay for.
    if name in _HF:
        from allhands.models import hf
        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "from_hf", "load_hf", "preset", "to_hf"]
