"""Lightning front-end for zero_strategy: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

Importing this package registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3``,
``zero3_offload`` and ``zero3_offload_nvme`` with every Lightning namespace that is installed
(``lightning.pytorch``, ``pytorch_lightning``, ``lightning.fabric``, ``lightning_fabric``).
Those packages have separate base classes and registries, so one strategy class is built per
namespace, on first need. ``lightning_zero.ZeroStrategy`` is the ``lightning.pytorch`` one
(``PLZeroStrategy`` the ``pytorch_lightning`` one); ``ZeroFabricStrategy`` (``LFZeroFabricStrategy``)
are Fabric's. ``zero3_offload_nvme`` puts the optimizer state and the parameter shards in swap files
(under the temp dir; set ``offload_*.nvme_path`` through ``ZeroStrategy(config=...)`` for a real disk).

``ZeroMemoryMonitor`` logs the engine's memory per kind and tier; ``convert_zero_checkpoint_to_fp32_state_dict``
(and ``zero-strategy convert``) turns a sharded checkpoint into one fp32 ``.ckpt``, and
``LightningModule.load_from_checkpoint`` reads the sharded directory itself (``lightning_zero.convert``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = [
    "ZeroFabricStrategy",
    "ZeroMemoryMonitor",
    "ZeroPrecision",
    "ZeroStrategy",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "register",
]

# public name -> (namespace, builder module, index in the built tuple)
_LAZY = {
    "ZeroStrategy": ("lightning.pytorch", "_trainer", 0),
    "ZeroPrecision": ("lightning.pytorch", "_trainer", 1),
    "PLZeroStrategy": ("pytorch_lightning", "_trainer", 0),
    "PLZeroPrecision": ("pytorch_lightning", "_trainer", 1),
    "ZeroMemoryMonitor": ("lightning.pytorch", "_monitor", 0),
    "PLZeroMemoryMonitor": ("pytorch_lightning", "_monitor", 0),
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
    """Register the strategy names in every installed namespace (idempotent); returns the
    namespaces. The Trainer's namespaces also get ``load_from_checkpoint`` of a sharded
    checkpoint directory (``lightning_zero.convert.install_checkpoint_reader``)."""
    from lightning_zero._common import register_names
    from lightning_zero.convert import install_checkpoint_reader

    done = []
    for ns, (module, registry, cls_name) in _REGISTRIES.items():
        if not _installed(ns):  # find_spec of a submodule: False when its package is missing too
            continue
        register_names(getattr(importlib.import_module(module), registry), __getattr__(cls_name))
        if ns in ("lightning.pytorch", "pytorch_lightning"):
            install_checkpoint_reader(ns)
        done.append(ns)
    return done


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_file: Any, tag: Any = None) -> dict:
    """One fp32 Lightning ``.ckpt`` from a sharded checkpoint (``lightning_zero.convert``)."""
    from lightning_zero.convert import convert_zero_checkpoint_to_fp32_state_dict as convert

    return convert(checkpoint_dir, output_file, tag)


register()
