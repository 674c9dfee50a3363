"""``ZeroMemoryMonitor``: the engine's memory per kind and tier (``zero_strategy.memory_stats``)
in the Trainer's loggers, built once per installed namespace like the strategy.

After every ``every_n_steps``-th optimizer step (default: the Trainer's ``log_every_n_steps``)
rank 0 logs its bytes as ``zero_memory/<key>``: the kinds (``params``, ``param_shards``,
``masters``, ``grad_shards``, ``optimizer_state``, ...) and the tiers (``tier_device``,
``tier_host_pinned``, ``tier_host_pageable``, ``tier_disk``). Ranks hold nearly the same
(shards differ by at most one element per parameter), so rank 0's numbers stand for each rank.
Reading the numbers is local: no collective, no host sync with the device.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional

import zero_strategy as zs
from lightning_zero._common import publish

PREFIX = "zero_memory/"


def build(ns: str) -> tuple[type]:
    """``(ZeroMemoryMonitor,)`` subclassing namespace ``ns``'s ``Callback``."""
    if TYPE_CHECKING:
        from lightning.pytorch import Callback
    else:
        Callback = importlib.import_module(f"{ns}.callbacks").Callback

    class ZeroMemoryMonitor(Callback):
        """Log ``zero_strategy.memory_stats`` to the Trainer's loggers (see the module docstring).

        Args:
            every_n_steps: log after every n-th optimizer step (default: the Trainer's
                ``log_every_n_steps``).
            prefix: the metric names' prefix.
        """

        def __init__(self, every_n_steps: Optional[int] = None, prefix: str = PREFIX) -> None:
            if every_n_steps is not None and every_n_steps < 1:
                raise ValueError(f"ZeroMemoryMonitor(every_n_steps={every_n_steps}): use a positive number or None")
            self.every_n_steps, self.prefix = every_n_steps, prefix
            self._logged_step = -1

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            every = self.every_n_steps or trainer.log_every_n_steps
            if step == self._logged_step or step % every or not trainer.loggers or not trainer.is_global_zero:
                return  # not an optimizer step (accumulation), not due, or nowhere to log
            if getattr(pl_module, "zero_engine", None) is None:
                raise RuntimeError(
                    "ZeroMemoryMonitor: the LightningModule is not managed by zero_strategy; "
                    'use it with strategy=ZeroStrategy(...) or "zero1" ... "zero3_offload_nvme"'
                )
            self._logged_step = step
            metrics = {f"{self.prefix}{key}": float(value) for key, value in zs.memory_stats(pl_module).items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    prefix = "" if ns == "lightning.pytorch" else "PL"
    publish(prefix, {"ZeroMemoryMonitor": ZeroMemoryMonitor})
    return (ZeroMemoryMonitor,)
