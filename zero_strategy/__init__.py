"""zero-strategy: ZeRO (Zero Redundancy Optimizer) for PyTorch in one small core."""

from zero_strategy._version import __version__
from zero_strategy.api import (
    backward,
    clip_grad_norm_,
    destroy,
    full_grad,
    gathered_parameters,
    initialize,
    memory_stats,
    replace_optimizer,
)
from zero_strategy.checkpoint import (
    begin_versioned_save,
    commit_versioned_save,
    load_checkpoint,
    read_checkpoint_object,
    resolve_checkpoint,
    save_checkpoint,
)
from zero_strategy.checkpoint.export import export_full, full_state_dict
from zero_strategy.checkpoint.loading import load_full_state_dict
from zero_strategy.comm.collectives import CollectiveError, comm_report, comm_stats, reset_comm_stats
from zero_strategy.comm.profiling import profile
from zero_strategy.config import ZeroConfig, resolve_overrides
from zero_strategy.runtime.optimizer import UnknownOptimizerWarning
from zero_strategy.sharding.construction import sharded_init
from zero_strategy.sharding.partition import zero_auto_partition
from zero_strategy.sharding.unit import UnitDivergence

__all__ = [
    "__version__",
    "CollectiveError",
    "UnitDivergence",
    "UnknownOptimizerWarning",
    "ZeroConfig",
    "backward",
    "begin_versioned_save",
    "clip_grad_norm_",
    "comm_report",
    "comm_stats",
    "commit_versioned_save",
    "destroy",
    "export_full",
    "full_grad",
    "full_state_dict",
    "gathered_parameters",
    "initialize",
    "load_checkpoint",
    "load_full_state_dict",
    "memory_stats",
    "profile",
    "read_checkpoint_object",
    "replace_optimizer",
    "resolve_checkpoint",
    "reset_comm_stats",
    "resolve_overrides",
    "save_checkpoint",
    "sharded_init",
    "zero_auto_partition",
]
