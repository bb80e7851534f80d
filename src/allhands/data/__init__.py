"""Token data: tokenizers, memory-mapped shards, mixtures, and the world-size independent sampler."""

from allhands.data.mixture import MixtureDataset, load_training_data
from allhands.data.sampler import GlobalSampler
from allhands.data.shards import TokenDataset, load_token_splits, prepare, prepare_embedded
from allhands.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "GlobalSampler", "MixtureDataset", "TokenDataset", "load_token_splits",
           "load_training_data", "prepare", "prepare_embedded"]
