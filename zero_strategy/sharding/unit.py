"""ZeRO-3 parameter storage: where the full parameters are and are not.

Two policies, chosen by type:

- :class:`~zero_strategy.sharding.replicated.ReplicatedParams` (ZeRO-1/2): every rank holds
  full parameters; after the optimizer step each group's updated pieces are all-gathered into them.
- :class:`ShardedParams` (ZeRO-3): every rank holds only its flat row of each unit (its pieces
  of every parameter, trainable and frozen, side by side). A unit moves SHARDED -> UNSHARDING -> UNSHARDED ->
  SHARDED; the full parameters exist only while UNSHARDED (outside, each parameter keeps its
  shape but is a placeholder that holds no memory).

Every ZeRO-3 gather carries a two-element tag naming the unit on each rank. If ranks gather
different units (a unit that ran on some ranks and not others), every rank raises the same
error naming the units and the ranks, instead of swapping data silently. Reading the tags on
the host would wait for the device at every gather, so :class:`GatherChecks` reads them at once
only while the unit order is not known (the first step, or a step that left the recorded
order); otherwise the tags (and the placeholders' "written while sharded" check) are compared
on the device and the outcome is read once per step, with the gradient flags.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zero_strategy._weak import weak_method
from zero_strategy.comm import collectives as C
from zero_strategy.sharding.gather_checks import (
    GatherChecks,
    UnitDivergence,
    check_unit_count,
)
from zero_strategy.sharding.gather_codec import EXACT, GatherCodec
from zero_strategy.sharding.gather_meter import GatherMeter
from zero_strategy.sharding.group import HostMasters, ShardGroup
from zero_strategy.sharding.layout import ShardLayout
from zero_strategy.sharding.pieces import (
    piece_of,
    placeholder,
    take_record,
)
from zero_strategy.sharding.states import SHARDED_TRANSITIONS, ShardedState, check_transition
from zero_strategy.storage.disk_rows import DiskRows, RowSwap
from zero_strategy.storage.host_memory import HostPeak
from zero_strategy.storage.offload import HOST, OffloadPolicy, OnDevice, OnDisk
from zero_strategy.storage.uploads import PendingUpload, RowFeed, Uploader, choose_feed

if TYPE_CHECKING:
    from zero_strategy.sharding.precision import Precision
    from zero_strategy.sharding.secondary import SecondaryShards

__all__ = ["ParamStorage", "ShardedParams", "ShardedState", "UnitDivergence", "UnitStorage"]


class ParamStorage:
    """Where the model's full parameters are: one storage per engine, chosen by type."""

    def gathered(
        self, params: Sequence[torch.Tensor] | None, modifier_rank: int | None, step: str
    ) -> contextlib.AbstractContextManager[None]:
        """Full parameters (``params``, or all) inside the block; with ``modifier_rank``, that
        rank's values are broadcast and kept at its end. Collective."""
        raise NotImplementedError(f"{type(self).__name__}.gathered")

    def load_full(self, p: torch.Tensor, full: torch.Tensor) -> None:
        """Store the full value ``full`` of parameter ``p`` (and its master piece)."""
        raise NotImplementedError(f"{type(self).__name__}.load_full")

    def loading(self) -> contextlib.AbstractContextManager[None]:
        """Around a series of :meth:`load_full` calls (rows on disk are then read and written
        once per unit, not once per parameter)."""
        return contextlib.nullcontext()

    def after_step(self, step: str, only: frozenset[int] | None = None) -> None:
        """The masters changed (an optimizer step, a load): make the parameters follow. ``only``:
        the ids of the parameters that changed (one of several optimizers stepped); None: all."""
        raise NotImplementedError(f"{type(self).__name__}.after_step")

    def flat_value(self, p: torch.Tensor) -> torch.Tensor:
        """What this rank holds of a parameter that has no master (frozen), flattened: its piece
        at ZeRO-3, the whole tensor otherwise."""
        raise NotImplementedError(f"{type(self).__name__}.flat_value")

    def flat_offset(self, p: torch.Tensor) -> int | None:
        """Where :meth:`flat_value` starts in the flattened tensor when that is not where
        ``torch.chunk`` would put it (uneven, load-balanced pieces); None otherwise."""
        return None

    def masters_resident(self, g: ShardGroup) -> contextlib.AbstractContextManager[object]:
        """Group ``g``'s master pieces in memory inside the block (they always are, unless they
        are views of ZeRO-3 rows on disk); what the block changes is kept."""
        return contextlib.nullcontext()

    def fence_rows(self) -> None:
        """Before the optimizer step writes the masters: copies that read them are done."""

    def step_parts(self) -> Sequence[object]:
        """What the overlapped host step (``offload/host_step.py``) steps one by one: objects with
        ``group``, ``settle(host=True)`` and ``start_upload(uploader)``; none by default."""
        return []

    def forget_issued(self) -> None:
        """A step is over or failed: copies the host step issued are completed or forgotten."""

    def mapped(self, *, writable: bool) -> contextlib.AbstractContextManager[None]:
        """Rows on disk as memory maps inside the block, for checkpoints (nothing elsewhere)."""
        return contextlib.nullcontext()


class UnitStorage:
    """One ZeRO-3 unit: this rank's persistent pieces of the unit's parameters, and the full
    parameters while the unit is gathered.

    The parameters are laid out trainable first, then frozen, in one :class:`ShardLayout`;
    this rank's pieces of the trainable ones are ``row`` (in the master dtype: the optimizer's
    master pieces are views of it), those of the frozen ones ``frozen_row`` (in the compute
    dtype: they are never updated, so they need no master). A gather sends both, cast to the
    compute dtype, plus a two-element tag, in one all-gather. ``group`` is the trainable part
    as a :class:`ShardGroup` (the reducer's view), or None for a unit without trainable
    parameters.

    Offload (``offload.py``): with ``row_policy`` on the host, both rows live in host memory and
    a gather copies them up into its send buffer; the masters stay views of the host row. With
    only ``host_masters`` (optimizer offload), the rows stay on the device in the compute
    dtype and the masters are host copies of the trainable row, which :meth:`pull_masters`
    copies back after each step and load.

    With ``row_swap`` (``offload_param: {device: nvme}``) the rows live in a swap file
    (:class:`~zero_strategy.storage.disk_rows.DiskRows`) and in memory only inside :meth:`resident`;
    the masters are then host copies (``host_masters``, the optimizer state in host memory)
    or, without them (the optimizer state on NVMe too), views of the row that the disk tier
    makes resident around the unit's optimizer step."""

    def __init__(
        self,
        label: str,
        tag: int,
        trainable: Sequence[tuple[str, nn.Parameter]],
        frozen: Sequence[tuple[str, nn.Parameter]],
        ctx: C.CommContext,
        precision: Precision,
        meter: GatherMeter[UnitStorage],
        persistence_threshold: int,
        group_index: int,
        row_policy: OffloadPolicy | None = None,
        host_masters: HostMasters | None = None,
        row_swap: RowSwap | None = None,
        checks: GatherChecks | None = None,
        fractions: tuple[float, ...] | None = None,
        cuts: tuple[int, ...] | None = None,  # expert owners' boundaries (experts/owners.py)
        peak: HostPeak | None = None,  # counts the host memory the originals free (host_memory.py)
        codec: GatherCodec = EXACT,  # the forward's and backward's gathers (gather_codec.py)
        feed: RowFeed | None = None,  # rows in host memory into the gathers (storage/uploads.py)
    ) -> None:
        self.label, self.tag, self.ctx, self.meter = label, tag, ctx, meter
        self._upload: PendingUpload | None = None  # the row's copy from the host masters in flight (host_step.py)
        self._fed: Callable[[], None] | None = None  # the fence of the rows' last copy into a gather
        self.codec, self._codec = codec, codec  # the configured one, the one of the gather now
        self.checks = checks or GatherChecks({})
        named = list(trainable) + list(frozen)
        self.params = [p for _, p in named]
        self.fqns = [n for n, _ in named]
        self.n_trainable = len(trainable)
        self.dtype = unit_dtype(label, self.params, precision)
        self.layout = ShardLayout(tuple(p.numel() for p in self.params), ctx.world_size, ctx.rank, fractions, cuts)
        lay = self.layout
        t_numel = sum(lay.chunks[: self.n_trainable])
        master_dtype = precision.master_dtype_for(self.params[0]) if trainable else self.dtype
        row_policy = row_policy or OnDevice()
        self.row_tier = row_policy.tier
        self.feed = None if isinstance(row_policy, OnDevice) else feed
        separate = host_masters is not None and row_policy.tier != "host"
        row_dtype = self.dtype if separate else master_dtype  # separate host masters: the row only feeds gathers

        def make_row(numel: int, dtype: torch.dtype) -> torch.Tensor:  # untouched: written piece by piece below
            where = ctx.device if isinstance(row_policy, OnDevice) else HOST
            return torch.empty(numel, dtype=dtype, device=where, pin_memory=row_policy.pinned(ctx.device))

        # Parameter by parameter, in the rows' order: its piece (and its separate master) is
        # written, its padding zeroed, then the original loses its data before the next one is
        # read, so the rows' pages are touched as the originals are freed (the host memory this
        # takes stays about one parameter, not a unit). A parameter mapped from a file (weights
        # from safetensors) is read only for this rank's piece.
        host_pieces: list[torch.Tensor] = []
        with torch.no_grad(), torch.inference_mode(False):
            self.row = make_row(t_numel, row_dtype)
            self.frozen_row = make_row(lay.shard_numel - t_numel, self.dtype)
            for i, p in enumerate(self.params):
                mine = piece_of(p, *lay.local_range(i))
                piece = self.piece(i)
                piece.copy_(mine)
                row, off = self._rows(lay.offsets[i])
                row[off + piece.numel() : off + lay.chunks[i]].zero_()  # padding stays zero
                if separate and host_masters is not None and i < self.n_trainable:
                    host_pieces.append(host_masters.copy_of(mine, master_dtype))
                del mine
                held = p.data.untyped_storage().nbytes() if p.device.type == "cpu" else 0
                built = take_record(p)  # a sharded_init piece: in the row now, freed before the next one
                if built is not None and built.piece.device.type == "cpu":
                    held = built.piece.untyped_storage().nbytes()
                del built
                p.data = placeholder(p.shape, self.dtype, ctx.device)
                if peak is not None:
                    peak.released(held)
        self.group: ShardGroup | None = None
        self.separate_masters = False
        if trainable:
            t_layout = ShardLayout(tuple(p.numel() for _, p in trainable), ctx.world_size, ctx.rank, fractions, cuts)
            if separate and host_masters is not None:  # the fp32 pieces on the host, the row on the device
                masters = [nn.Parameter(m) for m in host_pieces]
                self.separate_masters = True
            else:
                masters = [nn.Parameter(t_layout.local_view(self.row, i)) for i in range(len(trainable))]
            tier = "host" if separate or row_policy.tier != "device" else "device"
            self.group = ShardGroup(
                group_index, [p for _, p in trainable], [n for n, _ in trainable], t_layout, masters,
                precision.grad_reduce_dtype(self.params[0]), label, device=ctx.device, tier=tier,
            )  # fmt: skip
        self.disk: DiskRows | None = None
        if row_swap is not None:  # written to the swap file; from here on in memory only while resident
            # it calls back into this unit, which holds it: weakly, so no cycle keeps the unit (_weak.py)
            self.disk = DiskRows(row_swap, label, [self.row, self.frozen_row], weak_method(self._attach),
                                 weak_method(self._detach))  # fmt: skip
            self._detach()
        # a small unit stays gathered from its first use until the optimizer step changes it
        self.persistent = sum(lay.numels) <= persistence_threshold
        self.holds = 0  # open gathered_parameters() blocks that gathered this unit: release() leaves it
        self.version = 0  # counts writes of the rows (a step, a load): copies of older values are stale
        self.gathers = 0  # all-gathers issued for this unit (the cache tells its hits by it)
        # Each parameter gets a full-shaped tensor with a storage of its own that is resized to
        # 0 bytes while sharded; ``p.data`` points at it only while the unit is gathered and is
        # a memory-less placeholder otherwise (reads give NaN, writes raise), so touching a
        # sharded parameter never reads freed memory. Views autograd saved in forward keep the
        # storage object and see the data again when the unit is gathered for backward.
        # The placeholders were installed above, as each parameter's piece was written.
        self.full = [torch.empty(p.shape, dtype=self.dtype, device=ctx.device) for p in self.params]
        self._placeholders: dict[int, torch.Tensor] = {}  # per parameter, reused at every reshard
        for f in self.full:
            f.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED
        self._numel_bytes = [p.numel() * f.element_size() for p, f in zip(self.params, self.full)]
        self._handle: C.Handle | None = None
        self._buf: torch.Tensor | None = None
        self._step = ""
        self.secondary: SecondaryShards | None = None  # hpZ (secondary.py): set by ShardedParams.use_secondary

    # -- rows on disk ------------------------------------------------------------------------
    def _attach(self, rows: list[torch.Tensor]) -> None:
        """The rows were read back: the row attributes and the masters that are views point at them."""
        self.row, self.frozen_row = rows
        if self.group is not None and not self.separate_masters:
            for i, m in enumerate(self.group.masters):
                m.data = self.group.layout.local_view(self.row, i)

    def _detach(self) -> None:
        """The rows leave memory: what pointed at them gets a memory-less placeholder."""
        self.row, self.frozen_row = _row_placeholder(self.row), _row_placeholder(self.frozen_row)
        if self.group is not None and not self.separate_masters:
            for m in self.group.masters:
                m.data = placeholder(m.shape, m.dtype, HOST)

    def resident(
        self, *, write: bool = False, overwrite: int | None = None
    ) -> contextlib.AbstractContextManager[object]:
        """The persistent rows in memory inside the block (always, unless they are on disk);
        with ``write``, changes are written back to the swap file at its end; ``overwrite``
        (0: the trainable row, 1: the frozen one) is written whole, so it is not read first."""
        if self.disk is None:
            return contextlib.nullcontext()
        return self.disk.resident(write=write, overwrite=overwrite)

    @contextlib.contextmanager
    def mapped(self, *, writable: bool) -> Iterator[None]:
        """Rows on disk as memory maps of their file inside the block (checkpoints)."""
        if self.disk is None:
            yield
            return
        with self.disk.mapped(writable=writable) as rows:
            self._attach(rows)
            try:
                yield
            finally:
                self._detach()

    @property
    def name(self) -> str:
        return f"unit '{self.label}'"

    def _rows(self, offset: int) -> tuple[torch.Tensor, int]:
        """The persistent row holding flat position ``offset`` of this rank's shard, and the
        position inside it."""
        self.settle()
        t = self.row.numel()
        return (self.row, offset) if offset < t else (self.frozen_row, offset - t)

    def piece(self, i: int) -> torch.Tensor:
        """This rank's piece of parameter ``i`` (a view of its persistent row, unpadded)."""
        row, off = self._rows(self.layout.offsets[i])
        return row[off : off + self.layout.local_numel(i)]

    @property
    def lossy(self) -> bool:
        """Whether the full parameters now hold a lossy gather's values (rounded or quantized)."""
        return self.state is not ShardedState.SHARDED and self._codec.lossy

    @property
    def full_bytes(self) -> int:
        return sum(self._numel_bytes)

    @property
    def numel(self) -> int:
        return sum(self.layout.numels)

    def _to(self, new: ShardedState, what: str) -> None:
        """The one place a unit's state changes, from the states it may leave."""
        where = f"rank {self.ctx.rank}: {what} of {self.name}"
        self.state = check_transition(
            SHARDED_TRANSITIONS, self.state, new, where, note="an engine bug: please report it"
        )

    def unshard_async(self, step: str, *, exact: bool = False) -> None:
        """Issue the gather; ``exact`` ignores a lossy codec (the persistent units always do)."""
        if self.state is not ShardedState.SHARDED:
            return
        codec = EXACT if exact or self.persistent else self.codec
        n, s = self.ctx.world_size, codec.slot_numel(self.layout.shard_numel)
        buf = self.ctx.pool.get(n * s, codec.wire_dtype(self.dtype), self.ctx.device)
        what = f"parameters of {self.name} ({step})"
        # hpZ: from the secondary shards within the k-rank group, when this rank holds them (secondary.py);
        # they hold the forward gather's wire format, so an exact gather of a lossy codec reads the rows
        hpz = self.secondary is not None and codec is self.codec
        handle = self.secondary.gather(self, buf, what) if hpz and self.secondary is not None else None
        if handle is None:
            slot = buf.view(n, s)[self.ctx.rank]
            self.settle()  # the row's upload after the host step (host_step.py, sync point 3)
            with self.resident():
                rows, feed = (self.row, self.frozen_row), self.feed
                fill = lambda: codec.encode(slot, rows, self.tag, non_blocking=feed is not None)
                issue = lambda: C.all_gather(self.ctx, buf, slot, what=what)
                if feed is None:
                    fill()
                    handle = issue()
                else:  # a side stream (storage/uploads.py); rows read from disk: their slab is fenced
                    handle, self._fed = feed.run(buf, rows, fill, issue)
                    if self.disk is not None:
                        self.disk.fence(self._fed)
        self._buf, self._step, self._codec, self._handle = buf, step, codec, handle
        self._to(ShardedState.UNSHARDING, "unshard_async")
        self.meter.gathered(self)  # counted from the moment its gather buffer exists
        self.gathers += 1

    def wait_unshard(self, names: dict[int, str]) -> None:
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is not ShardedState.UNSHARDING:
            self._to(ShardedState.UNSHARDED, "wait_unshard")  # raises: nothing was gathered
        if self._handle is None or self._buf is None:
            raise AssertionError(f"rank {self.ctx.rank}: {self.name} is UNSHARDING without a gather in flight")
        self._handle.wait()
        n = self.ctx.world_size
        rows, digits = self._codec.decode(self._buf.view(n, -1), self.layout.shard_numel)
        try:
            self.checks.gathered(self, digits, self._step)
        except UnitDivergence:
            self.ctx.pool.put(self._buf)
            self._handle, self._buf = None, None
            self._to(ShardedState.SHARDED, "a diverged gather")
            self.meter.freed(self)
            raise
        with torch.no_grad():
            for p, f, nbytes in zip(self.params, self.full, self._numel_bytes):
                f.untyped_storage().resize_(nbytes)
                p.data = f
            self.layout.unpack_full(rows, [f.view(-1) for f in self.full])  # the rank rows, without their tags
        if self.secondary is not None:  # hpZ: this rank's secondary shard, if the scheduler asked for one
            self.secondary.keep(self, self._buf)
        self.ctx.pool.put(self._buf)
        self._handle, self._buf = None, None
        self._to(ShardedState.UNSHARDED, "wait_unshard")

    def release(self) -> None:
        """Done with the parameters for now: free them unless the unit is persistent or a
        ``gathered_parameters`` block holds it (a forward inside the block frees nothing)."""
        if not self.persistent and not self.holds:
            self.reshard()

    def reshard(self) -> None:
        if self.state is ShardedState.SHARDED:
            return
        if self.state is ShardedState.UNSHARDING:  # a prefetch nobody used
            self.wait_unshard({})
        for i, (p, f) in enumerate(zip(self.params, self.full)):
            # each parameter's placeholder is made once and reused: a reshard launches no kernel
            ph = self._placeholders.get(i)
            if ph is None or ph.shape != f.shape or ph.dtype != f.dtype or ph.device != f.device:
                with torch.inference_mode(False):  # cached: a later write outside inference mode is named
                    ph = self._placeholders[i] = placeholder(f.shape, f.dtype, f.device)  # a compact placement's
            p.data = ph
            f.untyped_storage().resize_(0)
        self._to(ShardedState.SHARDED, "reshard")
        self.meter.freed(self)

    def store_full(self, i: int, full: torch.Tensor) -> None:
        """Write this rank's piece of the full value ``full`` of parameter ``i`` into its row
        (and its separate master); a gathered copy is dropped, so the next use gathers the new
        values."""
        mine = full.reshape(-1)[slice(*self.layout.local_range(i))]
        self.fence_rows()
        with self.resident(write=True):
            self.piece(i).copy_(mine)
            if self.separate_masters and self.group is not None and i < self.n_trainable:
                with torch.no_grad():  # from the full value: a 16-bit row would round the fp32 master
                    self.group.masters[i].copy_(mine)
        self.version += 1
        self.reshard()

    def push_to_master(self, i: int) -> None:
        """The row's piece ``i`` was written: a separate master piece follows it."""
        if self.separate_masters and self.group is not None and i < self.n_trainable:
            with torch.no_grad(), self.resident():
                self.group.masters[i].copy_(self.piece(i))

    def start_upload(self, uploader: Uploader) -> None:
        """The separate masters were just stepped: their copy into the row is issued, not
        waited for (``host_step.py``); the row's next reader waits in :meth:`settle`."""
        if self.separate_masters and self.group is not None:
            self.settle(host=True)
            self._upload = uploader.start([self.piece(i) for i in range(len(self.group.masters))],
                                          [m.detach() for m in self.group.masters])  # fmt: skip

    def settle(self, *, host: bool = False) -> None:
        """Wait for the row's upload in flight, if any: on the device before a device reader
        uses the row, on the host (``host``) before the masters are written again."""
        pending = self._upload
        if pending is None:
            return
        if host:
            self._upload = None
            pending.host_wait()
        else:  # the host's wait stays due: the masters may not be written until the copy read them
            pending.device_wait()
            self._upload = PendingUpload(_nothing, pending.host_wait)

    def fence_rows(self) -> None:
        """Before the host writes the rows: wait for their last copy into a gather, if it may be pending."""
        fed, self._fed = self._fed, None
        if fed is not None:
            fed()

    def pull_masters(self) -> None:
        """The masters changed (a step, a load): separate masters are copied into the row."""
        if self.separate_masters and self.group is not None:
            self.fence_rows()
            with torch.no_grad(), self.resident(write=True, overwrite=0):  # every trainable piece is written
                for i, m in enumerate(self.group.masters):
                    self.piece(i).copy_(m.detach(), non_blocking=m.is_pinned())


def _nothing() -> None:
    """No wait left."""


def unit_dtype(label: str, params: Sequence[torch.Tensor], precision: Precision) -> torch.dtype:
    """The one dtype a unit's parameters are gathered in (a unit that mixes dtypes raises)."""
    dtypes = {precision.param_dtype_for(p) for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"initialize(): ZeRO-3 unit '{label}' mixes parameter dtypes {sorted(map(str, dtypes))} (one gather per "
            "unit needs one dtype); cast the model to one dtype before initialize()"
        )
    return dtypes.pop()


def _row_placeholder(row: torch.Tensor) -> torch.Tensor:
    n = row.numel()
    return placeholder(torch.Size([n]), row.dtype, HOST) if n else torch.empty(0, dtype=row.dtype, device=HOST)


class ShardedParams(ParamStorage):
    """ZeRO-3: persistent rows per unit (frozen parameters included), full parameters only
    while a unit is gathered."""

    def __init__(
        self,
        members: Sequence[tuple[str, Sequence[tuple[str, nn.Parameter]]]],
        named: Sequence[tuple[str, nn.Parameter]],
        ctx: C.CommContext,
        precision: Precision,
        persistence_threshold: int,
        offload_optimizer: OffloadPolicy | None = None,
        offload_params: OffloadPolicy | None = None,
        row_swap: RowSwap | None = None,
        fractions: tuple[float, ...] | None = None,
        unit_cuts: dict[str, tuple[int, ...]] | None = None,
        sync: Callable[[Sequence[nn.Parameter]], None] | None = None,
        peak: HostPeak | None = None,
        codec: GatherCodec = EXACT,
    ) -> None:
        """One unit per entry of ``members`` (``unit_members``: the units' modules in order,
        then the root unit, label ``<root>``, for the parameters outside every unit; the engine
        finds them once, for the placement and for this storage). A parameter reachable from two
        units, or from a unit and outside it (tied weights), belongs to the root unit, which
        stays gathered for the whole forward and backward. The offload policies say where each
        unit's rows and masters live (``offload.py``); ``unit_cuts`` gives experts units (by
        label) their owners' boundaries (``experts/owners.py``).

        The model is converted unit by unit: ``sync`` (the initial broadcast from rank 0) gets
        each unit's parameters just before its rows are written, and the unit's parameters lose
        their data right after, before the next unit is touched, so the host memory this takes
        is one unit above the model, not a second model (``peak`` is marked there). What can
        fail for a reason of the model (a unit that mixes dtypes) is checked for every unit
        first, so that such an error leaves the model's parameters untouched."""
        offload_optimizer = offload_optimizer or OnDevice()
        self.ctx = ctx
        feed = choose_feed(ctx.device)  # for the units whose rows are offloaded
        self.meter: GatherMeter[UnitStorage] = GatherMeter()
        self.skip_pull: set[int] = set()  # units whose row upload the host step issued (host_step.py)
        self.units: list[UnitStorage] = []
        self.groups: list[ShardGroup] = []
        self.names: dict[int, str] = {}
        self.checks = GatherChecks(self.names)  # filled below; the scheduler sets ``deferred``
        total = sum(p.numel() for _, p in named if p.requires_grad)
        offloaded = rows_offloaded = 0
        check_unit_count(len(members))
        for label, pending in members:
            unit_dtype(label, [p for _, p in pending], precision)
        for label, pending in members:
            if sync is not None:
                sync([p for _, p in pending])
            trainable = [(n, p) for n, p in pending if p.requires_grad]
            frozen = [(n, p) for n, p in pending if not p.requires_grad]
            host = None
            rows = (
                offload_params
                if offload_params is not None and offload_params.offloads(rows_offloaded, total)
                else None
            )
            rows_offloaded += sum(p.numel() for _, p in trainable) if rows is not None else 0
            if trainable and isinstance(offload_params, OnDisk):
                # the rows on disk: fp32 masters on the host beside host optimizer state, or
                # views of the row when the optimizer state is on disk too (stepped resident)
                if not isinstance(offload_optimizer, OnDisk):
                    host = HostMasters(pinned=offload_params.pinned(ctx.device))
            elif trainable and offload_optimizer.offloads(offloaded, total):
                host = HostMasters(pinned=offload_optimizer.pinned(ctx.device))
                offloaded += sum(p.numel() for _, p in trainable)
            u = UnitStorage(label, len(self.units) + 1, trainable, frozen, ctx, precision, self.meter,
                            persistence_threshold, group_index=len(self.groups), row_policy=rows,
                            host_masters=host, row_swap=row_swap, checks=self.checks,
                            fractions=fractions, cuts=(unit_cuts or {}).get(label), peak=peak,
                            codec=codec, feed=feed)  # fmt: skip
            self.units.append(u)
            if u.group is not None:
                self.groups.append(u.group)
            if peak is not None:  # after the unit's last piece: its rows hold the only copy now
                peak.mark()
        self.names.update({u.tag: u.name for u in self.units})
        self._where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._unit_of_group = {id(u.group): u for u in self.units if u.group is not None}
        self._loading: contextlib.ExitStack | None = None  # inside loading()
        self._loading_unit: UnitStorage | None = None
        self.secondary: SecondaryShards | None = None  # hpZ (secondary.py)

    def use_secondary(self, secondary: SecondaryShards | None) -> None:
        """hpZ (``secondary.py``): the units keep secondary shards in ``secondary`` (None: off)."""
        self.secondary = secondary
        for u in self.units:
            u.secondary = secondary

    def unit_of(self, p: torch.Tensor) -> tuple[UnitStorage, int] | None:
        return self._where.get(id(p))

    def masters_resident(self, g: ShardGroup) -> contextlib.AbstractContextManager[object]:
        u = self._unit_of_group.get(id(g))
        return u.resident(write=True) if u is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def mapped(self, *, writable: bool) -> Iterator[None]:
        if writable:  # a checkpoint load writes the rows and masters
            self.fence_rows()
        with contextlib.ExitStack() as stack:
            for u in self.units:
                stack.enter_context(u.mapped(writable=writable))
            yield

    @contextlib.contextmanager
    def gathered(self, params: Sequence[torch.Tensor] | None, modifier_rank: int | None, step: str) -> Iterator[None]:
        if params is None:
            units = self.units
        else:
            found = {id(w[0]): w[0] for p in params if (w := self.unit_of(p)) is not None}
            units = [u for u in self.units if id(u) in found]
        was = [u.state for u in units]
        for u in units:  # a forward's rounded or quantized copy is gathered again, exactly
            if u.lossy:
                u.reshard()
        where = f"gathered_parameters ({step})"
        with self.immediate_checks():
            for u in units:
                u.unshard_async(where, exact=True)
            for u in units:
                u.wait_unshard(self.names)
        for u in units:
            u.holds += 1
        try:
            yield
        finally:
            for u in units:
                u.holds -= 1
            if modifier_rank is not None:
                flat = [p.detach() for u in units for p in u.params]
                C.broadcast_coalesced(self.ctx, flat, src=modifier_rank, what="gathered_parameters(modifier_rank=...)")
                with torch.no_grad():
                    for u in units:
                        u.version += 1
                        u.fence_rows()  # the pieces are written
                        with u.resident(write=True):
                            for i, p in enumerate(u.params):
                                u.piece(i).copy_(p.detach().reshape(-1)[slice(*u.layout.local_range(i))])
                                u.push_to_master(i)
            for u, state in zip(units, was):
                if state is ShardedState.SHARDED:
                    u.reshard()

    @contextlib.contextmanager
    def immediate_checks(self) -> Iterator[None]:
        """Gathers outside the scheduler's steps (``gathered_parameters``, ``destroy``) are checked at once."""
        saved, self.checks.deferred = self.checks.deferred, False
        try:
            yield
        finally:
            self.checks.deferred = saved

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """The unit of the last ``load_full`` stays resident until a parameter of another unit comes."""
        self._loading = contextlib.ExitStack()
        try:
            yield
        finally:
            stack, self._loading, self._loading_unit = self._loading, None, None
            stack.close()
        self.refresh_persistent("load")  # not after an error: the ranks may not agree on where it stopped

    def load_full(self, p: torch.Tensor, full: torch.Tensor) -> None:
        u, i = self._unit_of_or_raise(p, "load_full")
        if self._loading is not None and self._loading_unit is not u:
            self._loading.close()  # the previous unit is written back
            self._loading_unit = u
            self._loading.enter_context(u.resident(write=True))
        u.store_full(i, full)

    def fence_rows(self) -> None:
        for u in self.units:
            u.fence_rows()

    def step_parts(self) -> list[UnitStorage]:
        """Units whose masters are separate host copies of a device row (rows on disk are in
        memory only while resident: their masters are written back by ``after_step``)."""
        return [u for u in self.units if u.separate_masters and u.group is not None and u.disk is None]

    def forget_issued(self) -> None:
        self.skip_pull.clear()  # the next after_step copies every unit's masters

    def after_step(self, step: str, only: frozenset[int] | None = None) -> None:
        # The masters are views of the rows (already updated) or, offloaded, copied into them
        # now; gathered copies hold the old values: free them, so the next use gathers again.
        # Every unit is freed whatever ``only`` says (one of several optimizers stepped: a unit
        # whose parameters did not change is gathered again at its next use all the same).
        # Persistent units are gathered again at once: as in DeepSpeed, a parameter under the
        # persistence threshold is never partitioned for its readers, so code that reads it
        # outside forward (Accelerate's test script reads a 0-dim ``model.a``) gets the new value.
        for u in self.units:
            if id(u) not in self.skip_pull:  # else its upload is in flight already (host_step.py)
                u.pull_masters()
            u.version += 1
            u.reshard()
        if self.secondary is not None:  # stale: the next forward takes new ones
            self.secondary.drop_all()
        self.refresh_persistent(step)

    def refresh_persistent(self, step: str) -> None:
        """Gather the persistent units that are sharded now (after a step, a load, at
        initialize). Collective: every rank calls it at the same point."""
        kept = [u for u in self.units if u.persistent and u.state is ShardedState.SHARDED]
        for u in kept:
            u.unshard_async(step)
        for u in kept:
            u.wait_unshard(self.names)

    def flat_value(self, p: torch.Tensor) -> torch.Tensor:
        u, i = self._unit_of_or_raise(p, "flat_value")
        return u.piece(i)

    def flat_offset(self, p: torch.Tensor) -> int | None:
        u, i = self._unit_of_or_raise(p, "flat_offset")
        return None if u.layout.even else u.layout.local_range(i)[0]

    def _unit_of_or_raise(self, p: torch.Tensor, what: str) -> tuple[UnitStorage, int]:
        where = self.unit_of(p)
        if where is None:
            raise RuntimeError(
                f"rank {self.ctx.rank}: {what} of a parameter of shape {tuple(p.shape)} that no ZeRO-3 unit holds"
            )
        return where

    def materialize(self, step: str) -> None:
        """Gather every unit and leave its full parameters in the module for good (destroy)."""
        self.checks.deferred = False
        for u in self.units:
            if u.lossy:
                u.reshard()
            u.unshard_async(step, exact=True)
        for u in self.units:
            u.wait_unshard(self.names)
            self.meter.freed(u)
            u.persistent = True  # nothing frees them again
            u.full = [
                torch.empty(0, dtype=f.dtype, device=f.device) for f in u.full
            ]  # the parameters own the storages now
