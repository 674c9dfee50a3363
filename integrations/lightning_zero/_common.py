"""What the Trainer's and Fabric's zero strategies do alike: the config and how Lightning's
arguments meet it, devices and ranks, the process group, barrier and broadcast, turning
Lightning's precision plugin into ours, the checkpoint shards and the strategy registration.

A mixin placed before each namespace's ``ParallelStrategy``; each built class sets
``_zero_dist`` (that namespace's ``utilities.distributed``), ``_zero_rank_zero``,
``_zero_launcher`` (its ``_SubprocessScriptLauncher``), ``_zero_object`` (the name of
Lightning's own state beside the shards) and, for the Trainer, ``_zero_reset_seed``."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, TypeVar, cast

import torch
from typing_extensions import override

import lightning_zero._settings as S
import zero_strategy as zs
from zero_strategy.frontend import format_precision_flags, frontend_engine_config, split_shard_size
from zero_strategy.runtime.optimizer import ZeroOptimizer, engine_of

if TYPE_CHECKING:
    # Typing only (Lightning is imported where a namespace's classes are built): the mixins are
    # checked against lightning.fabric's Precision, which lightning.pytorch's Precision extends,
    # and against _ParallelStrategyBase below.
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.plugins.precision import Precision as _PrecisionBase

    _T = TypeVar("_T")

    class _ParallelStrategyBase:
        """What ``ZeroParallelMixin`` overrides and uses of Lightning's ``ParallelStrategy``:
        ``lightning.pytorch``'s and ``lightning.fabric``'s share no base class."""

        cluster_environment: Optional[ClusterEnvironment]

        @property
        def root_device(self) -> torch.device: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def local_rank(self) -> int: ...
        @property
        def node_rank(self) -> int: ...
        @property
        def distributed_sampler_kwargs(self) -> Optional[dict[str, Any]]: ...
        def _configure_launcher(self) -> None: ...
        def setup_environment(self) -> None: ...
        def barrier(self, name: Optional[str] = None) -> None: ...
        def broadcast(self, obj: _T, src: int = 0) -> _T: ...
        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None: ...

else:
    _PrecisionBase = _ParallelStrategyBase = object

# Lightning's own plugins for the precision flags; ZeroPrecision then refuses flags it cannot run
LIGHTNING_PRECISION_PLUGINS = ("Precision", "MixedPrecision", "DoublePrecision", "HalfPrecision")


class ZeroPrecisionMixin(_PrecisionBase):
    """Autocast to the engine's training dtype (set by the strategy from the resolved config)
    and the engine's fp16 loss scale (through the bound optimizer)."""

    def __init__(self, precision: str = "32-true") -> None:
        S.training_dtype(precision)  # refuses what the engine cannot do
        self.precision = precision  # type: ignore[assignment]  # as given: Lightning's Literal omits the alias "32"
        self.dtype: torch.dtype | None = None
        self.device_type = "cpu"
        self.optimizer: Optional[torch.optim.Optimizer] = None

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        return engine_of(self.optimizer).scale_loss(tensor) if self.optimizer is not None else tensor


def zero_optimizer(optimizer: Any, what: str) -> ZeroOptimizer:
    """The zero_strategy optimizer inside Lightning's or Fabric's optimizer wrapper."""
    opt = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None) or optimizer
    if getattr(opt, "zero_engine", None) is None:
        raise RuntimeError(f"{what}: the optimizer is not managed by zero_strategy; use the one the strategy set up")
    return cast(ZeroOptimizer, opt)  # bound by initialize: its class carries ZeroOptimizer's methods


def register_names(registry: Any, cls: type) -> None:
    """Register zero1 ... zero3_offload_nvme; importing twice registers once."""
    for entry in S.NAMES:
        if entry.name in registry:
            continue
        registry.register(
            entry.name, cls, description=entry.description, stage=entry.stage, offload=dict(entry.offload) or None
        )


def publish(prefix: str, classes: Mapping[str, type]) -> None:
    """Name the classes one ``build`` made as ``lightning_zero.<prefix><name>``, the attribute of
    the package that returns them (reprs, pickling and jsonargparse's ``class_path`` find them)."""
    for name, cls in classes.items():
        cls.__module__, cls.__name__, cls.__qualname__ = "lightning_zero", prefix + name, prefix + name


class ZeroParallelMixin(_ParallelStrategyBase):
    _zero_dist: ModuleType
    _zero_rank_zero: ModuleType
    _zero_launcher: type
    _zero_object: str
    _zero_reset_seed: Optional[Callable[[], None]] = None  # the Trainer's DDP calls lightning's reset_seed()
    parallel_devices: Optional[list[torch.device]]
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
        shard_size: Any = None,
    ) -> None:
        self.zero_config: zs.ZeroConfig = S.strategy_config(config, stage, offload, caller)
        # a DeviceMesh goes to initialize(mesh=...), its shard size (or a number, "node") into the config
        shard, self._zero_mesh = split_shard_size(shard_size, f"{caller}(shard_size=...)")
        self.zero_config = zs.resolve_overrides(self.zero_config, source=f"{caller}(shard_size=...)", shard_size=shard)
        self._policy = policy
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    def _zero_precision_plugin(self, zero_cls: type) -> Any:
        """The strategy's precision plugin (a ``zero_cls``; the default one until Lightning sets it)."""
        plugin = getattr(self, "_zero_precision", None)
        if plugin is None:
            plugin = self._zero_precision = zero_cls()
        return plugin

    def _zero_precision_from(self, plugin: Any, zero_cls: type, caller: str, owner: str) -> Any:
        """``plugin`` (what Lightning picked from ``precision=``) as a ``zero_cls`` instance;
        ``owner`` ("Trainer" or "Fabric") is where the user passes ``precision=`` instead."""
        if plugin is None or isinstance(plugin, zero_cls):
            return plugin
        if type(plugin).__name__ not in LIGHTNING_PRECISION_PLUGINS:
            flags = format_precision_flags("lightning", sep=" | ", last=" | ")
            raise TypeError(
                f"{caller}: the precision plugin {type(plugin).__name__} cannot be combined with the zero strategies; "
                f"pass {owner}(precision={flags}) instead"
            )
        return zero_cls(str(plugin.precision))

    def _zero_apply_arguments(
        self,
        source: str,
        *,
        precision: str,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
        accumulate_grad_batches: int = 1,
    ) -> zs.ZeroConfig:
        """Lightning's arguments (``source`` names them in a conflict) over the strategy's config,
        which keeps the result as ``zero_config``; returns the config the engine gets. Lightning
        runs the accumulation loop and, with ``gradient_clip_val``, the clipping itself."""
        self.zero_config = S.apply_lightning_arguments(
            self.zero_config,
            precision=precision,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            accumulate_grad_batches=accumulate_grad_batches,
            source=source,
        )
        return frontend_engine_config(self.zero_config, frontend_clips=S.lightning_clips(gradient_clip_val))

    def _zero_bind_precision(self, plugin: Any) -> None:
        """The precision plugin autocasts to the resolved config's dtype, on the strategy's device."""
        plugin.dtype = S.autocast_dtype(self.zero_config)
        plugin.device_type = self.root_device.type

    def _zero_sharded_init(self) -> contextlib.AbstractContextManager:
        """Where modules are built (``configure_model``, ``fabric.init_module()``): at stage 3
        each module is cut into shards as its ``__init__`` returns, so no rank holds the whole model;
        with transformers imported, ``from_pretrained`` inside builds in pieces read from the files."""
        if self.zero_config.stage != 3:
            return contextlib.nullcontext()
        if "transformers" in sys.modules:  # imported by the user's code: from_pretrained is routed too
            return zs.sharded_from_pretrained(comm_timeout=self.zero_config.comm_timeout)
        return zs.sharded_init(comm_timeout=self.zero_config.comm_timeout)

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices is None:
            raise RuntimeError(
                f"{type(self).__name__}.root_device: the devices are not set yet; create the Trainer/Fabric first"
            )
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError(
                f"{type(self).__name__}: no cluster environment; Lightning sets it when it creates the strategy"
            )
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._zero_launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Ranks from the cluster environment, then the process group (kept if one exists).
        The random streams end exactly as the same namespace's DDP strategy leaves them: the
        Trainer's DDP re-seeds from ``seed_everything`` here (``reset_seed``), Fabric's does not."""
        super().setup_environment()
        if self._zero_reset_seed is not None:
            self._zero_reset_seed()
        self._zero_set_world_ranks()
        dist = self._zero_dist
        self._process_group_backend = self._process_group_backend or dist._get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        dist._init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def _zero_set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._zero_rank_zero.rank_zero_only.rank = self.global_rank

    def _zero_reduce(self, tensor: Any, group: Optional[Any], reduce_op: Optional[Any]) -> Any:
        """Lightning's ``reduce`` (Trainer) / ``all_reduce`` (Fabric): tensors only, as DDP does."""
        if isinstance(tensor, torch.Tensor):
            return self._zero_dist._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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

    # -- checkpoints: the module and its optimizer as shards, Lightning's own state beside them ---
    def _zero_checkpoint_path(self, path: Any) -> Path:
        """Rank 0's path, on every rank (each rank writes its shards into the same directory)."""
        return Path(self.broadcast(os.fspath(path)))

    def _zero_save_shards(self, path: Path, module: torch.nn.Module, optimizer: Any, state: Any) -> None:
        """``optimizer``: None, one, or a list of several (every one's state is saved)."""
        # keep_last=1: saving again under the same name replaces that save, as a plain checkpoint file is overwritten
        zs.save_checkpoint(path, module, optimizer, objects={self._zero_object: state}, keep_last=1)

    def _zero_load_shards(
        self,
        path: Path,
        module: torch.nn.Module,
        optimizer: Any,
        weights_only: Optional[bool],
    ) -> Any:
        """Load the shards into ``module`` (and ``optimizer``); returns Lightning's own state."""
        zs.load_checkpoint(path, module, optimizer)
        # None (Lightning's default) reads as weights_only=True: only an explicit False opts out
        return zs.read_checkpoint_object(path, self._zero_object, weights_only=weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)
