"""The rules between settings of a ``ZeroConfig``: each says which fields conflict, why, and what
to do. ``ZeroConfig`` runs them at construction (on the fields the user gave) and at
``initialize`` (on every field, with the world size): ``ZeroConfig.conflicts``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from zero_strategy.config.blocks import _DTYPE_NAMES, OffloadConfig, PrecisionConfig
from zero_strategy.config.comm import CompressionConfig, LoadBalanceConfig
from zero_strategy.config.memory import MemoryConfig

__all__ = ["Settings", "conflicts_of"]


class Settings(Protocol):
    """The fields the rules read (``ZeroConfig`` has them)."""

    @property
    def stage(self) -> int: ...
    @property
    def offload_param(self) -> OffloadConfig: ...
    @property
    def offload_optimizer(self) -> OffloadConfig: ...
    @property
    def load_balance(self) -> LoadBalanceConfig: ...
    @property
    def memory(self) -> MemoryConfig: ...
    @property
    def compression(self) -> CompressionConfig: ...
    @property
    def precision(self) -> PrecisionConfig: ...
    @property
    def zero_hpz_partition_size(self) -> int: ...
    @property
    def gather_dtype(self) -> torch.dtype | None: ...
    @property
    def zero_quantized_weights(self) -> bool: ...
    @property
    def zero_quantized_gradients(self) -> bool: ...
    @property
    def moe_expert_layout(self) -> str: ...
    @property
    def moe_expert_cache(self) -> int: ...


_ZO, _OWN = "zero_optimization", "zero_strategy"  # DeepSpeed's block and ours, as the messages name them


def conflicts_of(cfg: Settings, world_size: int | None, given: Callable[[str], bool]) -> list[str]:
    """The conflicts among settings that ``given`` accepts (each rule needs all its fields given)."""
    out: list[str] = []
    param, opt, lb = cfg.offload_param, cfg.offload_optimizer, cfg.load_balance

    def rule(applies: bool, *fields: str) -> bool:
        return applies and all(map(given, fields))

    if rule(param.enabled and cfg.stage != 3, "offload_param", "stage"):
        out.append(
            f"{_ZO}.offload_param needs stage 3 (got stage {cfg.stage}): at stages 1 and 2 every rank keeps the "
            "full parameters on the device. Use stage 3, or offload_optimizer only."
        )
    if rule(param.enabled and param.ratio not in (1.0, "auto"), "offload_param"):
        out.append(f"{_ZO}.offload_param.ratio takes only 'auto' (with zero_strategy.memory); remove it, or use "
                   "offload_optimizer.ratio")  # fmt: skip
    for name, block in (("offload_optimizer", opt), ("offload_param", param)):
        if rule(block.ratio == "auto" and (block.device != "cpu" or not cfg.memory.enabled), name):
            out.append(
                f"{_ZO}.{name}.ratio='auto' picks the smallest fraction whose device bytes fit the persistent tier "
                f"of {_OWN}.memory, with device 'cpu' (got device {block.device!r}, memory "
                f"{'set' if cfg.memory.enabled else 'not set'}); give memory: {{budget: ...}} and device: cpu, or a "
                "number as ratio"
            )
    if rule(param.device == opt.device == "nvme" and opt.ratio != 1.0, "offload_param", "offload_optimizer"):
        out.append(
            f"{_ZO}.offload_optimizer.ratio={opt.ratio} with offload_param on nvme: with both on disk the masters "
            "are views of the parameter rows, so the whole optimizer goes to disk; remove offload_optimizer.ratio, "
            "or offload the parameters to 'cpu'"
        )
    hpz = cfg.zero_hpz_partition_size
    if rule(hpz > 1 and cfg.stage != 3, "zero_hpz_partition_size", "stage"):
        out.append(
            f"{_ZO}.zero_hpz_partition_size needs stage 3 (got stage {cfg.stage}): it shards the parameters a "
            "second time for the backward, and at stages 1 and 2 every rank keeps them whole. Use stage 3, or remove it"
        )
    if rule(hpz > 1 and cfg.memory.enabled, "zero_hpz_partition_size", "memory"):
        out.append(
            f"{_ZO}.zero_hpz_partition_size with {_OWN}.memory is not supported yet: the budget does not count the "
            "secondary shards; remove one of them"
        )
    cheap = [n for n in ("gather_dtype", "zero_quantized_weights") if getattr(cfg, n) not in (None, False)]
    if rule(bool(cheap) and cfg.stage != 3, *cheap, "stage"):
        out.append(f"{' and '.join(cheap)} change ZeRO-3's parameter gathers and need stage 3 (got stage {cfg.stage}): "
                   "at stages 1 and 2 the full parameters are the model itself. Use stage 3, or remove them")  # fmt: skip
    if rule(len(cheap) == 2, *cheap):
        out.append("gather_dtype and zero_quantized_weights both set the parameter gathers' wire format; give one")
    low, wire = cfg.precision.param_dtype, cfg.gather_dtype
    if wire is not None and low is not None and rule(True, "gather_dtype", "precision"):
        out.append(f"gather_dtype={_DTYPE_NAMES[wire]} with 16-bit parameters "
                   f"(precision param_dtype={_DTYPE_NAMES[low]}): ZeRO-3 gathers those in {_DTYPE_NAMES[low]} "
                   "already; remove gather_dtype, or use a mixed precision ('bf16-mixed', '16-mixed')")  # fmt: skip
    if rule(cfg.compression.enabled and cfg.stage == 3, "compression", "stage"):
        out.append(
            "compression.type='topk' works at ZeRO stages 1 and 2: ZeRO-3 reduces each unit's gradients while its "
            "backward runs and keeps no full-size gradient to compensate. Use stage 2, or set compression: {type: none}"
        )
    if rule(cfg.compression.enabled and cfg.zero_quantized_gradients, "compression", "zero_quantized_gradients"):
        out.append(
            f"{_ZO}.zero_quantized_gradients with compression.type='topk': both set the gradients' wire format "
            "(int8 blocks of every value, or the top-k values); remove one of them"
        )
    if rule(cfg.compression.adam and opt.device == "nvme", "compression", "offload_optimizer"):
        out.append(
            "compression.optimizer: adam keeps Adam's moments in the optimizer's state, which offload_optimizer: "
            "{device: nvme} swaps out of reach; offload the optimizer to 'cpu', or use compression.optimizer: sgd"
        )
    if rule(cfg.moe_expert_layout == "owners" and cfg.moe_expert_cache > 0, "moe_expert_layout", "moe_expert_cache"):
        out.append(
            f"{_OWN}.moe_expert_cache={cfg.moe_expert_cache} with moe_expert_layout='owners': the experts' cache keeps "
            "rows of the sharded layout's union gathers; remove moe_expert_cache, or use moe_expert_layout 'sharded'"
        )
    if rule(cfg.memory.enabled and cfg.stage != 3, "memory", "stage"):
        out.append(
            f"{_OWN}.memory needs stage 3 (got stage {cfg.stage}): its cache holds ZeRO-3's gathered parameters, "
            "and at stages 1 and 2 every rank keeps full parameters anyway. Use stage 3, or remove memory"
        )
    for name, block in (("offload_optimizer", opt), ("offload_param", param)):
        if rule(lb.enabled and cfg.stage == 3 and block.device == "nvme", "load_balance", "stage", name):
            out.append(
                f"load_balance at stage 3 with {name}: {{device: nvme}} is not supported (ZeRO-3's swap files are "
                f"laid out for even shards); offload to the CPU ({name}: {{device: cpu}}), use stage 1 or 2, or "
                "remove load_balance"
            )
    if lb.scores is not None and world_size is not None and len(lb.scores) != world_size:
        out.append(
            f"load_balance.scores has {len(lb.scores)} entries for {world_size} ranks; give one score per rank (in "
            "rank order), or measure them with {preset: compute}"
        )
    return out
