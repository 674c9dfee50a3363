"""zero-strategy: ZeRO (Zero Redundancy Optimizer) for PyTorch in one small core."""

from zero_strategy.api import backward, clip_grad_norm_, full_grad, initialize, memory_stats
from zero_strategy.collectives import CollectiveError, comm_stats, reset_comm_stats
from zero_strategy.config import ZeroConfig

__version__ = "0.1.0.dev0"

__all__ = [
    "CollectiveError",
    "ZeroConfig",
    "backward",
    "clip_grad_norm_",
    "comm_stats",
    "full_grad",
    "initialize",
    "memory_stats",
    "reset_comm_stats",
]
