"""Lightning's ``DeepSpeedStrategy`` keyword arguments on ``ZeroStrategy``, so that a Trainer
written for ``DeepSpeedStrategy(stage=3, offload_optimizer=True, allgather_bucket_size=...)``
switches by changing the class name. No Lightning import here.

Each argument is one of three kinds:

- **mapped**: it means the same thing here and becomes a config field (``overlap_comm``, the
  bucket sizes, the offload switches with their device, path and buffer arguments, the fp16
  loss-scale arguments, ``logging_level`` for the ``zero_strategy`` logger). It meets a config
  file as the strategy's ``stage`` does: a value the file sets differently raises, naming both
  (a block the file sets, ``fp16`` or an offload block, is compared whole, its unwritten fields
  at their defaults). Unlike ``DeepSpeedStrategy``, a ``config`` does not silence the arguments;
- **handled elsewhere**: ``accelerator``, ``parallel_devices``, ``cluster_environment``,
  ``precision_plugin``, ``process_group_backend``, ``timeout``, ``config``, ``stage``, and
  ``load_full_weights`` (a full-weights file is recognised as a file, whatever the flag says);
- **without a meaning here**: DeepSpeed's activation checkpointing, asynchronous-I/O tuning,
  throughput logging, its optimizer allow-list, where ``zero.Init`` first places parameters and
  leaving frozen parameters out of checkpoints. None of these changes the numbers; a value other
  than DeepSpeed's default is named in one ``UserWarning``.

``None`` means "not given" for every argument (DeepSpeed's own defaults then do not apply: the
config file's or zero_strategy's do). ``zero_optimization=False``, DeepSpeed without ZeRO, is
refused: that is ``strategy="ddp"``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Mapping
from typing import Any

from zero_strategy import ZeroConfig, resolve_overrides
from zero_strategy.config import OffloadConfig

__all__ = ["DEEPSPEED_ARGUMENTS", "apply_deepspeed_arguments"]

# ZeroConfig fields of the same name
_FIELDS = (
    "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
    "allgather_bucket_size", "reduce_bucket_size", "sub_group_size",
)  # fmt: skip
# fp16's loss scaler (ZeroConfig.loss_scale's fields of the same name)
_LOSS_SCALE = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
# switch -> (ZeroConfig field, {argument: OffloadConfig field}); nvme_path and pin_memory serve both
_OFFLOAD = {
    "offload_optimizer": ("offload_optimizer", {"offload_optimizer_device": "device", "nvme_path": "nvme_path",
                                                "optimizer_buffer_count": "buffer_count", "pin_memory": "pin_memory"}),
    "offload_parameters": ("offload_param", {"offload_params_device": "device", "nvme_path": "nvme_path",
                                             "params_buffer_count": "buffer_count", "params_buffer_size": "buffer_size",
                                             "max_in_cpu": "max_in_cpu", "pin_memory": "pin_memory"}),
}  # fmt: skip
# argument -> (values that ask for nothing, what DeepSpeed does with it)
_WITHOUT_MEANING: dict[str, tuple[tuple[Any, ...], str]] = {
    "remote_device": ((None,), "where deepspeed.zero.Init first puts the parameters; here configure_model builds "
                               "on the strategy's device under sharded_init and each rank keeps only its shards"),
    "block_size": ((None,), "asynchronous NVMe I/O tuning"),
    "queue_depth": ((None,), "asynchronous NVMe I/O tuning"),
    "single_submit": ((None, False), "asynchronous NVMe I/O tuning"),
    "overlap_events": ((None, True), "asynchronous NVMe I/O tuning"),
    "thread_count": ((None, 1), "asynchronous NVMe I/O tuning"),
    "zero_allow_untested_optimizer": ((None, True), "DeepSpeed's optimizer allow-list; here every torch optimizer "
                                                    "runs (an unknown one gets UnknownOptimizerWarning)"),
    "logging_batch_size_per_gpu": ((None, "auto"), "DeepSpeed's throughput log"),
    "partition_activations": ((None, False), "DeepSpeed's activation checkpointing"),
    "cpu_checkpointing": ((None, False), "DeepSpeed's activation checkpointing"),
    "contiguous_memory_optimization": ((None, False), "DeepSpeed's activation checkpointing"),
    "synchronize_checkpoint_boundary": ((None, False), "DeepSpeed's activation checkpointing"),
    "exclude_frozen_parameters": ((None, False), "frozen parameters are saved in the shards here"),
}  # fmt: skip

# Every DeepSpeedStrategy argument ZeroStrategy takes beyond its own (stage, config, the
# Lightning plumbing): what ``apply_deepspeed_arguments`` reads.
DEEPSPEED_ARGUMENTS: tuple[str, ...] = tuple(
    dict.fromkeys(
        ["zero_optimization", *_FIELDS, *_LOSS_SCALE, "logging_level", "load_full_weights", *_OFFLOAD,
         *(arg for _, subs in _OFFLOAD.values() for arg in subs), *_WITHOUT_MEANING]
    )
)  # fmt: skip


def apply_deepspeed_arguments(cfg: ZeroConfig, args: Mapping[str, Any], caller: str) -> ZeroConfig:
    """``cfg`` with the mapped arguments of ``args`` (names in ``DEEPSPEED_ARGUMENTS``; None: not
    given) applied; a value the config sets differently raises. Warns once, naming the arguments
    given a value that means nothing here; sets the ``zero_strategy`` logger's level."""
    unknown = sorted(set(args) - set(DEEPSPEED_ARGUMENTS))
    if unknown:
        raise TypeError(f"apply_deepspeed_arguments: {unknown} are not DeepSpeedStrategy arguments")
    given = {k: v for k, v in args.items() if v is not None}
    if given.get("zero_optimization") is False:
        raise ValueError(
            f'{caller}(zero_optimization=False) is data parallelism without ZeRO: use strategy="ddp" for it, '
            "or leave the argument out"
        )
    for name in _FIELDS:
        if name in given:
            cfg = resolve_overrides(cfg, source=f"{caller}({name}={given[name]!r})", **{name: given[name]})
    scale = {k: given[k] for k in _LOSS_SCALE if k in given}
    if scale:
        merged = dataclasses.replace(cfg.loss_scale, **scale)
        cfg = resolve_overrides(cfg, source=f"{caller}({_show(scale)})", loss_scale=merged)
    ignored = [f"{k}={given[k]!r} ({why})" for k, (neutral, why) in _WITHOUT_MEANING.items()
               if k in given and given[k] not in neutral]  # fmt: skip
    cfg, unused = _offload(cfg, given, caller)
    ignored += unused
    if "logging_level" in given:
        logging.getLogger("zero_strategy").setLevel(given["logging_level"])
    if ignored:
        warnings.warn(
            f"{caller}: these DeepSpeedStrategy arguments mean nothing to zero_strategy and are ignored: "
            + "; ".join(ignored),
            UserWarning,
            stacklevel=4,
        )
    return cfg


def _offload(cfg: ZeroConfig, given: Mapping[str, Any], caller: str) -> tuple[ZeroConfig, list[str]]:
    """The offload switches with their sub-arguments; sub-arguments without a switch set to True
    are returned for the warning (DeepSpeed drops them silently)."""
    used: set[str] = set()
    for switch, (field, subs) in _OFFLOAD.items():
        on = given.get(switch)
        if on is None:
            continue
        values = {sub: given[arg] for arg, sub in subs.items() if arg in given} if on else {}
        current: OffloadConfig = getattr(cfg, field)
        base = current if on and current.enabled else OffloadConfig(device="cpu" if on else "none")
        merged = dataclasses.replace(base, **values)
        shown = {switch: on, **{arg: given[arg] for arg in subs if arg in given and on}}
        cfg = resolve_overrides(cfg, source=f"{caller}({_show(shown)})", **{field: merged})
        if on:
            used.update(subs)
    unused: list[str] = []
    for _, subs in _OFFLOAD.values():
        for arg in subs:
            if arg in given and arg not in used and f"{arg}=" not in " ".join(unused):
                needs = " or ".join(s for s, (_, sub) in _OFFLOAD.items() if arg in sub)
                unused.append(f"{arg}={given[arg]!r} (without {needs}=True)")
    return cfg, unused


def _show(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())
