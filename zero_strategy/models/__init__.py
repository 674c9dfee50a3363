"""Small bundled models for examples, tests and benchmarks (torch only, no downloads)."""

from zero_strategy.models.data import stdlib_corpus, text_batch
from zero_strategy.models.gpt import GPT, Block, GPTConfig, num_parameters, synthetic_batch

__all__ = ["GPT", "Block", "GPTConfig", "num_parameters", "stdlib_corpus", "synthetic_batch", "text_batch"]
