"""What the Trainer's and Fabric's zero strategies do alike: the config, devices and ranks, the
process group, barrier and broadcast, and turning Lightning's precision plugin into ours.

A mixin placed before each namespace's ``ParallelStrategy``; the builder sets ``_zero_dist``
(that namespace's ``utilities.distributed``) and ``_zero_rank_zero``."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from types import ModuleType
from typing import Any, Mapping, Optional

import torch
from typing_extensions import override

import zero_strategy as zs
from lightning_zero import _settings as S

# Lightning's own plugins for the precision flags; ZeroPrecision then refuses flags it cannot run
LIGHTNING_PRECISION_PLUGINS = ("Precision", "MixedPrecision", "DoublePrecision", "HalfPrecision")


class ZeroPrecisionMixin:
    """Autocast to the engine's training dtype (set by the strategy from the resolved config)
    and the engine's fp16 loss scale (through the bound optimizer)."""

    def __init__(self, precision: str = "32-true") -> None:
        S.training_dtype(precision)  # refuses what the engine cannot do
        self.precision = precision
        self.dtype: torch.dtype | None = None
        self.device_type = "cpu"
        self.optimizer: Optional[torch.optim.Optimizer] = None

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(tensor) if self.optimizer is not None else tensor


class ZeroParallelMixin:
    _zero_dist: ModuleType
    _zero_rank_zero: ModuleType
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Any
    num_nodes: int

    def _zero_init(
        self,
        caller: str,
        config: Any,
        stage: Optional[int],
        offload: Optional[Mapping[str, Any]],
        policy: Any,
        process_group_backend: Optional[str],
        timeout: Optional[timedelta],
    ) -> None:
        self.zero_config: zs.ZeroConfig = S.strategy_config(config, stage, offload, caller)
        self._policy = policy
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    def _zero_precision_from(self, plugin: Any, zero_cls: type, caller: str, flag: str) -> Any:
        """``plugin`` (what Lightning picked from ``precision=``) as a ``zero_cls`` instance."""
        if plugin is None or isinstance(plugin, zero_cls):
            return plugin
        if type(plugin).__name__ not in LIGHTNING_PRECISION_PLUGINS:
            raise TypeError(
                f"{caller}: the precision plugin {type(plugin).__name__} cannot be combined with the zero strategies; "
                f"pass {flag}(precision='32-true' | 'bf16-mixed' | '16-mixed') instead"
            )
        return zero_cls(str(plugin.precision))

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, f"{type(self).__name__}: parallel_devices is not set yet"
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _zero_setup_process_group(self) -> None:
        """Ranks from the cluster environment, then the process group (kept if one exists)."""
        self._zero_set_world_ranks()
        dist = self._zero_dist
        self._process_group_backend = self._process_group_backend or dist._get_default_process_group_backend_for_device(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        dist._init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def _zero_set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._zero_rank_zero.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._zero_dist._distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._zero_dist._distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]
