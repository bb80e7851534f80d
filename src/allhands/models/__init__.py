"""The models allhands ships: the reference GPT and the Llama family (Llama 2/3, Mistral, Qwen2,
Qwen3) built from shared layers, their named presets, and the way from a config section to a
module."""

from allhands.models.gpt import GPT, GPTConfig
from allhands.models.llama import Llama, LlamaConfig
from allhands.models.presets import PRESETS, preset

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "preset"]
