"""The models allhands ships: the reference GPT a job trains when it brings none."""

from allhands.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
