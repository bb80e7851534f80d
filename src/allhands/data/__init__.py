"""Token data: byte tokenizer, memory-mapped shards, and the world-size independent sampler."""

from allhands.data.sampler import GlobalSampler
from allhands.data.shards import TokenDataset, load_token_splits, prepare, prepare_embedded
from allhands.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "GlobalSampler", "TokenDataset", "load_token_splits", "prepare",
           "prepare_embedded"]
