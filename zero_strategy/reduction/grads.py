"""Gradient reduction: full local gradients in, averaged gradient shards out.

The mechanism is one :class:`GradReducer`; *when* it reduces is a schedule chosen by type:

- :class:`ReduceAtStep` (ZeRO-1): full gradients stay in ``p.grad`` through backward and
  accumulation; everything is reduce-scattered once, when the optimizer step needs it. Each
  bucket's full gradients are freed as soon as it has been reduced.
- :class:`ReduceInBackward` (ZeRO-2): a post-accumulate-grad hook marks parameters ready; a
  group is reduce-scattered as soon as it and every group before it are ready (always in
  group order, so every rank issues the same collectives in the same order), and its full
  gradients are freed at once. Inside ``no_sync`` nothing is reduced. At the end of backward
  the remaining groups are reduced in order, with zeros for parameters that got no gradient.

At the optimizer step, :meth:`GradReducer.finalize` waits for what is in flight and does one
small all-reduce (MAX) of per-parameter flags: "has a gradient this rank has not reduced yet"
(a late gradient, e.g. from a reentrant checkpoint that re-ran a parameter after its group
was reduced) and "had any gradient in this accumulation window". Groups with a pending
gradient anywhere are reduced again (with zeros elsewhere). A parameter that had no gradient
on any rank ends with ``master.grad = None``, so the optimizer skips it as DDP does.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.reduction import host_copies
from zero_strategy.reduction.compression import ErrorFeedback, SparseExchange
from zero_strategy.reduction.quantized import EXACT, Exchange, GradCodec
from zero_strategy.sharding.group import ReducePlan, ShardGroup
from zero_strategy.storage.uploads import to_device

__all__ = [
    "AllReduceAtEnd",
    "GradReducer",
    "GradSchedule",
    "ReduceAtStep",
    "ReduceAtUnitEnd",
    "ReduceInBackward",
]


@dataclass(frozen=True)
class GradSchedule:
    """When gradients are reduced: a small frozen policy, chosen by type. The engine owns the
    hooks; it registers post-accumulate-grad hooks only for a schedule that
    ``reduces_when_ready``, and calls :meth:`end_of_backward` from its end-of-backward callback."""

    reduces_when_ready: ClassVar[bool] = False  # reduce each group as soon as its gradients are ready
    full_grads: ClassVar[bool] = False  # p.grad holds DDP's full averaged gradient (no sharded state)

    def end_of_backward(self, reducer: GradReducer, *, sync: bool) -> None:
        """A synchronising backward reduces what is left, in group order, and waits."""
        if sync:
            reducer.end_of_backward()


@dataclass(frozen=True)
class ReduceAtStep(GradSchedule):
    """ZeRO-1: nothing happens in backward; :meth:`GradReducer.finalize` reduces everything at
    the step."""

    def end_of_backward(self, reducer: GradReducer, *, sync: bool) -> None:
        return None


@dataclass(frozen=True)
class ReduceInBackward(GradSchedule):
    """ZeRO-2: post-accumulate-grad hooks launch each group as soon as it and every group
    before it are ready; the end of backward launches the rest."""

    reduces_when_ready: ClassVar[bool] = True


@dataclass(frozen=True)
class ReduceAtUnitEnd(GradSchedule):
    """ZeRO-3: a unit's gradients are reduced when the next unit's backward starts (a point
    every rank reaches in the same order, see ``zero3.py``), the rest at the end of backward."""


@dataclass(frozen=True)
class AllReduceAtEnd(GradSchedule):
    """ZeRO-1/2 without an optimizer (``initialize(model, None)``): there is no sharded state to
    reduce into, so a synchronising backward ends, as DDP's does, with every ``p.grad`` holding
    the full gradient averaged over the ranks (bucketed all-reduces, in group order)."""

    full_grads: ClassVar[bool] = True

    def end_of_backward(self, reducer: GradReducer, *, sync: bool) -> None:
        if sync:
            reducer.all_reduce_full()


def _narrow(g: ShardGroup) -> bool:
    """Whether ``g`` is reduced in a 16-bit dtype (``communication_data_type``): then it is divided
    by the world size before the sum, as DDP's ``fp16_compress_hook`` does, not after."""
    return g.reduce_dtype in (torch.float16, torch.bfloat16) and g.master_dtype != g.reduce_dtype


@dataclass
class _InFlight:
    group: ShardGroup
    handle: C.Handle
    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    sparse: SparseExchange | None = None  # top-k compression's exchange instead of a reduce-scatter
    rows: ReducePlan | None = None  # an MoE experts unit's selected rows only (sharding/experts/selective.py)
    coded: Exchange | None = None  # the codec's exchange (quantized.py: qgZ's int8 all-to-all)


class DeferredCheck(Protocol):
    """A check whose outcome is read with the gradient flags (ZeRO-3's ``GatherChecks``)."""

    def flag(self) -> torch.Tensor | None: ...

    def report(self, failed: bool) -> None: ...


class GradReducer:
    def __init__(
        self,
        groups: Sequence[ShardGroup],
        ctx: C.CommContext,
        *,
        max_in_flight: int,
        grad_factor: Callable[[], float],
        describe_step: Callable[[], str],
        compression: ErrorFeedback | None = None,
        replica: C.CommContext | None = None,
        world: C.CommContext | None = None,
        codec: GradCodec = EXACT,
    ) -> None:
        self.groups = list(groups)
        self.codec = codec  # the sharded reductions' wire format (quantized.py)
        self.compression = compression  # top-k with error feedback (compression.py), or None
        self._warned_dense = False
        self.ctx = ctx
        # shard groups (runtime/shard_groups.py): each shard is all-reduced across ``replica`` after
        # its reduce-scatter in ``ctx``; flags that every rank must agree on go over ``world``
        self.replica = replica if replica is not None else C.solo_context(ctx)
        self.world = world if world is not None else ctx
        self.max_in_flight = max_in_flight  # reductions left running while backward goes on
        self._grad_factor = grad_factor
        self._describe_step = describe_step
        self._where: dict[int, tuple[ShardGroup, int, int]] = {}  # id(param) -> (group, i, flat index)
        flat = 0
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._where[id(p)] = (g, i, flat)
                flat += 1
        self.num_params = flat
        # "had a gradient in this window" per parameter: host bytes, never a device tensor written element-wise
        self._used = bytearray(flat)
        # ZeRO-3's deferred gather checks: their flag travels with the gradient flags
        self.deferred_check: DeferredCheck | None = None
        self._ready: list[int] = []
        self._launched: list[bool] = []
        self._next = 0
        self._forget_backward()
        self._in_flight: deque[_InFlight] = deque()
        # offloaded shards reach the host without a blocking copy per bucket (CUDA: host_copies.py)
        copier = host_copies.choose(ctx.device)
        self.host_copies = host_copies.HostCopies(copier) if copier is not None else None

    # -- bookkeeping ---------------------------------------------------------------------
    def locate(self, p: torch.Tensor) -> tuple[ShardGroup, int]:
        g, i, _ = self._where[id(p)]
        return g, i

    def manages(self, p: torch.Tensor) -> bool:
        return id(p) in self._where

    def on_grad_ready(self, p: nn.Parameter, *, sync: bool) -> None:
        """Called from a post-accumulate-grad hook (ZeRO-2)."""
        g, _, flat = self._where[id(p)]
        self._used[flat] = 1
        if not sync or self._launched[g.index]:
            return  # accumulate locally, or a late gradient: finalize() reduces it
        self._ready[g.index] += 1
        while self._next < len(self.groups) and self._ready[self._next] >= len(self.groups[self._next].params):
            self._launch(self.groups[self._next])
            self._next += 1

    def launch(self, g: ShardGroup) -> None:
        """Reduce ``g`` now unless it was reduced in this backward already (ZeRO-3)."""
        if not self._launched[g.index]:
            self._launch(g)

    def end_of_backward(self) -> None:
        """Reduce the groups not launched yet, in group order, then wait for all."""
        for g in self.groups:
            if not self._launched[g.index]:
                self._launch(g)
        self.wait_all()
        self._forget_backward()

    def _forget_backward(self) -> None:
        """No group is ready or launched: a new backward (or reduction at the step) starts."""
        self._ready = [0] * len(self.groups)
        self._launched = [False] * len(self.groups)
        self._next = 0

    def wait_all(self) -> None:
        if self.compression is not None and self.compression.held:  # local clipping: launch what it held
            describe = self._describe_step()
            for g, exchange in self.compression.release(
                self._grad_factor(), lambda g: f"gradients of {g.name} ({describe})"
            ):
                self._in_flight.append(_InFlight(g, exchange.handle, sparse=exchange))
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        if self.host_copies is not None:
            self.host_copies.drain()

    # -- reduction -----------------------------------------------------------------------
    def _launch(self, g: ShardGroup) -> None:
        self._launched[g.index] = True
        lay, n = g.layout, self.ctx.world_size
        fb = self.compression if self.compression is not None and self.compression.active() else None
        # an MoE experts unit reduces the union of the selected experts' rows only
        rows = g.experts.reduce_plan() if g.experts is not None and fb is None else None
        width = lay.shard_numel if rows is None else rows.width
        size = n * width if rows is None else rows.send_numel
        inp = self.ctx.pool.get(size, g.reduce_dtype if fb is None else g.master_dtype, g.device)
        # compact expert gathers hold their gradients outside p.grad (sharding/experts/compact.py)
        held = rows.grads if rows is not None else g.experts.full_grads() if g.experts is not None else None
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(g.params):
            grad = p.grad if held is None else held[i]
            if grad is not None:
                self._used[self._where[id(p)][2]] = 1
                grads.append(grad.reshape(-1))
            else:
                grads.append(None)
        if rows is None:
            lay.pack_full(grads, inp)
        else:
            rows.pack(grads, inp)
        if _narrow(g) and fb is None:  # as DDP's compress hooks: divided before the 16-bit sum (no overflow)
            inp.div_(self.world.world_size)
        for p in g.params:
            p.grad = None  # the full gradient is not kept once it is in the bucket
        while self._in_flight and len(self._in_flight) >= max(self.max_in_flight, 1):  # bounded scratch
            self._complete(self._in_flight.popleft())
        what = f"gradients of {g.name} ({self._describe_step()})"
        if fb is not None and fb.config.local_clip is not None:  # held for the local norm (wait_all)
            fb.hold(g, inp, [i for i, x in enumerate(grads) if x is None])
            return
        if fb is not None:
            skip = [i for i, x in enumerate(grads) if x is None]
            exchange = fb.launch(g, inp, self._grad_factor(), skip, what)
            self.ctx.pool.put(inp)  # added into the residual already
            self._in_flight.append(_InFlight(g, exchange.handle, sparse=exchange))
        else:
            if rows is None:  # a reduce-scatter, or qgZ's int8 all-to-all (quantized.py)
                coded = self.codec.launch(self.ctx, inp, width, what=what)
                self._in_flight.append(_InFlight(g, coded.handle, inp, coded.got, coded=coded))
            else:  # the selected experts' rows: a reduce-scatter, or to their owners (experts/owners.py)
                out, handle = rows.exchange(self.ctx, inp, what)
                self._in_flight.append(_InFlight(g, handle, inp, out, rows=rows))
        if self.max_in_flight == 0:
            self.wait_all()

    def _complete(self, f: _InFlight) -> None:
        g = f.group
        if f.sparse is not None:  # averaged and unscaled by the sender already
            scratch = f.sparse.finish()
            out = scratch if g.master_device == scratch.device else scratch.to(g.master_device)
        else:
            f.handle.wait()
            if f.inp is None or f.out is None:
                raise AssertionError(f"rank {self.ctx.rank}: a reduction of {g.name} lost its buffers")
            if f.out is not f.inp:  # one rank: the reduction's output is its input (put back once, below)
                self.ctx.pool.put(f.inp)
            if f.coded is not None:
                scratch = self.codec.combine(self.ctx, f.coded, g.layout.shard_numel, g.reduce_dtype)
            else:
                scratch = f.out if f.rows is None else f.rows.combine(self.ctx, f.out)
            if self.replica.distributed:  # shard groups: the same shard of every group, summed
                C.all_reduce(self.replica, scratch, what=f"{f.handle.what} across shard groups").wait()
            host = self.host_copies if f.rows is None else None
            to_host = host is not None and host.handles(g, scratch)
            if _narrow(g):  # divided by the world size already; the loss scale comes off in the master dtype
                out = scratch.to(dtype=g.master_dtype)
                if not to_host and g.master_device != out.device:
                    out = out.to(g.master_device)
                rest = self._grad_factor() * self.world.world_size
                if rest != 1.0:
                    out.mul_(rest)
            elif (
                f.rows is None and not to_host and scratch.dtype == g.master_dtype and g.master_device == scratch.device
            ):
                self._into_shard(g, scratch, self._grad_factor())
                self.ctx.pool.put(scratch)
                return
            else:
                scratch.mul_(self._grad_factor())
                # offloaded (g.tier "host"): a blocking copy without host_copies (docs/advanced.md)
                out = scratch if to_host or g.master_device == scratch.device else scratch.to(g.master_device)
            if to_host and host is not None:  # queued behind the bucket's kernels: no host block (host_copies.py)
                host.start(g, out)
                self.ctx.pool.put(scratch)
                return
        if self.host_copies is not None and self.host_copies.pending:
            self.host_copies.drain()  # the shards below are read on the host
        if f.rows is not None:  # the selected rows; the others stay (or become) zeros
            f.rows.add_into(g.layout, g.grad_shard, out, self.ctx.rank, fresh=not g.grad_valid)
            g.grad_valid = True
        else:
            self._into_shard(g, out, 1.0)  # scaled already
        self.ctx.pool.put(scratch)

    def _into_shard(self, g: ShardGroup, reduced: torch.Tensor, factor: float) -> None:
        """``reduced`` times ``factor`` into ``g``'s gradient shard on its device: one pass when
        the window's first (written scaled), none for a factor of exactly 1."""
        if self.host_copies is not None and self.host_copies.pending:
            self.host_copies.drain()
        shard = g.grad_shard
        if g.grad_valid:
            shard.add_(reduced.mul_(factor) if factor != 1.0 else reduced)
        elif factor != 1.0:
            torch.mul(reduced, factor, out=shard)
        else:
            shard.copy_(reduced)
        g.grad_valid = True

    def finalize(self) -> list[bool]:
        """Reduce whatever is still pending on any rank; return the per-parameter "used on
        some rank" mask (bool, in group order)."""
        self.wait_all()
        pending = bytearray(self.num_params)
        for g in self.groups:
            for i, p in enumerate(g.params):
                if p.grad is not None or (g.experts is not None and g.experts.holds_grad(i)):
                    flat = self._where[id(p)][2]
                    pending[flat] = 1
                    self._used[flat] = 1
        # built on the host and copied once, pinned and non-blocking on CUDA (no host wait)
        host = torch.tensor(list(pending + self._used), dtype=torch.int32)
        flags = to_device(host, self.ctx.device)
        check = self.deferred_check
        extra = check.flag() if check is not None else None
        if check is not None:  # its slot on every rank, pending or not: the all-reduce has one length
            flags = torch.cat([flags, (extra if extra is not None else flags.new_zeros(1)).to(flags.dtype)])
        C.all_reduce(self.world, flags, op="max", what=f"gradient flags ({self._describe_step()})").wait()
        values = flags.tolist()  # the step's one host read of the flags
        if check is not None:
            check.report(bool(values[-1]))
        start = 0
        for g in self.groups:
            k = len(g.params)
            if any(values[start : start + k]):
                self._launch(g)
            start += k
        self.wait_all()
        self._forget_backward()
        return [bool(v) for v in values[self.num_params : 2 * self.num_params]]

    # -- finishing: what the optimizer step, clipping and inspection need -------------------
    def finish(self, *, check_overflow: bool) -> bool:
        """Finish reduction on every rank and give each master piece its ``.grad`` (a view of
        its group's gradient shard; None for a parameter no rank had a gradient for, so the
        optimizer skips it as under DDP). With ``check_overflow`` (fp16), one more all-reduce
        tells whether any rank's shard holds inf/NaN; returns that. Collective."""
        used = self.finalize()
        k = 0
        for g in self.groups:
            for m, v in zip(g.masters, g.master_grad_views()):
                m.grad = v if used[k] and g.grad_valid else None
                k += 1
        if not check_overflow:
            return False
        dev, shards = self.ctx.device, dict[torch.device, list[torch.Tensor]]()
        for g in self.groups:
            if g.grad_valid and g.grad_shard.numel():
                shards.setdefault(g.grad_shard.device, []).append(g.grad_shard)
        hits = []  # per device where shards are: one foreach max-norm (NaN or inf if any value is), no host read
        for device, tensors in shards.items():
            hit = (~torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))))).any()
            hit = hit.to(torch.int32).reshape(1)
            hits.append(hit if device == dev else to_device(hit, dev))
        flag = torch.stack(hits).amax(0) if hits else torch.zeros(1, dtype=torch.int32, device=dev)
        C.all_reduce(self.world, flag, op="max", what=f"overflow check ({self._describe_step()})").wait()
        overflow = bool(flag.item())  # the fp16 step's one more host read
        if overflow and self.compression is not None:
            self.compression.reset()  # the residuals hold the overflow too: the skipped step drops them
        return overflow

    def master_grads(self, only: Collection[int] | None = None) -> list[torch.Tensor]:
        """The master pieces' gradients (``only``: of the parameters with these ids)."""
        return [
            m.grad
            for g in self.groups
            for p, m in zip(g.params, g.masters)
            if m.grad is not None and (only is None or id(p) in only)
        ]

    def drop_master_grads(self) -> None:
        """Every master gradient None: the optimizer leaves every piece alone (a skipped step)."""
        for g in self.groups:
            for m in g.masters:
                m.grad = None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float, *, only: Collection[int] | None = None
    ) -> torch.Tensor:
        """Scale the master gradients (``only``: of the parameters with these ids, one
        optimizer's) by their *global* norm over all ranks' shards (DDP's ``clip_grad_norm_``
        over those parameters); returns that norm. Collective. Call after :meth:`finish`."""
        grads = self.master_grads(only)
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): use a positive p-norm or float('inf')")
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        dev, what = self.ctx.device, f"gradient norm ({self._describe_step()})"
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        # one foreach norm per device (offloaded gradients are on the host: their part comes back once)
        parts: list[torch.Tensor] = []
        for tensors in by_device.values():
            norms = torch._foreach_norm([t for t in tensors if t.numel()], norm_type, dtype=dtype)
            if not norms:
                continue
            stacked = torch.stack(norms)
            part = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()
            parts.append(part if part.device == dev else to_device(part, dev))
        if norm_type == float("inf"):
            local = torch.stack(parts).max() if parts else torch.zeros((), dtype=dtype, device=dev)
            total = local.reshape(1).clone()
            C.all_reduce(self.ctx, total, op="max", what=what).wait()
            total = total[0]
        else:
            local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=dtype, device=dev)
            total = local.reshape(1).clone()
            C.all_reduce(self.ctx, total, op="sum", what=what).wait()
            total = total[0] ** (1.0 / norm_type)
        # as torch's clip_grad_norm_, on the device (no host read): grads times min(1, max/(norm+eps));
        # a non-finite norm leaves them as they are
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        for device, tensors in by_device.items():
            torch._foreach_mul_(tensors, coef if coef.device == device else coef.to(device))
        return total

    def clip_grad_value_(self, clip_value: float, *, only: Collection[int] | None = None) -> None:
        """Clamp every master gradient element to ``[-clip_value, clip_value]`` (element-wise:
        the shards give DDP's result without communication). Call after :meth:`finish`."""
        if not clip_value > 0:
            raise ValueError(f"clip_grad_value_(clip_value={clip_value}): use a positive value")
        grads = self.master_grads(only)
        if grads:
            torch._foreach_clamp_min_(grads, -float(clip_value))
            torch._foreach_clamp_max_(grads, float(clip_value))

    def zero_grad(self, *, set_to_none: bool, full_grads: bool, only: Collection[int] | None = None) -> None:
        """Forget this window's gradients. Full gradients in ``p.grad`` are dropped, except that
        with ``full_grads`` (``p.grad`` is DDP's) and ``set_to_none=False`` they are zeroed. With
        ``set_to_none=False`` the master pieces keep zeroed gradients, and parameters that had
        one keep counting as "has a gradient" (the optimizer still updates them, e.g. with
        weight decay), as with a zeroed ``.grad`` under DDP. ``only``: forget the gradients
        of the parameters with these ids (one of several optimizers'), keep the others'."""
        self.wait_all()
        if only is not None:
            self._zero_some(only, set_to_none=set_to_none)
            return
        for g in self.groups:
            if g.experts is not None:
                g.experts.drop_grads()
            for p in g.params:
                if full_grads and not set_to_none and p.grad is not None:
                    p.grad.zero_()
                else:
                    p.grad = None
            if set_to_none and g.tier == "device":
                g.release_grad_shard()  # as p.grad = None frees DDP's: the next reduction allocates it again
            elif set_to_none:  # pinned host memory is slow to allocate: kept, overwritten by the next reduction
                for m in g.masters:
                    m.grad = None
            elif g.grad_shard_if_allocated is not None:
                g.grad_shard.zero_()
        if set_to_none:
            self.reset_window()

    def _zero_some(self, only: Collection[int], *, set_to_none: bool) -> None:
        """:meth:`zero_grad` for some parameters: their full gradients go, their pieces of the
        gradient shard are zeroed (a later reduction adds to the shard the others keep)."""
        for g in self.groups:
            mine = [i for i, p in enumerate(g.params) if id(p) in only]
            if g.experts is not None and mine:
                g.experts.drop_grads(mine)
            shard = g.grad_shard_if_allocated
            for i in mine:
                g.params[i].grad = None
                if shard is not None:
                    g.layout.local_view(shard, i).zero_()
                if set_to_none:
                    g.masters[i].grad = None
                    self._used[self._where[id(g.params[i])][2]] = 0
            if set_to_none and len(mine) == len(g.params):
                g.grad_valid = False

    def full_grad(self, p: torch.Tensor, name: str) -> torch.Tensor | None:
        """The full averaged gradient of ``p`` after :meth:`finish` (None if no rank had one):
        every rank's piece, all-gathered. Collective."""
        g, i = self.locate(p)
        lay, n = g.layout, self.ctx.world_size
        c = lay.chunks[i]
        flag = torch.tensor([0 if g.masters[i].grad is None else 1], dtype=torch.int32, device=self.ctx.device)
        C.all_reduce(self.ctx, flag, op="max", what=f"full_grad flag of {name}").wait()
        if not flag.item():
            return None
        buf = torch.zeros(n * c, dtype=g.master_dtype, device=g.device)
        row = buf.view(n, c)[self.ctx.rank]
        piece = lay.local_view(g.grad_shard, i)
        row[: piece.numel()].copy_(piece)
        C.all_gather(self.ctx, buf, row, what=f"full_grad of {name}").wait()
        rows = buf.view(n, c)  # each rank's piece, padded: joined, they are the flat tensor
        return torch.cat([rows[r, : hi - lo] for r in range(n) for lo, hi in [lay.local_range(i, r)]]).view(p.shape)

    def all_reduce_full(self) -> None:
        """DDP's reduction of full gradients: ``p.grad`` becomes the average over the ranks. A
        parameter with a gradient on some rank gets one everywhere (zeros where it had none);
        one without a gradient anywhere keeps ``None``. One flag all-reduce, then one all-reduce
        per group that has a gradient somewhere (never compressed: a warning says so once)."""
        if self.compression is not None and not self._warned_dense:
            self._warned_dense = True
            warnings.warn(
                "compression: without an optimizer the engine all-reduces full gradients (DDP's), uncompressed; "
                "bind one (initialize(model, optimizer) or replace_optimizer) to reduce them with top-k",
                UserWarning,
                stacklevel=4,
            )
        flags = torch.tensor([int(p.grad is not None) for g in self.groups for p in g.params], dtype=torch.int32)
        if not self.num_params:
            return
        flags = to_device(flags, self.ctx.device)
        C.all_reduce(self.world, flags, op="max", what=f"gradient flags ({self._describe_step()})").wait()
        used = flags.cpu().bool().tolist()
        pending: deque[tuple[ShardGroup, C.Handle, torch.Tensor, list[bool]]] = deque()

        def complete(entry: tuple[ShardGroup, C.Handle, torch.Tensor, list[bool]]) -> None:
            g, h, buf, mask = entry
            h.wait()
            if not _narrow(g):
                buf.mul_(1.0 / self.world.world_size)
            off = 0
            for p, m in zip(g.params, mask):
                n = p.numel()
                if m:
                    flat = buf[off : off + n].view(p.shape)
                    if p.grad is None:
                        p.grad = flat.to(p.dtype).clone()
                    else:
                        p.grad.copy_(flat)
                off += n
            self.ctx.pool.put(buf)

        start = 0
        for g in self.groups:
            mask = used[start : start + len(g.params)]
            start += len(g.params)
            if not any(mask):
                continue
            total = sum(p.numel() for p in g.params)
            buf = self.ctx.pool.get(total, g.reduce_dtype, g.device)
            off = 0
            for p in g.params:
                n = p.numel()
                if p.grad is None:
                    buf[off : off + n].zero_()
                else:
                    buf[off : off + n].copy_(p.grad.reshape(-1))
                off += n
            if _narrow(g):
                buf.div_(self.world.world_size)
            pending.append(
                (
                    g,
                    C.all_reduce(self.world, buf, op="sum", what=f"gradients of {g.name} ({self._describe_step()})"),
                    buf,
                    mask,
                )
            )
            while len(pending) > max(self.max_in_flight, 1) - 1 and len(pending) > 1:
                complete(pending.popleft())
        while pending:
            complete(pending.popleft())

    def abort_backward(self) -> None:
        """Forget a backward that never reached its end (it raised): readiness and launches."""
        self.wait_all()
        self._forget_backward()

    def reset_window(self) -> None:
        """Forget gradients (``zero_grad``): the next reduction overwrites each shard."""
        self._used = bytearray(self.num_params)
        for g in self.groups:
            g.grad_valid = False
