"""zero-strategy: ZeRO (Zero Redundancy Optimizer) for PyTorch in one small core.

The public names below load on first use (PEP 562), so that ``import zero_strategy.cli`` (and
``zero-strategy --help``) does not import torch; ``from zero_strategy import X`` and
``zero_strategy.X`` work as usual. ``_PUBLIC`` (runtime) and the ``TYPE_CHECKING`` imports
(type checkers) list the same names: ``tests/unit/test_cli.py`` checks they agree.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from zero_strategy._version import __version__

if TYPE_CHECKING:
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
    from zero_strategy.checkpoint.pretrained import from_pretrained, sharded_from_pretrained
    from zero_strategy.checkpoint.stream import gathered_weights
    from zero_strategy.comm.collectives import (
        CollectiveError,
        comm_report,
        comm_stats,
        comm_stats_by_link,
        reset_comm_stats,
    )
    from zero_strategy.comm.profiling import profile
    from zero_strategy.config import ZeroConfig, resolve_overrides
    from zero_strategy.runtime.optimizer import UnknownOptimizerWarning
    from zero_strategy.runtime.phase_offload import offload_states, reload_states
    from zero_strategy.runtime.whole_params import whole_params
    from zero_strategy.sharding.construction import sharded_init
    from zero_strategy.sharding.experts.detect import declare_experts, select_experts
    from zero_strategy.sharding.partition import zero_auto_partition
    from zero_strategy.sharding.unit import UnitDivergence

# public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "backward": "zero_strategy.api",
    "clip_grad_norm_": "zero_strategy.api",
    "destroy": "zero_strategy.api",
    "full_grad": "zero_strategy.api",
    "gathered_parameters": "zero_strategy.api",
    "initialize": "zero_strategy.api",
    "memory_stats": "zero_strategy.api",
    "replace_optimizer": "zero_strategy.api",
    "begin_versioned_save": "zero_strategy.checkpoint",
    "commit_versioned_save": "zero_strategy.checkpoint",
    "load_checkpoint": "zero_strategy.checkpoint",
    "read_checkpoint_object": "zero_strategy.checkpoint",
    "resolve_checkpoint": "zero_strategy.checkpoint",
    "save_checkpoint": "zero_strategy.checkpoint",
    "export_full": "zero_strategy.checkpoint.export",
    "full_state_dict": "zero_strategy.checkpoint.export",
    "load_full_state_dict": "zero_strategy.checkpoint.loading",
    "from_pretrained": "zero_strategy.checkpoint.pretrained",
    "sharded_from_pretrained": "zero_strategy.checkpoint.pretrained",
    "gathered_weights": "zero_strategy.checkpoint.stream",
    "CollectiveError": "zero_strategy.comm.collectives",
    "comm_report": "zero_strategy.comm.collectives",
    "comm_stats": "zero_strategy.comm.collectives",
    "comm_stats_by_link": "zero_strategy.comm.collectives",
    "reset_comm_stats": "zero_strategy.comm.collectives",
    "profile": "zero_strategy.comm.profiling",
    "ZeroConfig": "zero_strategy.config",
    "resolve_overrides": "zero_strategy.config",
    "UnknownOptimizerWarning": "zero_strategy.runtime.optimizer",
    "offload_states": "zero_strategy.runtime.phase_offload",
    "reload_states": "zero_strategy.runtime.phase_offload",
    "whole_params": "zero_strategy.runtime.whole_params",
    "sharded_init": "zero_strategy.sharding.construction",
    "declare_experts": "zero_strategy.sharding.experts.detect",
    "select_experts": "zero_strategy.sharding.experts.detect",
    "zero_auto_partition": "zero_strategy.sharding.partition",
    "UnitDivergence": "zero_strategy.sharding.unit",
}

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
    "comm_stats_by_link",
    "commit_versioned_save",
    "declare_experts",
    "destroy",
    "export_full",
    "full_grad",
    "from_pretrained",
    "full_state_dict",
    "gathered_parameters",
    "gathered_weights",
    "initialize",
    "load_checkpoint",
    "load_full_state_dict",
    "memory_stats",
    "offload_states",
    "profile",
    "read_checkpoint_object",
    "reload_states",
    "replace_optimizer",
    "resolve_checkpoint",
    "reset_comm_stats",
    "resolve_overrides",
    "save_checkpoint",
    "select_experts",
    "sharded_from_pretrained",
    "sharded_init",
    "whole_params",
    "zero_auto_partition",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # a subpackage not imported yet (``zero_strategy.api``), as before the names were lazy
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'zero_strategy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
