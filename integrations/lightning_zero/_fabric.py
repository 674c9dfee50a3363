"""``ZeroFabricStrategy`` for ``Fabric(strategy="zero3")``, built once per installed Fabric
namespace (``lightning.fabric`` and, if present, ``lightning_fabric``)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

import zero_strategy as zs
from lightning_zero._common import ZeroParallelMixin, ZeroPrecisionMixin, publish, zero_optimizer
from lightning_zero._deepspeed_args import DEEPSPEED_ARGUMENTS, apply_deepspeed_arguments
from zero_strategy.runtime.module import get_engine

FABRIC_OBJECT = "fabric"  # the non-model entries of Fabric's state dict (fabric.pt)


def build(ns: str) -> tuple[type, type]:
    strategies = importlib.import_module(f"{ns}.strategies")
    strategy_mod = importlib.import_module(f"{ns}.strategies.strategy")
    precision_mod = importlib.import_module(f"{ns}.plugins.precision")
    launchers = importlib.import_module(f"{ns}.strategies.launchers.subprocess_script")
    dist = importlib.import_module(f"{ns}.utilities.distributed")
    rank_zero = importlib.import_module(f"{ns}.utilities.rank_zero")
    stateful = importlib.import_module(f"{ns}.utilities.types")._Stateful
    apply_to_collection = importlib.import_module("lightning_utilities.core.apply_func").apply_to_collection
    if TYPE_CHECKING:  # checked against lightning.fabric's classes (nothing is imported at run time)
        from lightning.fabric.plugins.precision import Precision
        from lightning.fabric.strategies import ParallelStrategy
        from lightning.fabric.strategies.strategy import _BackwardSyncControl
    else:  # the base classes of namespace ``ns``
        Precision = precision_mod.Precision
        ParallelStrategy = strategies.ParallelStrategy
        _BackwardSyncControl = strategy_mod._BackwardSyncControl

    class ZeroFabricPrecision(ZeroPrecisionMixin, Precision):
        """Autocast to the engine's training dtype and the engine's fp16 loss scale."""

        @override
        def convert_output(self, data: Any) -> Any:
            # as Fabric's own mixed precision: outputs come back in the default (fp32) dtype
            if self.dtype is None:
                return data
            return apply_to_collection(
                data, torch.Tensor, lambda t: t.to(torch.get_default_dtype()) if t.is_floating_point() else t
            )

        @override
        def backward(self, tensor: torch.Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
            self._scaled(tensor).backward(*args, **kwargs)

    class BackwardSync(_BackwardSyncControl):
        @override
        def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
            if not enabled:
                return contextlib.nullcontext()
            if getattr(module, "zero_engine", None) is None:
                raise TypeError(
                    f"Fabric.no_backward_sync: {type(module).__name__} was not set up by the zero strategy; pass the module fabric.setup returned"
                )
            return get_engine(module).no_sync()

    class ZeroFabricStrategy(ZeroParallelMixin, ParallelStrategy):
        """ZeRO stages 1-3 from ``zero_strategy`` for ``Fabric(strategy=...)``; arguments as
        for the Trainer's ``ZeroStrategy``. Set up the module and its optimizer together (or
        several optimizers over disjoint parameters of it: ``fabric.setup(gan, opt_g, opt_d)``).

        Fabric's ``DeepSpeedStrategy`` arguments are taken too, read as for the Trainer's
        strategy (``lightning_zero._deepspeed_args``): those that mean the same thing go into the
        config, the others are named in one warning; None is "not given". ``load_full_weights``:
        ``fabric.load`` of a single full-weights file is refused with the call that loads one.
        """

        is_distributed = True
        _zero_dist, _zero_rank_zero, _zero_launcher = dist, rank_zero, launchers._SubprocessScriptLauncher
        _zero_object = FABRIC_OBJECT

        def __init__(
            self,
            config: Union[zs.ZeroConfig, dict, str, None] = None,
            *,
            stage: Optional[int] = None,
            policy: Any = None,
            process_group_backend: Optional[str] = None,
            timeout: Optional[timedelta] = timedelta(minutes=30),
            accelerator: Any = None,
            parallel_devices: Optional[list[torch.device]] = None,
            cluster_environment: Any = None,
            checkpoint_io: Any = None,
            precision: Any = None,
            offload: Optional[Mapping[str, Any]] = None,
            shard_size: Union[int, str, DeviceMesh, None] = None,
            # Fabric's DeepSpeedStrategy arguments (lightning_zero._deepspeed_args); None: not given
            zero_optimization: Optional[bool] = None,
            remote_device: Optional[str] = None,
            offload_optimizer: Optional[bool] = None,
            offload_parameters: Optional[bool] = None,
            offload_params_device: Optional[str] = None,
            nvme_path: Optional[str] = None,
            params_buffer_count: Optional[int] = None,
            params_buffer_size: Optional[int] = None,
            max_in_cpu: Optional[int] = None,
            offload_optimizer_device: Optional[str] = None,
            optimizer_buffer_count: Optional[int] = None,
            block_size: Optional[int] = None,
            queue_depth: Optional[int] = None,
            single_submit: Optional[bool] = None,
            overlap_events: Optional[bool] = None,
            thread_count: Optional[int] = None,
            pin_memory: Optional[bool] = None,
            sub_group_size: Optional[int] = None,
            contiguous_gradients: Optional[bool] = None,
            overlap_comm: Optional[bool] = None,
            allgather_partitions: Optional[bool] = None,
            reduce_scatter: Optional[bool] = None,
            allgather_bucket_size: Optional[int] = None,
            reduce_bucket_size: Optional[int] = None,
            zero_allow_untested_optimizer: Optional[bool] = None,
            logging_batch_size_per_gpu: Optional[Union[str, int]] = None,
            logging_level: Optional[int] = None,
            loss_scale: Optional[float] = None,
            initial_scale_power: Optional[int] = None,
            loss_scale_window: Optional[int] = None,
            hysteresis: Optional[int] = None,
            min_loss_scale: Optional[float] = None,
            partition_activations: Optional[bool] = None,
            cpu_checkpointing: Optional[bool] = None,
            contiguous_memory_optimization: Optional[bool] = None,
            synchronize_checkpoint_boundary: Optional[bool] = None,
            load_full_weights: Optional[bool] = None,
            exclude_frozen_parameters: Optional[bool] = None,
        ) -> None:
            given = locals()
            deepspeed = {name: given[name] for name in DEEPSPEED_ARGUMENTS}
            super().__init__(
                accelerator=accelerator,
                parallel_devices=parallel_devices,
                cluster_environment=cluster_environment,
                checkpoint_io=checkpoint_io,
                precision=precision,
            )
            self._zero_init(
                "ZeroFabricStrategy", config, stage, offload, policy, process_group_backend, timeout, shard_size
            )
            self.zero_config = apply_deepspeed_arguments(self.zero_config, deepspeed, "ZeroFabricStrategy")
            self.load_full_weights = bool(load_full_weights)
            self._num_nodes = 1
            self._backward_sync_control = BackwardSync()

        @property
        @override
        def precision(self) -> Any:
            return self._zero_precision_plugin(ZeroFabricPrecision)

        @precision.setter
        @override
        def precision(self, plugin: Any) -> None:
            self._zero_precision = self._zero_precision_from(
                plugin, ZeroFabricPrecision, "ZeroFabricStrategy", "Fabric"
            )

        @property
        def num_nodes(self) -> int:
            return self._num_nodes

        @num_nodes.setter
        def num_nodes(self, num_nodes: int) -> None:
            self._num_nodes = num_nodes

        @override
        def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
            stack = contextlib.ExitStack()
            stack.enter_context(self.root_device)
            stack.enter_context(self._zero_sharded_init())  # fabric.init_module()
            return stack

        @override
        def setup_module_and_optimizers(
            self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
        ) -> Any:
            if not optimizers:
                raise ValueError("ZeroFabricStrategy: fabric.setup got no optimizer; use fabric.setup_module(module)")
            # several: disjoint parameters of the module (zero_strategy.initialize checks)
            module, bound = self._initialize(module, optimizers[0] if len(optimizers) == 1 else list(optimizers))
            opts = [bound] if len(optimizers) == 1 else list(bound)
            self.precision.optimizer = opts[0]
            return module, opts, scheduler

        @override
        def setup_module(self, module: nn.Module) -> nn.Module:
            # no optimizer: evaluation, or gradients read by other code (full averaged p.grad at ZeRO-1/2)
            return self._initialize(module, None)[0]

        def _initialize(self, module: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
            # Fabric has no clipping or accumulation arguments: the engine applies the file's clipping
            engine_config = self._zero_apply_arguments("Fabric(precision=...)", precision=self.precision.precision)
            module, optimizer = zs.initialize(
                module, optimizer, config=engine_config, policy=self._policy, mesh=self._zero_mesh
            )
            self._zero_bind_precision(self.precision)
            return module, optimizer

        @override
        def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            raise NotImplementedError(self._err_msg_joint_setup_required())

        @override
        def module_to_device(self, module: nn.Module) -> None:
            module.to(self.root_device)

        @override
        def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: Union[float, int],
                                norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
            total = zero_optimizer(optimizer, "Fabric.clip_gradients").clip_grad_norm_(
                float(max_norm), float(norm_type)
            )
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(
                    f"Fabric.clip_gradients: the total gradient norm is {total.item()}; pass error_if_nonfinite=False to skip this check"
                )
            return total

        @override
        def clip_gradients_value(
            self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: Union[float, int]
        ) -> None:
            zero_optimizer(optimizer, "Fabric.clip_gradients").clip_grad_value_(float(clip_val))

        @override
        def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
            return self._zero_reduce(tensor, group, reduce_op)

        # -- checkpoints: the model and its optimizer go to shards, the rest to fabric.pt --------
        @override
        def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                            filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:  # fmt: skip
            if storage_options is not None or filter is not None:
                raise TypeError(
                    "ZeroFabricStrategy.save_checkpoint: storage_options and filter are not supported (shards are written by zero_strategy)"
                )
            model_key, opt_keys = _split(state)
            path = self._zero_checkpoint_path(path)
            rest = {
                k: (v.state_dict() if isinstance(v, stateful) else v)
                for k, v in state.items()
                if k != model_key and k not in opt_keys
            }
            meta = {"model_key": model_key, "optimizer_keys": opt_keys, "state": rest}
            self._zero_save_shards(path, state[model_key], _core_arg(state, opt_keys), meta)

        @override
        def load_checkpoint(
            self, path: Any, state: Any = None, strict: bool = True, weights_only: Optional[bool] = None
        ) -> dict[str, Any]:
            if not isinstance(state, dict) or not state:
                raise TypeError(
                    "ZeroFabricStrategy.load_checkpoint: pass the state dict to restore into, e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})"
                )
            model_key, opt_keys = _split(state)
            path = self._zero_checkpoint_path(path)
            if path.is_file():
                raise ValueError(
                    f"ZeroFabricStrategy.load_checkpoint: {path} is a file; fabric.load reads sharded checkpoint "
                    "directories (written by fabric.save). Load full weights with "
                    "zero_strategy.load_full_state_dict(model, path) on every rank"
                )
            meta = self._zero_load_shards(path, state[model_key], _core_arg(state, opt_keys), weights_only)
            saved = dict(meta["state"])
            for key, obj in list(state.items()):
                if key == model_key or key in opt_keys:
                    continue
                if key not in saved:
                    if strict:
                        raise KeyError(
                            f"ZeroFabricStrategy.load_checkpoint: {key!r} is not in the checkpoint {path} (it has {sorted(saved)}); pass strict=False to skip it"
                        )
                    continue
                if isinstance(obj, stateful):
                    obj.load_state_dict(saved.pop(key))
                else:
                    state[key] = saved.pop(key)
            return saved

    prefix = "" if ns == "lightning.fabric" else "LF"
    publish(prefix, {"ZeroFabricStrategy": ZeroFabricStrategy, "ZeroFabricPrecision": ZeroFabricPrecision})
    return ZeroFabricStrategy, ZeroFabricPrecision


def _core_arg(state: Mapping[str, Any], keys: list[str]) -> Any:
    """The optimizers under ``keys`` as the core takes them: None, the one, or the list."""
    return None if not keys else state[keys[0]] if len(keys) == 1 else [state[k] for k in keys]


def _split(state: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The keys of the one zero-managed module and of its optimizers in Fabric's state dict
    (several: sorted by key, so a save and a load under the same keys pair them alike)."""
    models = [k for k, v in state.items() if isinstance(v, nn.Module) and getattr(v, "zero_engine", None) is not None]
    if len(models) != 1:
        raise ValueError(
            f"ZeroFabricStrategy: the state must hold exactly one module set up by the zero strategy; found {models or 'none'}"
        )
    engine = state[models[0]].zero_engine
    opts = [
        k
        for k, v in state.items()
        if isinstance(v, torch.optim.Optimizer) and getattr(v, "zero_engine", None) is engine
    ]
    return models[0], sorted(opts)
