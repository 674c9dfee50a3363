"""ZeRO-1/2 parameter storage: every rank holds the full parameters, and after the optimizer
step each group's updated pieces are all-gathered into them.

With the optimizer on the host (``offload_optimizer: {device: cpu}``) a group's masters are
host tensors: its pieces are copied into the all-gather's send buffer on the device. On CUDA
that copy and the all-gather go through a feed (``storage/uploads.py``): both on a side stream,
``non_blocking`` from pinned memory, so the host never waits for them (before, each group's
copy blocked the host until everything queued had run). The masters are fenced before the host
writes them again (the next step, a load): :meth:`ReplicatedParams.fence_rows`.

And the host step of one group overlapped with the copies of the previous one: the engine's
``HostStep`` (``offload/host_step.py``) steps the host groups one at a time and, as soon as
group k is updated, issues its copy and all-gather (:class:`GroupPart`); group k+1 steps on
the host meanwhile. At most ``max_in_flight`` such gathers are pending; older ones are
completed (the compute stream waits for them, then the full parameters are unpacked, with no
host block on CUDA). :meth:`ReplicatedParams.after_step` then completes the rest and gathers
the groups the host step did not issue (groups on the device, another optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.sharding.group import ShardGroup
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.unit import ParamStorage
from zero_strategy.storage.uploads import RowFeed, Uploader, choose_feed

__all__ = ["GroupPart", "ReplicatedParams", "refresh_masters"]

_Pending = tuple[ShardLayout, list[torch.Tensor], C.Handle, torch.Tensor]


class GroupPart:
    """A host group as the host step sees it: fenced before it is stepped (``settle``), its
    gather issued right after (``start_upload``)."""

    def __init__(self, owner: ReplicatedParams, group: ShardGroup) -> None:
        self.owner, self.group = owner, group

    def settle(self, *, host: bool = False) -> None:
        """Before the host steps this group: its own last copy has read its masters (the
        other groups' copies may still run: they read other masters)."""
        if host:
            self.owner.fence_group(self.group)

    def start_upload(self, uploader: Uploader) -> None:
        """The group's masters were just stepped: their copy and all-gather are issued (through
        the owner's feed, not ``uploader``: the copy goes into the gather's buffer)."""
        self.owner.issue_early(self.group)


class ReplicatedParams(ParamStorage):
    """ZeRO-1/2: full parameters everywhere; refreshed by an all-gather after each step."""

    def __init__(
        self, ctx: C.CommContext, groups: Sequence[ShardGroup], params: Sequence[torch.Tensor], max_in_flight: int
    ) -> None:
        self.ctx, self.groups, self.params, self.max_in_flight = ctx, list(groups), list(params), max_in_flight
        self._where = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        self.feed: RowFeed | None = choose_feed(ctx.device)  # for the groups whose masters are on the host
        self.parts = [GroupPart(self, g) for g in self.groups if g.tier == "host"] if self.feed is not None else []
        self.skip_pull: set[int] = set()  # parts whose gather the host step issued (it fills it: host_step.py)
        self._issued: list[_Pending] = []  # those gathers, not completed yet, in issue order
        self._fences: dict[int, list[Callable[[], None]]] = {}  # by group: copies reading its masters, maybe pending

    def step_parts(self) -> list[GroupPart]:
        return self.parts

    def fence_rows(self) -> None:
        fences, self._fences = self._fences, {}
        for per_group in fences.values():
            for fence in per_group:
                fence()

    def fence_group(self, g: ShardGroup) -> None:
        """Before the host writes group ``g``'s masters: wait for the copies that read them."""
        for fence in self._fences.pop(id(g), ()):
            fence()

    @contextlib.contextmanager
    def gathered(self, params: Sequence[torch.Tensor] | None, modifier_rank: int | None, step: str) -> Iterator[None]:
        """Parameters are full already; with a modifier rank, its values are broadcast and
        the masters refreshed."""
        yield
        if modifier_rank is not None:
            plist = self.params if params is None else list(params)
            C.broadcast_coalesced(
                self.ctx, [p.detach() for p in plist], src=modifier_rank, what="gathered_parameters(modifier_rank=...)"
            )
            self.refresh_all_masters()

    def refresh_all_masters(self) -> None:
        """The full parameters were written (a broadcast, ``load_state_dict``): the masters that
        are not views of them follow."""
        self.fence_rows()
        with torch.no_grad():
            for g in self.groups:
                refresh_masters(g)

    def load_full(self, p: torch.Tensor, full: torch.Tensor) -> None:
        p.copy_(full)
        where = self._where.get(id(p))
        if where is None:  # frozen: no master
            return
        g, i = where
        if not g.master_is_view(i):
            self.fence_rows()
            g.masters[i].data.copy_(full.reshape(-1)[slice(*g.layout.local_range(i))])

    def mapped(self, *, writable: bool) -> contextlib.AbstractContextManager[None]:
        if writable:  # a checkpoint load writes the masters
            self.fence_rows()
        return contextlib.nullcontext()

    def _issue(self, g: ShardGroup, picked: Sequence[int], step: str) -> _Pending:
        """Copy group ``g``'s pieces ``picked`` into a send buffer and start their all-gather."""
        n, ctx = self.ctx.world_size, self.ctx
        lay = g.layout if len(picked) == len(g.params) else _sub_layout(g.layout, picked)
        buf = ctx.pool.get(n * lay.shard_numel, g.params[0].dtype, g.device)
        row = buf.view(n, lay.shard_numel)[ctx.rank]
        masters = [g.masters[i].detach() for i in picked]
        feed = self.feed if g.tier == "host" else None
        what = f"parameters of {g.name} ({step})"
        with torch.no_grad():
            fill = lambda: lay.pack_local(masters, row, non_blocking=feed is not None)
            issue = lambda: C.all_gather(ctx, buf, row, what=what)
            if feed is None:
                fill()
                handle = issue()
            else:  # a side stream (storage/uploads.py): the host goes on at once
                handle, fence = feed.run(buf, masters, fill, issue)
                self._fences.setdefault(id(g), []).append(fence)
        return lay, [g.params[i] for i in picked], handle, buf

    def _complete(self, entry: _Pending) -> None:
        lay, params, h, buf = entry
        h.wait()
        with torch.no_grad():
            lay.unpack_full(buf, [p.detach().view(-1) for p in params])
        self.ctx.pool.put(buf)

    def issue_early(self, g: ShardGroup) -> None:
        """The host step updated group ``g``: start its gather now (``after_step`` completes it)."""
        self._issued.append(self._issue(g, range(len(g.params)), "optimizer step"))
        while len(self._issued) > max(self.max_in_flight, 1):
            self._complete(self._issued.pop(0))

    def after_step(self, step: str, only: frozenset[int] | None = None) -> None:
        """All-gather the updated pieces into the full parameters: every group's, or with
        ``only`` (one of several optimizers stepped) just those parameters', in a layout of
        their own pieces (a piece's range depends only on its parameter, so it is the same).
        The gathers the host step issued already are completed first."""
        pending, self._issued = self._issued, []
        early = {id(part.group) for part in self.parts if id(part) in self.skip_pull}
        for g in self.groups:
            picked = [i for i, p in enumerate(g.params) if only is None or id(p) in only]
            if not picked or id(g) in early:
                continue
            pending.append(self._issue(g, picked, step))
            if len(pending) > self.max_in_flight:
                self._complete(pending.pop(0))
        self.skip_pull.clear()
        for entry in pending:
            self._complete(entry)

    def forget_issued(self) -> None:
        """A step that failed after the host step issued gathers: they complete now (every rank
        issued them), so nothing is left in flight."""
        pending, self._issued = self._issued, []
        self.skip_pull.clear()
        for entry in pending:
            self._complete(entry)

    def flat_value(self, p: torch.Tensor) -> torch.Tensor:
        return p.data.view(-1)


def _sub_layout(layout: ShardLayout, picked: Sequence[int]) -> ShardLayout:
    """The layout of parameters ``picked`` of ``layout`` alone: each keeps its pieces' ranges."""
    return dataclasses.replace(layout, numels=tuple(layout.numels[i] for i in picked))


def refresh_masters(g: ShardGroup) -> None:
    """Copy this rank's pieces of ``g``'s full parameters into masters that are not views."""
    for i, p in enumerate(g.params):
        if not g.master_is_view(i):
            g.masters[i].data.copy_(p.detach().reshape(-1)[slice(*g.layout.local_range(i))])
