"""``ZeroStrategy`` for the Lightning Trainer, built once per installed namespace
(``lightning.pytorch`` and, if present, ``pytorch_lightning``: they have separate base classes).

The strategy keeps the LightningModule itself as ``strategy.model``; ``zero_strategy.initialize``
changes it in place (parameter names stay the same, so checkpoints are keyed by the module's
own names). Every step runs through the module's ``__call__`` (Lightning's forward
redirection), so the engine's root hooks gather what ZeRO-3 needs and see the step's outputs.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

import zero_strategy as zs
from lightning_zero._common import ZeroParallelMixin, ZeroPrecisionMixin, publish, zero_optimizer
from lightning_zero._deepspeed_args import DEEPSPEED_ARGUMENTS, apply_deepspeed_arguments
from lightning_zero._toggle import install_toggles
from zero_strategy.frontend import accumulation_to_adopt
from zero_strategy.runtime.module import get_engine

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

LIGHTNING_OBJECT = "lightning"  # the Trainer's state, saved beside the shards (lightning.pt)


def build(ns: str) -> tuple[type, type]:
    """``(ZeroStrategy, ZeroPrecision)`` subclassing the base classes of namespace ``ns``."""
    pl: ModuleType = importlib.import_module(ns)
    strategies = importlib.import_module(f"{ns}.strategies")
    precision_mod = importlib.import_module(f"{ns}.plugins.precision")
    launchers = importlib.import_module(f"{ns}.strategies.launchers.subprocess_script")
    fabric_ns = "lightning.fabric" if ns.startswith("lightning.") else "lightning_fabric"
    fabric_dist = importlib.import_module(f"{fabric_ns}.utilities.distributed")
    trainer_fn = importlib.import_module(f"{ns}.trainer.states").TrainerFn
    rank_zero = importlib.import_module(f"{ns}.utilities.rank_zero")
    reset_seed = importlib.import_module(f"{fabric_ns}.utilities.seed").reset_seed
    if TYPE_CHECKING:  # checked against lightning.pytorch's classes (nothing is imported at run time)
        from lightning.pytorch.plugins.precision import Precision
        from lightning.pytorch.strategies import ParallelStrategy
    else:  # the base classes of namespace ``ns``
        Precision = precision_mod.Precision
        ParallelStrategy = strategies.ParallelStrategy

    class ZeroPrecision(ZeroPrecisionMixin, Precision):
        """Precision for the zero strategies: autocast to the engine's training dtype, the
        engine's fp16 loss scale, global-norm clipping over the shards, and a step that runs
        the closure first (the engine reduces gradients before the optimizer sees them)."""

        @override
        def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
            tensor = super().pre_backward(tensor, module)
            return self._scaled(tensor)

        @override
        def optimizer_step(  # type: ignore[override]  # the Trainer's signature, as lightning.pytorch's Precision
            self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
        ) -> Any:
            closure_result = closure()  # forward and backward first: the step needs reduced gradients
            self._after_closure(model, optimizer)  # callbacks, then clipping (global norm, below)
            skipped_backward = closure_result is None
            if isinstance(model, pl.LightningModule) and model.automatic_optimization and skipped_backward:
                return closure_result
            optimizer.step(**kwargs)
            return closure_result

        @override
        def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
            zero_optimizer(optimizer, "gradient_clip_val").clip_grad_norm_(float(clip_val))

        @override
        def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
            zero_optimizer(optimizer, "gradient_clip_val").clip_grad_value_(float(clip_val))

    class ZeroStrategy(ZeroParallelMixin, ParallelStrategy):
        """ZeRO stages 1-3 from ``zero_strategy`` for ``Trainer(strategy=...)``.

        Args:
            config: a ``ZeroConfig``, a dict, or a path to a YAML/JSON file (DeepSpeed key names).
            stage: 1, 2 or 3; overrides the file's stage (a different stage in the file raises).
            state_dict_type: ``"sharded"`` (every rank writes its pieces, reloadable on any
                number of devices) or ``"full"`` (one consolidated file, weights only).
            policy: ZeRO-3 units for modules you cannot decorate: a set of module classes or a
                callable ``module -> bool`` (default: ``@zero_auto_partition`` classes,
                Hugging Face ``_no_split_modules``, else the outermost list of blocks).
            process_group_backend: ``"gloo"`` or ``"nccl"`` (default: by device).
            timeout: the process group's timeout.
            offload: ``{"offload_optimizer": {...}, "offload_param": {...}}`` blocks over the config's.
            shard_size: shard groups (hybrid sharding, HSDP): ranks per group, ``"node"`` (one group
                per node, from ``LOCAL_WORLD_SIZE``), or a 2-D ``DeviceMesh`` (dim 0 replicate, dim 1
                shard; built after the process group, e.g. under torchrun). None: the config's.

        Lightning's ``DeepSpeedStrategy`` arguments are taken too (``offload_optimizer=True``,
        ``allgather_bucket_size=...``, ``loss_scale_window=...``, ...): those that mean the same
        thing here go into the config, the others are named in one warning; None is "not given".
        See ``lightning_zero._deepspeed_args`` for each one.
        """

        strategy_name = "zero"
        _zero_dist, _zero_rank_zero, _zero_launcher = fabric_dist, rank_zero, launchers._SubprocessScriptLauncher
        _zero_reset_seed = staticmethod(reset_seed)  # as DDPStrategy.setup_distributed
        _zero_object = LIGHTNING_OBJECT
        is_distributed = True  # Lightning adds the DistributedSampler only for distributed strategies

        def __init__(
            self,
            config: Union[zs.ZeroConfig, dict, str, None] = None,
            *,
            stage: Optional[int] = None,
            state_dict_type: Literal["sharded", "full"] = "sharded",
            policy: Any = None,
            process_group_backend: Optional[str] = None,
            timeout: Optional[timedelta] = timedelta(minutes=30),
            accelerator: Any = None,
            parallel_devices: Optional[list[torch.device]] = None,
            cluster_environment: Any = None,
            checkpoint_io: Any = None,
            precision_plugin: Any = None,
            offload: Optional[Mapping[str, Any]] = None,
            shard_size: Union[int, str, DeviceMesh, None] = None,
            # DeepSpeedStrategy's arguments (lightning_zero._deepspeed_args); None: not given
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
                precision_plugin=precision_plugin,
            )
            if state_dict_type not in ("sharded", "full"):
                raise ValueError(f"ZeroStrategy(state_dict_type={state_dict_type!r}): use 'sharded' or 'full'")
            self._zero_init("ZeroStrategy", config, stage, offload, policy, process_group_backend, timeout, shard_size)
            self.zero_config = apply_deepspeed_arguments(self.zero_config, deepspeed, "ZeroStrategy")
            self.load_full_weights = bool(load_full_weights)  # a file is loaded as full weights either way
            self.state_dict_type = state_dict_type
            self.num_nodes = 1

        # -- precision: whatever plugin Lightning picked becomes a ZeroPrecision ---------------
        @property
        @override
        def precision_plugin(self) -> Any:
            return self._zero_precision_plugin(ZeroPrecision)

        @precision_plugin.setter
        @override
        def precision_plugin(self, plugin: Any) -> None:
            self._zero_precision = self._zero_precision_from(plugin, ZeroPrecision, "ZeroStrategy", "Trainer")

        @property
        @override
        def restore_checkpoint_after_setup(self) -> bool:
            return True  # the engine must exist to receive the shards

        @property
        @override
        def lightning_restore_optimizer(self) -> bool:
            return False  # load_checkpoint restores the optimizer shards itself

        def set_world_ranks(self) -> None:  # Lightning's connector calls it by this name
            self._zero_set_world_ranks()

        # -- model ------------------------------------------------------------------------------
        @contextlib.contextmanager
        @override
        def model_sharded_context(self) -> Generator[None, None, None]:
            with self._zero_sharded_init():  # configure_model runs here
                yield

        @override
        def setup(self, trainer: Any) -> None:
            if self.accelerator is None or self.model is None:
                raise RuntimeError(
                    "ZeroStrategy.setup: no accelerator or model; the Trainer connects them before setup"
                )
            self.accelerator.setup(trainer)
            fitting = trainer.state.fn == trainer_fn.FITTING
            wanted = self._zero_apply_arguments(
                "the Trainer's arguments (precision, gradient_clip_val, accumulate_grad_batches)",
                precision=str(self.precision_plugin.precision),
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=getattr(
                    trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm
                ),
                accumulate_grad_batches=trainer.accumulate_grad_batches,
            )
            steps = accumulation_to_adopt(self.zero_config, trainer.accumulate_grad_batches)
            if steps is not None:
                trainer.accumulate_grad_batches = steps  # the file's setting, which the Trainer runs
                rank_zero.rank_zero_info(f"ZeroStrategy: accumulate_grad_batches={steps} from the config file")
            engine_ready = getattr(self.model, "zero_engine", None) is not None
            if fitting:
                self._reset_optimizers_and_schedulers()
                super().setup_optimizers(trainer)  # several: Lightning requires manual optimization
                if not self.optimizers:
                    raise ValueError(
                        "ZeroStrategy: configure_optimizers returned no optimizer; return one (or several over "
                        "disjoint parameters, with manual optimization)"
                    )
            if not engine_ready:
                if self._layer_sync is not None:  # sync_batchnorm=True, before the engine sees the modules
                    self.model = self._layer_sync.apply(self.model)
                self.model_to_device()
                # validate/test/predict: no optimizer, as DDP
                zs.initialize(
                    self.model,
                    self._zero_optimizers() if fitting else None,
                    config=wanted,
                    policy=self._policy,
                    mesh=self._zero_mesh,
                )
            else:
                current = get_engine(self.model).config
                if current != wanted:
                    have, want = current.to_dict(), wanted.to_dict()
                    diff = [f for f in have if have[f] != want[f]]
                    raise ValueError(
                        f"ZeroStrategy: this LightningModule was set up before with other zero settings ({diff}); "
                        "use the same strategy, precision and clipping for every Trainer call on it, or a fresh module"
                    )
                if fitting and getattr(self.optimizers[0], "zero_engine", None) is None:
                    # set up before for validate/test/predict (or an earlier fit): a fresh optimizer, as under DDP
                    zs.replace_optimizer(self.model, self._zero_optimizers())
            if fitting and len(self.optimizers) > 1:  # toggle_optimizer over the model's parameters
                install_toggles(self._zero_lightning_module("setup"), pl.LightningModule)
            self._bind_precision()
            self.setup_precision_plugin()

        def _zero_optimizers(self) -> Any:
            """The optimizer, or the list of several (disjoint parameters), for the core."""
            return self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)

        def _bind_precision(self) -> None:
            plugin = self.precision_plugin
            self._zero_bind_precision(plugin)
            plugin.optimizer = self.optimizers[0] if self.optimizers else None

        def _zero_model(self, caller: str) -> torch.nn.Module:
            """The model the Trainer connected (it does so before ``setup``)."""
            if self.model is None:
                raise RuntimeError(f"ZeroStrategy.{caller}: no model; the Trainer connects it before setup")
            return self.model

        def _zero_lightning_module(self, caller: str) -> LightningModule:
            """The LightningModule the Trainer connected (it does so before ``setup``)."""
            module = self.lightning_module
            if module is None:
                raise RuntimeError(f"ZeroStrategy.{caller}: no LightningModule; the Trainer connects it before setup")
            return module

        @override
        def model_to_device(self) -> None:
            self._zero_model("model_to_device").to(self.root_device)

        @contextlib.contextmanager
        @override
        def block_backward_sync(self) -> Generator[None, None, None]:
            """Accumulation steps: gradients stay local until the step that syncs."""
            with get_engine(self._zero_model("block_backward_sync")).no_sync():
                yield None

        def _redirect(self, context: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            # through the module's __call__, so the engine's root hooks run around the step
            model, lightning_module = self._zero_model(method), self._zero_lightning_module(method)
            with context:
                return self._forward_redirection(model, lightning_module, method, *args, **kwargs)

        @override
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._redirect(self.precision_plugin.train_step_context(), "training_step", *args, **kwargs)

        @override
        def validation_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._redirect(self.precision_plugin.val_step_context(), "validation_step", *args, **kwargs)

        @override
        def test_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._redirect(self.precision_plugin.test_step_context(), "test_step", *args, **kwargs)

        @override
        def predict_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._redirect(self.precision_plugin.predict_step_context(), "predict_step", *args, **kwargs)

        # -- collectives Lightning asks for (barrier and broadcast: the mixin) -------------------
        @override
        def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
            return self._zero_reduce(tensor, group, reduce_op)

        # -- checkpoints ----------------------------------------------------------------------------
        @override
        def lightning_module_state_dict(self) -> dict[str, Any]:
            if self.state_dict_type == "full":
                # collective; rank 0 keeps it
                return zs.full_state_dict(self._zero_model("lightning_module_state_dict"))
            return {}  # sharded: save_checkpoint writes the pieces

        @override
        def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
            return {}  # sharded: in the shards; full: weights only (see the class docstring)

        @override
        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
        ) -> None:
            if storage_options is not None:
                raise TypeError(
                    "ZeroStrategy.save_checkpoint(storage_options=...) is not supported: shards are written by zero_strategy"
                )
            path = self._zero_checkpoint_path(filepath)
            if self.state_dict_type == "full":
                if path.is_dir():
                    raise ValueError(f"ZeroStrategy(state_dict_type='full'): {path} is a directory; choose a file name")
                checkpoint.pop("optimizer_states", None)
                if self.is_global_zero:
                    self.checkpoint_io.save_checkpoint(checkpoint, path)
                self.barrier()
                return
            if path.is_file():
                raise ValueError(
                    f"ZeroStrategy: {path} is a file; sharded checkpoints are directories (remove it or pick another name)"
                )
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            optimizer = self._zero_optimizers() if self.optimizers else None
            self._zero_save_shards(path, self._zero_model("save_checkpoint"), optimizer, state)

        @override
        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
            path = self._zero_checkpoint_path(checkpoint_path)
            if path.is_file():  # a full checkpoint: weights (and loop state) only
                checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
                zs.load_full_state_dict(self._zero_model("load_checkpoint"), checkpoint["state_dict"])
                if self._zero_lightning_module("load_checkpoint").trainer.state.fn == trainer_fn.FITTING:
                    warnings.warn(
                        f"ZeroStrategy: {path} is a full (weights-only) checkpoint: the optimizer starts fresh. "
                        "Resume from a sharded checkpoint (state_dict_type='sharded') to continue exactly.",
                        UserWarning,
                        stacklevel=2,
                    )
                return checkpoint
            optimizer = self._zero_optimizers() if self.optimizers else None
            return self._zero_load_shards(path, self._zero_model("load_checkpoint"), optimizer, weights_only)

        @override
        def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
            pass  # load_checkpoint has loaded the weights

        @override
        def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
            pass  # load_checkpoint has loaded the optimizer shards

        @override
        def teardown(self) -> None:
            # the engine keeps the module's shards where they are (no move to CPU)
            if self.cluster_environment is not None:
                self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()
            self.checkpoint_io.teardown()  # full checkpoints go through it (sharded ones do not)

    prefix = "" if ns == "lightning.pytorch" else "PL"
    publish(prefix, {"ZeroStrategy": ZeroStrategy, "ZeroPrecision": ZeroPrecision})
    return ZeroStrategy, ZeroPrecision
