"""What an engine reads and writes of its model as a whole, outside the training step: full
weights copied into this rank's parameters, ZeRO-3 rows and masters, the bytes it holds by
kind and by tier, and which piece of a parameter this rank holds. A base class of
``ZeroEngine``, kept apart so that ``engine.py`` holds the lifecycle; it reads only the
attributes declared on it.

The engine holds its model weakly (:attr:`WholeModelState.module`): the model owns the engine
(``model._zero_engine``), so a strong pointer back would make a reference cycle, and a dropped
model would wait for Python's cyclic collector (see ``engine.py``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.offload.disk_tier import DiskTier
from zero_strategy.reduction.grads import GradReducer
from zero_strategy.runtime.budget import Budget, cache_stats
from zero_strategy.runtime.optimizer_set import OptimizerSet
from zero_strategy.runtime.whole_params import WholeParams
from zero_strategy.runtime.zero3 import UnitScheduler
from zero_strategy.sharding.group import ShardGroup
from zero_strategy.sharding.memory import model_state_bytes
from zero_strategy.sharding.precision import LossScaler
from zero_strategy.sharding.setup_checks import persistent_buffers
from zero_strategy.sharding.unit import ParamStorage, ShardedParams
from zero_strategy.storage.host_memory import HostPeak

__all__ = ["StepCalls", "SyncState", "WholeModelState"]


@dataclass
class StepCalls:
    """The optimizer step's progress, between ``step()``'s pre- and post-hooks and across steps."""

    # step() calls in progress: torch fires the step hooks again when a subclass's step calls
    # super().step(); the engine acts when the depth goes 0 -> 1 and 1 -> 0 only
    depth: int = 0
    internal: bool = False  # the engine itself steps the optimizer (the disk tier): hooks stand aside
    skip: bool = False  # fp16 overflow: this step is skipped
    last_skipped: bool = False  # whether the last step was skipped (fp16 overflow)
    loss_scaled: bool = False  # fp16: was a scaled loss backpropagated in this window?
    clipped: set[int] = field(default_factory=set)  # clipped since the last step: optimizer_set.key, 0: all
    stepped: set[int] = field(default_factory=set)  # optimizers that stepped (key()): their state exists
    # master gradients set aside while the disk tier or the host step runs the optimizer itself
    stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    scratch_budget: int | None = None  # communication buffers kept between steps (bytes), once measured


@dataclass
class SyncState:
    """When gradients reduce, DDP's rules: ``enabled`` is False inside ``no_sync()``; ``backward``,
    whether the next backward reduces, is decided when the forward runs (a grad-enabled forward
    outside ``no_sync()`` sets it, a backward that reduced clears it); ``buffers_next``: the next
    forward broadcasts the buffers; ``root_depth``: nesting of calls of the root module (only the
    outermost one acts)."""

    enabled: bool = True
    backward: bool = False
    buffers_next: bool = True
    root_depth: int = 0


class WholeModelState:
    """``load_full_state_dict``, ``memory_stats`` and the progress state of the engine."""

    _module_ref: weakref.ref[nn.Module]
    _names: dict[int, str]
    _master: dict[int, torch.Tensor]
    params: ParamStorage
    groups: list[ShardGroup]
    opts: OptimizerSet
    disk: DiskTier
    ctx: C.CommContext
    reducer: GradReducer
    zero3: UnitScheduler | None
    budget: Budget | None
    init_peak: HostPeak
    step_count: int
    scaler: LossScaler
    whole: WholeParams

    @property
    def has_model(self) -> bool:
        """Whether the model is still alive (held weakly: see :attr:`module`)."""
        return self._module_ref() is not None

    @property
    def module(self) -> nn.Module:
        """The model, held weakly: it owns the engine, not the other way round."""
        module = self._module_ref()
        if module is None:
            raise RuntimeError(
                "this zero_strategy engine's model was dropped (the model owns its engine, which holds it "
                "weakly); keep a reference to the model for as long as its engine or optimizer is used"
            )
        return module

    def load_full_state_dict(self, get: Callable[[str], torch.Tensor], keys: list[str], *, strict: bool) -> None:
        """Copy full tensors into this rank's parameters, rows and masters, one at a time (a
        ZeRO-3 unit that is gathered, a persistent one say, is freed: its next use gathers the
        new values). Expects what ``state_dict()`` holds: non-persistent buffers are left alone,
        and a tied parameter may come under one of its names (``save_pretrained`` writes it once)."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = persistent_buffers(self.module)
        expected = set(params) | set(buffers)
        given = {id(params[k]) for k in keys if k in params}  # a tied weight saved under one of its names
        missing = sorted(k for k in expected - set(keys) if k not in params or id(params[k]) not in given)
        unexpected = sorted(set(keys) - expected)
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_full_state_dict(): the weights do not match the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; "
                "load weights of the same architecture or pass strict=False"
            )
        with torch.no_grad(), self.params.loading():
            for key in keys:
                if key not in expected:
                    continue
                t = get(key)
                target = params[key] if key in params else buffers[key]
                if tuple(t.shape) != tuple(target.shape):
                    raise ValueError(
                        f"load_full_state_dict(): '{key}' has shape {tuple(t.shape)} in the weights but "
                        f"{tuple(target.shape)} in the model"
                    )
                if key in params:
                    self.params.load_full(target, t)
                else:
                    target.copy_(t)

    def memory_stats(self) -> dict[str, int]:
        """Bytes held by this rank, by kind: full parameters (at ZeRO-3 only while gathered),
        ZeRO-3 parameter rows (the persistent shards), gradient shards, fp32 masters that are
        not views (and the whole matrices this rank owns for a Muon-like optimizer, also as
        ``whole_masters``), optimizer state of the master pieces, any full gradients still in
        ``p.grad``; then the working communication buffers (now and at peak) and, at ZeRO-3,
        the gathered parameters now and at peak, the gathers issued and their bytes, the cache
        tier's bytes and counters and, with ``zero_strategy.memory``, each tier's budget
        (``budget.py``; the keys are listed in docs/memory_budget.md).

        The same model-state bytes are also counted by memory tier (``memory.py``); the disk
        tier's buffers are ``swap_buffers``."""
        sharded = self.params if isinstance(self.params, ShardedParams) else None
        out = model_state_bytes(
            [p for _, p in self.module.named_parameters(remove_duplicate=True)],
            sharded.units if sharded is not None else [],
            self.groups,
            self.opts.optimizers,
            self.disk.disk_bytes(),
            self.ctx.device,
            self.reducer.compression.tensors() if self.reducer.compression is not None else (),
            [(e.proxy, e.group.tier) for e in self.whole.owned()],  # whole matrices on their owner
        )
        out["swap_buffers"] = self.disk.buffer_bytes()
        out["comm_scratch"] = self.ctx.pool.allocated  # working buffers, reused across steps
        out["comm_scratch_peak"] = self.ctx.pool.peak
        out["initialize_host_peak"] = self.init_peak.peak  # anonymous host bytes initialize took at most
        if sharded is not None and self.zero3 is not None:
            meter = sharded.meter
            out |= {"gathered": meter.live, "gathered_peak": meter.peak, "gathers": meter.gathers,
                    "gathered_bytes": meter.gathered_bytes} | cache_stats(self.zero3.cache, self.budget, sharded.units)  # fmt: skip
            out |= self.zero3.moe.entries()  # MoE experts units (sharding/experts/selective.py)
        return out

    def _step_label(self) -> str:
        return f"step {self.step_count}"

    def steps_done(self) -> int:
        return self.step_count

    # -- queries ---------------------------------------------------------------------------
    def param_names(self) -> dict[int, str]:
        return self._names

    def master_of(self, p: torch.Tensor) -> torch.Tensor | None:
        return self._master.get(id(p))

    def host_masters(self) -> set[int]:
        """The ids of the master pieces the offload policy put in host memory."""
        return {id(m) for g in self.groups if g.tier == "host" for m in g.masters}

    def flat_value(self, p: torch.Tensor) -> torch.Tensor:
        """What this rank holds of a parameter without a master (frozen), flattened."""
        return self.params.flat_value(p)

    def flat_offset(self, p: torch.Tensor) -> int | None:
        """Where :meth:`flat_value` starts, when not where ``torch.chunk`` puts it (uneven)."""
        return self.params.flat_offset(p)

    def progress_state(self) -> dict[str, torch.Tensor]:
        """The engine's own training progress, as tensors a checkpoint saves beside the shards."""
        return {
            "engine.step_count": torch.tensor(self.step_count, dtype=torch.int64),
            "engine.loss_scale": torch.tensor(self.scaler.scale, dtype=torch.float64),
            "engine.loss_scaler_counters": self.scaler.counters(),
        }

    def load_progress(self, state: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`progress_state` (the counters may be missing: an older checkpoint)
        after the masters were loaded; the parameters follow the loaded masters."""
        self.step_count = int(state["engine.step_count"])
        self.opts.restart_round()
        if self.zero3 is not None:
            self.zero3.step = self._step_label()
        if self.scaler.enabled:
            self.scaler.scale = float(state["engine.loss_scale"])
            if "engine.loss_scaler_counters" in state:
                self.scaler.load_counters(state["engine.loss_scaler_counters"])
        self.params.after_step(f"load ({self._step_label()})")
