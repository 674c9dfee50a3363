"""Shard groups: the parameters that are reduced and gathered together, their fp32 master
pieces and their gradient shard. No communication here (see ``grads.py`` and ``engine.py``).

Where a master piece lives is a policy chosen by type:

- :class:`InPlaceMasters`: the master piece *is* this rank's slice of the parameter's own
  storage (same dtype, no offload). The optimizer updates the model in place; no extra bytes.
- :class:`SeparateMasters`: the master piece is its own tensor in the master dtype (fp32 with
  16-bit parameters).
- :class:`HostMasters`: the master piece is its own tensor in host memory (``offload_optimizer:
  {device: cpu}``, see ``offload.py``); the group's gradient shard and the optimizer state
  follow it there.

ZeRO-3 builds its groups from its units instead (``unit.py``): there the master pieces are
views of each unit's persistent row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.pieces import piece_of
from zero_strategy.storage.offload import HOST, OffloadPolicy, OnDevice

__all__ = [
    "GroupSpec",
    "ReducePlan",
    "RowSelection",
    "HostMasters",
    "InPlaceMasters",
    "MasterPolicy",
    "SeparateMasters",
    "ShardGroup",
    "bucket_numel",
    "build_groups",
]


@dataclass(frozen=True)
class MasterPolicy:
    """Where a master piece lives: a small frozen policy, chosen by type. ``tier`` names the
    memory it is in (``memory_stats()`` counts the group's optimizer side there)."""

    tier: ClassVar[str] = "device"

    def make(self, param: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """The master piece of elements ``lo:hi`` of flattened ``param``, in ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__}.make")


@dataclass(frozen=True)
class InPlaceMasters(MasterPolicy):
    def make(self, param: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        if param.dtype != dtype:
            raise AssertionError(
                f"InPlaceMasters needs the master dtype ({dtype}) to equal the parameter's ({param.dtype}); "
                "the engine picks SeparateMasters for mixed precision"
            )
        return nn.Parameter(param.detach().view(-1)[lo:hi])


@dataclass(frozen=True)
class SeparateMasters(MasterPolicy):
    device: torch.device | None = None  # None: the parameter's device

    def make(self, param: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        piece = piece_of(param, lo, hi).to(device=self.device or param.device, dtype=dtype, copy=True)
        return nn.Parameter(piece)


@dataclass(frozen=True)
class HostMasters(MasterPolicy):
    """The master piece in host memory, pinned when ``pinned`` (a GPU machine asked for it)."""

    tier: ClassVar[str] = "host"
    pinned: bool = False

    def make(self, param: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return nn.Parameter(self.copy_of(piece_of(param, lo, hi), dtype))

    def copy_of(self, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(piece.numel(), dtype=dtype, device=HOST, pin_memory=self.pinned)
        with torch.no_grad():
            out.copy_(piece.reshape(-1))
        return out


@dataclass(frozen=True)
class ReducePlan:
    """One selective reduction: each rank's segments (of the trainable layout) and the padded length."""

    segments: list[list[tuple[int, torch.Tensor]]]  # per rank: (parameter, flat positions)
    width: int
    covered: frozenset[int] = frozenset()  # the parameters some rank reduces rows of
    # compact gradients (experts/compact.py): packed from these instead of ``p.grad``
    grads: tuple[torch.Tensor | None, ...] | None = field(default=None, kw_only=True)

    @property
    def send_numel(self) -> int:
        """Elements of the packed buffer (:meth:`pack`)."""
        return len(self.segments) * self.width

    def exchange(self, ctx: C.CommContext, inp: torch.Tensor, what: str) -> tuple[torch.Tensor, C.Handle]:
        """Start the reduction of the packed ``inp``: this rank's ``width`` elements arrive in the
        returned buffer (after :meth:`combine`)."""
        out = ctx.pool.get(self.width, inp.dtype, inp.device)
        return out, C.reduce_scatter(ctx, out, inp, what=what)

    def combine(self, ctx: C.CommContext, out: torch.Tensor) -> torch.Tensor:
        """The reduced ``width`` elements, once the exchange completed (a reduce-scatter summed them)."""
        return out

    def pack(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Every rank's segments of the full gradients into ``out`` (world_size rows of ``width``)."""
        stray = [i for i, g in enumerate(grads) if g is not None and i not in self.covered]
        if stray:
            raise RuntimeError(
                f"an MoE experts unit has gradients for parameters {stray} of experts that no rank selected: "
                "pass every expert a forward runs to zero_strategy.select_experts(experts, selection) first"
            )
        rows = out.view(len(self.segments), self.width)
        rows.zero_()
        for r, segs in enumerate(self.segments):
            pos = 0
            for i, idx in segs:
                g = grads[i]  # None: this rank did not run that expert (zeros)
                if g is not None:
                    rows[r, pos : pos + idx.numel()].copy_(g.index_select(0, idx))  # cast to the reduce dtype
                pos += idx.numel()

    def add_into(self, layout: ShardLayout, shard: torch.Tensor, mine: torch.Tensor, rank: int, *, fresh: bool) -> None:
        """This rank's reduced segments ``mine`` into its gradient shard (``fresh``: zeros elsewhere)."""
        if fresh:
            shard.zero_()
        pos = 0
        for i, idx in self.segments[rank]:
            b = layout.local_range(i)[0]
            piece = layout.local_view(shard, i)  # on the host with an offloaded optimizer
            piece.index_add_(0, (idx - b).to(piece.device), mine[pos : pos + idx.numel()].to(piece.device))
            pos += idx.numel()


class RowSelection(Protocol):
    """What the reducer asks an MoE experts unit (``experts/selective.py``): the rows of its next
    reduction, and the gradients it holds outside ``p.grad`` (compact gathers)."""

    def reduce_plan(self) -> ReducePlan | None: ...

    def full_grads(self) -> list[torch.Tensor | None] | None: ...

    def holds_grad(self, i: int) -> bool: ...

    def drop_grads(self, only: Sequence[int] | None = None) -> None: ...


class ShardGroup:
    """Parameters of one dtype that travel in one collective (a bucket, later a ZeRO-3 unit)."""

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        fqns: Sequence[str],
        layout: ShardLayout,
        masters: Sequence[torch.Tensor],
        reduce_dtype: torch.dtype,
        label: str | None = None,
        *,
        device: torch.device | None = None,
        tier: str = "device",
    ) -> None:
        self.index = index
        self.label = label
        self.params = list(params)
        self.fqns = list(fqns)
        self.layout = layout
        self.masters = list(masters)
        self.reduce_dtype = reduce_dtype
        self.master_dtype = self.masters[0].dtype
        self.device = device if device is not None else self.params[0].device  # where it is reduced and gathered
        self.master_device = self.masters[0].device  # where the optimizer works on it
        self.tier = tier  # "device" or "host": where its masters, gradient shard and optimizer state live
        self._grad_shard: torch.Tensor | None = None
        self.experts: RowSelection | None = None  # an MoE experts unit: reduced by its selection (experts/selective.py)
        self.grad_valid = False  # False: the next reduction overwrites instead of adding

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced gradient pieces, side by side like the layout's flat row
        (allocated on first use: a model set up without an optimizer never needs it). On the
        device it is allocated uninitialised: it is freed at ``zero_grad(set_to_none=True)`` and
        its next writer overwrites it while ``grad_valid`` is False (no memset per step)."""
        if self._grad_shard is None:
            with torch.inference_mode(False):
                make = torch.empty if self.tier == "device" else torch.zeros
                self._grad_shard = make(
                    self.layout.shard_numel,
                    dtype=self.master_dtype,
                    device=self.master_device,
                    pin_memory=self.tier != "device" and self.masters[0].is_pinned(),
                )
        return self._grad_shard

    @property
    def grad_shard_if_allocated(self) -> torch.Tensor | None:
        return self._grad_shard

    def release_grad_shard(self) -> None:
        """Free the gradient shard (and the masters' gradients, views of it)."""
        for m in self.masters:
            m.grad = None
        self._grad_shard = None
        self.grad_valid = False

    @property
    def name(self) -> str:
        if self.label is not None:
            return f"unit '{self.label}'"
        first, last = self.fqns[0], self.fqns[-1]
        return f"group {self.index} ({first}{' .. ' + last if last != first else ''})"

    def master_is_view(self, i: int) -> bool:
        """Whether master piece ``i`` is a view of parameter ``i``'s own storage (the optimizer
        then updates the parameter in place; otherwise values are copied between them)."""
        return self.masters[i].untyped_storage().data_ptr() == self.params[i].untyped_storage().data_ptr()

    def master_grad_views(self) -> list[torch.Tensor]:
        return [self.layout.local_view(self.grad_shard, i) for i in range(len(self.params))]


@dataclass(frozen=True)
class GroupSpec:
    """How groups are cut for this rank: the world, this rank, the master and reduction dtype of
    each parameter (from the precision policy) and where master pieces live."""

    world_size: int
    rank: int
    master_dtype_for: Callable[[torch.Tensor], torch.dtype]
    reduce_dtype_for: Callable[[torch.Tensor], torch.dtype]
    master_policy: MasterPolicy  # for groups the offload policy leaves on the device
    offload: OffloadPolicy = field(default_factory=OnDevice)
    total_numel: int = 0  # trainable elements in all groups (the offload ratio's base)
    fractions: tuple[float, ...] | None = None  # each rank's share (load balancing); None: even

    def policy_for(self, done: int, device: torch.device) -> MasterPolicy:
        """The master policy of the next group, when ``done`` elements were offloaded before it."""
        if self.offload.offloads(done, self.total_numel):
            return HostMasters(pinned=self.offload.pinned(device))
        return self.master_policy

    def make_group(
        self, index: int, pending: Sequence[tuple[str, nn.Parameter]], policy: MasterPolicy, label: str | None = None
    ) -> ShardGroup:
        """One group of ``pending`` (in that order), with its masters made by ``policy``."""
        layout = ShardLayout(tuple(p.numel() for _, p in pending), self.world_size, self.rank, self.fractions)
        masters = []
        for i, (_, p) in enumerate(pending):
            lo, hi = layout.local_range(i)
            masters.append(policy.make(p, lo, hi, self.master_dtype_for(p)))
        params, fqns = [p for _, p in pending], [n for n, _ in pending]
        reduce_dtype = self.reduce_dtype_for(pending[0][1])
        return ShardGroup(index, params, fqns, layout, masters, reduce_dtype, label, tier=policy.tier)


BUCKETS_PER_MODEL = 16


def bucket_numel(configured: int, trainable: int) -> int:
    """The elements per reduction bucket: ``reduce_bucket_size``, but at most 1/16 of the
    trainable elements. The communication buffers are as large as the groups in flight, so a
    model smaller than one configured bucket (4M elements by default) would otherwise carry
    buffers as large as itself; with 16 buckets they stay a few percent of the model state."""
    return max(1, min(configured, -(-trainable // BUCKETS_PER_MODEL)))


def build_groups(
    named_params: Sequence[tuple[str, nn.Parameter]], spec: GroupSpec, *, bucket_numel: int
) -> list[ShardGroup]:
    """Cut ``named_params`` (in the order gradients are expected: reverse registration) into
    groups of at most ``bucket_numel`` elements (a larger parameter gets a group of its own),
    starting a new group whenever the dtype changes."""
    groups: list[ShardGroup] = []
    pending: list[tuple[str, nn.Parameter]] = []
    offloaded = 0

    def close() -> None:
        nonlocal offloaded
        if pending:
            policy = spec.policy_for(offloaded, pending[0][1].device)
            groups.append(spec.make_group(len(groups), pending, policy))
            if policy.tier != "device":
                offloaded += sum(p.numel() for _, p in pending)
            pending.clear()

    size = 0
    for name, p in named_params:
        if pending and (p.dtype != pending[0][1].dtype or size + p.numel() > bucket_numel):
            close()
            size = 0
        pending.append((name, p))
        size += p.numel()
    close()
    return groups
