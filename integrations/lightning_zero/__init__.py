"""Lightning front-end for zero_strategy: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

Importing this package registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3``,
``zero3_offload`` and ``zero3_offload_nvme`` with every Lightning namespace that is installed
(``lightning.pytorch``, ``pytorch_lightning``, ``lightning.fabric``, ``lightning_fabric``).
Those packages have separate base classes and registries, so one strategy class is built per
namespace, on first need. ``lightning_zero.ZeroStrategy`` is the ``lightning.pytorch`` one
(``PLZeroStrategy`` the ``pytorch_lightning`` one); ``ZeroFabricStrategy`` (``LFZeroFabricStrategy``)
are Fabric's. ``zero3_offload_nvme`` puts the optimizer state and the parameter shards in swap files
(under the temp dir; set ``offload_*.nvme_path`` through ``ZeroStrategy(config=...)`` for a real disk).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["ZeroFabricStrategy", "ZeroPrecision", "ZeroStrategy", "register"]

# public name -> (namespace, builder module, index in the built tuple)
_LAZY = {
    "ZeroStrategy": ("lightning.pytorch", "_trainer", 0),
    "ZeroPrecision": ("lightning.pytorch", "_trainer", 1),
    "PLZeroStrategy": ("pytorch_lightning", "_trainer", 0),
    "PLZeroPrecision": ("pytorch_lightning", "_trainer", 1),
    "ZeroFabricStrategy": ("lightning.fabric", "_fabric", 0),
    "ZeroFabricPrecision": ("lightning.fabric", "_fabric", 1),
    "LFZeroFabricStrategy": ("lightning_fabric", "_fabric", 0),
    "LFZeroFabricPrecision": ("lightning_fabric", "_fabric", 1),
}
_REGISTRIES = {
    "lightning.pytorch": ("lightning.pytorch.strategies", "StrategyRegistry", "ZeroStrategy"),
    "pytorch_lightning": ("pytorch_lightning.strategies", "StrategyRegistry", "PLZeroStrategy"),
    "lightning.fabric": ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "ZeroFabricStrategy"),
    "lightning_fabric": ("lightning_fabric.strategies", "STRATEGY_REGISTRY", "LFZeroFabricStrategy"),
}
_built: dict[tuple[str, str], tuple[type, ...]] = {}


def _installed(ns: str) -> bool:
    try:
        return importlib.util.find_spec(ns) is not None
    except (ImportError, ValueError):
        return False


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")
    ns, builder, index = _LAZY[name]
    if not _installed(ns):
        raise ImportError(f"lightning_zero.{name} needs the '{ns}' package; install it (pip install lightning)")
    key = (ns, builder)
    if key not in _built:
        _built[key] = importlib.import_module(f"lightning_zero.{builder}").build(ns)
    return _built[key][index]


def register() -> list[str]:
    """Register the strategy names in every installed namespace (idempotent); returns the namespaces."""
    from lightning_zero._common import register_names

    done = []
    for ns, (module, registry, cls_name) in _REGISTRIES.items():
        if not _installed(ns):  # find_spec of a submodule: False when its package is missing too
            continue
        register_names(getattr(importlib.import_module(module), registry), __getattr__(cls_name))
        done.append(ns)
    return done


register()
