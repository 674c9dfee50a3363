"""Freeing the device between phases: ``offload_states(model)`` / ``reload_states(model)``
(DeepSpeed's names), for RLHF loops that hand the GPU to a generation engine between training
steps.

``offload_states`` copies this rank's model state to the host and frees it on the device; the
tensors themselves stay where they are, each with an empty storage, so every view of them (a
master that is a view of its row, a gradient that is a view of its shard, the optimizer's
state keyed by its master) is whole again once ``reload_states`` gives each storage its size and
bytes back. The round trip is exact: the same bits, the same tensors, so a step after it equals
a step without it.

What moves is chosen by DeepSpeed's ``OffloadStateTypeEnum`` names (``include``, default all):

- ``optim_states``: the optimizer state (Adam's moments, ...);
- ``hp_params``: the fp32 masters (the optimizer's own parameters);
- ``lp_params``: the parameters the model computes with: ZeRO-3's rows (persistent shards) and
  the units kept gathered, ZeRO-1/2's full parameters;
- ``lp_grads``: gradient shards and full gradients still in ``p.grad``;
- ``contiguous_grad_buffer``: the communication scratch buffers, which are simply dropped
  (they are working memory, rebuilt on the next use).

Tensors already on the host (``offload_optimizer``/``offload_param`` to ``cpu``) or on disk
stay put. On a CPU-only process the "device" is the host: the storages are still copied out and
emptied, so the round trip's bookkeeping is exercised, but no memory is saved.

Between the two calls the model and its optimizers must not be used: a forward or an
``optimizer.step()`` raises, naming ``reload_states`` (``ZeroModule.__call__`` and the step's
checks in ``optimizer.py`` read ``engine.phase_offloaded``). Both calls are local (no collective): each
rank frees its own device; call them on every rank at the same point anyway, since the next
forward communicates.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero_strategy.runtime.module import get_engine
from zero_strategy.sharding.pieces import is_placeholder

__all__ = ["OFFLOAD_STATE_TYPES", "offload_states", "reload_states"]

OFFLOAD_STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


@dataclass
class _Offloaded:
    """The storages emptied by one ``offload_states`` and their bytes on the host."""

    storages: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.storages)


def _kinds(include: Iterable[str] | None) -> tuple[str, ...]:
    if include is None:
        return OFFLOAD_STATE_TYPES
    kinds = tuple(str(getattr(k, "value", k)) for k in include)  # DeepSpeed's enum members or their names
    unknown = [k for k in kinds if k not in OFFLOAD_STATE_TYPES]
    if unknown:
        raise ValueError(
            f"offload_states(include={unknown}): use names among {list(OFFLOAD_STATE_TYPES)} (or None: all)"
        )
    return kinds


def _state_tensors(engine: Any, kinds: Sequence[str]) -> Iterator[torch.Tensor]:
    """The engine's tensors of ``kinds`` (views and repeats included: storages are deduplicated later)."""
    units = getattr(engine.params, "units", [])
    if "lp_params" in kinds:
        for u in units:
            u.settle()  # an upload after the host step may still be writing the row (host_step.py)
            yield from (t for t in (u.row, u.frozen_row) if t is not None)
        yield from (p for _, p in engine.module.named_parameters(remove_duplicate=True))
    if "lp_grads" in kinds:
        for g in engine.groups:
            if g.grad_shard_if_allocated is not None:
                yield g.grad_shard_if_allocated
        yield from (p.grad for p in engine.module.parameters() if p.grad is not None)
    if "hp_params" in kinds:
        for g in engine.groups:
            yield from g.masters
    if "optim_states" in kinds:
        for opt in engine.opts.optimizers:
            for st in opt.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def offload_states(
    model: nn.Module,
    include: Iterable[str] | None = None,
    *,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> int:
    """Copy this rank's model state of the kinds in ``include`` (default: all, see the module
    docstring) to the host and free it where it was. Returns the bytes moved. ``pin_memory``:
    page-locked host copies (CUDA only); ``non_blocking``: copies not waited for here (the
    device memory is released only once they have run, in stream order)."""
    engine = get_engine(model)
    engine._expect_idle("offload_states()", "call it between steps, after optimizer.step() and zero_grad()")
    if engine.phase_offloaded is not None:
        raise RuntimeError("offload_states(): the states are offloaded already; call reload_states(model) first")
    kinds = _kinds(include)
    on_device_only = engine.ctx.device.type != "cpu"
    done = _Offloaded()
    seen: set[int] = set()
    with torch.no_grad():
        for t in _state_tensors(engine, kinds):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in seen or is_placeholder(t) or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            if on_device_only and t.device.type == "cpu":
                continue  # already on the host (an offload tier): stays
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin_memory and t.device.type == "cuda")
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host.copy_(src, non_blocking=non_blocking)
            done.storages.append((storage, host))
        if "contiguous_grad_buffer" in kinds:
            engine.ctx.pool.trim(0)
        for storage, _ in done.storages:  # all copies issued before any storage is freed
            storage.resize_(0)
    engine.phase_offloaded = done
    return done.nbytes


def reload_states(model: nn.Module, *, non_blocking: bool = False) -> int:
    """Give back what :func:`offload_states` moved: each storage its size and bytes, where it
    was. Returns the bytes moved; 0 when nothing is offloaded."""
    engine = get_engine(model)
    done: _Offloaded | None = engine.phase_offloaded
    if done is None:
        return 0
    with torch.no_grad():
        for storage, host in done.storages:
            storage.resize_(host.numel())
            dst = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            dst.copy_(host, non_blocking=non_blocking)
    if non_blocking and engine.ctx.device.type == "cuda":
        torch.cuda.current_stream(engine.ctx.device).synchronize()  # the host copies are dropped next
    engine.phase_offloaded = None
    return done.nbytes
