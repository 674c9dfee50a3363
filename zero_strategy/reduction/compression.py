"""Top-k gradient compression with error feedback (ZeRO-1 and ZeRO-2).

Dense reduction sends every gradient element: a reduce-scatter of the whole bucket. Top-k
sends only the largest ones and keeps the rest for later:

- Each rank keeps a *residual* ``e`` of the full flattened model (4 bytes per parameter,
  **not** sharded: every rank's own unsent gradient; laid out in the padded rows below, so
  under load balancing it is ``world`` times the largest piece: 6 bytes per parameter at 3:1 on
  2 ranks). At each reduction of a bucket the rank
  forms the compensated gradient ``c = e + g / (world * loss_scale)`` (its share of the
  averaged gradient plus what it has not sent yet).
- ``c`` is laid out like the bucket's reduce-scatter input: one row per destination rank, the
  row being that rank's shard (``layout.py``). From each row the ``k = ceil(ratio * row)``
  entries of largest magnitude are chosen (top-k per destination, so every rank sends exactly
  ``k`` pairs to every other rank: equal-size exchange, no size negotiation, no host sync).
- The chosen (index, value) pairs go to their destination in one all-to-all of bytes (int32
  indices, int64 for a row longer than int32 reaches); each
  rank adds what it receives into its gradient shard, which is then the average of what every
  rank sent. What was sent (after rounding to the wire dtype) is subtracted from ``c``; the
  rest is the new residual, so *sent + residual = dense compensated gradient* exactly.
- A parameter without a gradient on this rank in the window sends nothing (its residual waits);
  so a parameter no rank used gets no update, as under DDP.

Bytes per bucket: ``world * k * (4 + value bytes)`` against the dense ``world * row * 4``, that
is about ``2 * ratio`` of dense for fp32 values. ``ratio=1.0`` sends everything: DDP's numbers.
This is already Ok-Topk's split-and-reduce (Li and Hoefler, 2022): each rank sends ``ratio`` of
its elements in all, whatever the world size, and receives pairs only for the region (shard) it
owns; the sparse all-gather of Ok-Topk's second half is ZeRO's dense parameter all-gather.
``region_indices``: each row is cut into regions of ``REGION`` = 32,768 columns and ``k`` pairs
are chosen per region, so an index is an int16 offset inside its region (its region is known
from its position): 2 index bytes instead of 4, a quarter fewer bytes with fp32 values and a
third fewer with 16-bit ones; the price is that the largest entries are chosen per region, not
per row (error feedback delivers the rest later), and ``k`` is rounded up per region.

``global_threshold``: one threshold over the whole bucket instead of one per row. Each rank
chooses the ``world * k`` entries of largest magnitude of its whole compensated ``[world, row]``
bucket (the same flat top-k as per row, on the bucket seen as one row), so a destination whose
shard holds more of the large entries gets more pairs, and one that holds none gets none. The
bytes are those of the per-row choice (plus ``8 * world`` bytes of counts), but the exchange is
uneven: the ranks first exchange how many pairs each sends to each (a small all-to-all, waited
for on the host, so the pair exchange can size its buffers), then the pairs in one uneven
all-to-all (``all_to_all_v``). Error feedback is unchanged: sent + residual = compensated. With
the default 4M-element reduce buckets a small model is one bucket: the threshold is then over
every gradient element of the rank. Refused with ``region_indices`` (which chooses per region).

Deep Gradient Compression's (Lin et al., 2018) techniques, each chosen in ``CompressionConfig``:

- sparsity warm-up (``warmup: exponential``, the default): the ``warmup_steps`` first optimizer
  steps send 25%, 6.25%, 1.56%, ... of each row (:meth:`CompressionConfig.ratio_at`), then
  ``ratio``; ``warmup: dense`` reduces them uncompressed instead (no residual yet).
- momentum correction (``momentum``): each rank keeps a *velocity* ``u = momentum * u + c`` of
  its gradient share (one more ``[world, row]`` tensor per bucket) and adds ``u``, not the
  gradient, to the residual; the exchanged update is the velocity, and the user's SGD steps with
  ``momentum=0`` on it. At ratio 1.0 with ``momentum_masking: false`` that is DDP's SGD with momentum (masking zeroes the velocity after each send). Momentum factor masking
  (``momentum_masking``) zeroes the velocity of every sent element.
- local clipping (``local_clip``): the buckets of a reduction are held until all are packed
  (no overlap with the backward), each rank's share is scaled to a norm of at most
  ``local_clip / sqrt(world)``, then they are compressed and exchanged.

fp16: a step whose gradients overflowed is skipped, and the residuals, which hold the same
infinities, start again from zero. A NaN or inf is always chosen first and sent, so the
receiver's overflow check sees it. With a 16-bit ``communication_data_type`` the values travel
in 16 bits at the magnitude DDP's compress hooks send (the loss-scaled gradient divided by the
world size, before the cast), are summed in the master dtype, and their rounding stays in the
residual; so at ratio 1.0 the numbers are those of a 16-bit wire with an fp32 sum, not of
DDP's 16-bit sum. A value held back for many steps can outgrow the 16-bit range where no
gradient did: a finite value is sent saturated to the wire dtype's largest, and the excess
stays in the residual (only a real inf or NaN arrives as one).

The residuals are in the master dtype (4 bytes per parameter in fp32), on the device the
gradients are reduced on (also with an offloaded optimizer), allocated at the first compressed
step. Each received row is added in rank order, one source at a time: the sum is the same on
every run, on a GPU too.

Checkpoints save the residuals (and the velocities, ``compression.velocity.world<N>.<fqn>``)
in parameter coordinates (``compression.world<N>.<fqn>``: every
rank's residual of the parameter side by side, :meth:`ErrorFeedback.checkpoint_pieces`), so
they follow their elements into other buckets or another load-balance split, and a resumed run
with the same buckets and split continues exactly. Loaded at another world size they cannot be
placed (each rank's residual is its own unsent gradient): they start from zero (a warning says
so), which drops at most the gradient mass not yet sent, as a fresh start of error feedback does.

The frozen-variance Adam mode (``optimizer: adam``; 1-bit Adam and 0/1 Adam's idea, with top-k
in place of their sign): the ``warmup_steps`` first steps are dense and the engine runs AdamW's
moments on each rank's shard (``runtime/compressed_adam.py``). From then on the variance ``v``
is frozen, and every rank holds the whole model's preconditioner ``1 / (sqrt(v_hat) + eps)``
(one all-gather of the owners' rows at the first compressed step, again after each
``variance_refresh`` step; one more ``[world, row]`` tensor per bucket). Each rank's velocity is ``u = beta1 * u + (1 - beta1) * g / (sqrt(v_hat) +
eps)`` (its share of Adam's momentum, already normalised), which goes through error feedback
as under momentum correction; so top-k picks the largest *updates*, not the largest gradients,
and sent + residual = residual + new velocity still holds. The owner adds what it receives to
the decaying momentum left from the dense steps and divides by Adam's bias correction. With
``owner_momentum`` the ranks keep no velocity: each sends its normalised gradient share through
error feedback and the owner keeps the momentum of what it received (``compressed_adam.py``).

ZeRO-3 reduces each unit's gradients while its backward runs; top-k is refused there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.config.comm import CompressionConfig
from zero_strategy.sharding.group import ShardGroup

__all__ = [
    "ErrorFeedback",
    "by_destination",
    "SparseExchange",
    "build_compression",
    "index_dtype",
    "select_top_k",
]

_INT32_MAX = 2**31 - 1  # the largest column index int32 carries
REGION = 2**15  # region_indices: the columns of a region, so an offset inside it fits in int16
Piece = tuple[int, torch.Tensor]  # (offset in the flat checkpoint tensor, a view of the residual)


def index_dtype(row: int) -> torch.dtype:
    """The dtype of a bucket's column indices on the wire: int32 while a row's last index fits in
    it, int64 for rows longer than that (so an index never wraps)."""
    return torch.int32 if row - 1 <= _INT32_MAX else torch.int64


def select_top_k(
    residual: torch.Tensor,
    packed: torch.Tensor,
    factor: float,
    k: int,
    skip: Sequence[tuple[int, int]],
    wire_dtype: torch.dtype,
    wire_scale: float = 1.0,
    index: torch.dtype = torch.int32,
    velocity: torch.Tensor | None = None,
    momentum: float = 0.0,
    masking: bool = False,
    fresh: bool = True,
    region: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``factor * packed`` to ``residual`` (both ``[world, row]``), choose the ``k`` entries
    of largest magnitude in each row outside the ``skip`` column ranges, and take what is sent
    out of the residual. Returns the chosen column indices (``index`` dtype) and values, both
    ``[world, k]``: the values times ``wire_scale`` in ``wire_dtype``, a finite value beyond the
    wire dtype's range saturated to its largest (the excess stays in the residual). Afterwards
    ``residual`` + sent (divided by ``wire_scale`` again) = the compensated gradient, rounding
    included. A NaN or inf is chosen first and sent, so the receiver's overflow check sees it.

    With ``velocity`` (DGC's momentum correction): first ``velocity = momentum * velocity +
    factor * packed`` outside the ``skip`` columns (a parameter without a gradient keeps its
    velocity, as torch's SGD leaves a parameter without ``.grad`` alone), and the velocity, not
    the gradient, is added to the residual. ``masking``: the velocity of every sent entry is
    zeroed (momentum factor masking). ``fresh`` False: a later reduction of the same optimizer
    step (gradient accumulation that reduces each micro-step): the velocity was decayed once
    already, so ``velocity += factor * packed`` and the residual gains that increment.

    ``region`` (``region_indices``): each row is cut into regions of ``region`` columns (the last
    one shorter) and the ``k`` largest of *each region* are chosen (:func:`region_counts`: the
    last region its share of ``k``), region after region; the indices returned are then offsets inside their region
    (:func:`region_offsets` gives them back their column)."""
    blocked = torch.zeros(residual.shape[1], dtype=torch.bool, device=residual.device)
    for lo, hi in skip:
        blocked[lo:hi] = True
    if velocity is None:
        residual.add_(packed, alpha=factor)
    elif not fresh:  # packed is zero in the skipped columns
        velocity.add_(packed, alpha=factor)
        residual.add_(packed, alpha=factor)
    else:
        moved = velocity.mul(momentum).add_(packed, alpha=factor)
        velocity.copy_(torch.where(blocked, velocity, moved))
        residual.add_(torch.where(blocked, torch.zeros((), dtype=moved.dtype, device=moved.device), velocity))
    score = residual.abs()
    for lo, hi in skip:
        score[:, lo:hi] = -1.0
    idx = _top_k(score, k, region)
    chosen = residual.gather(1, idx)
    zero = torch.zeros((), dtype=chosen.dtype, device=chosen.device)
    values = torch.where(blocked[idx], zero, chosen)
    scaled = values * wire_scale if wire_scale != 1.0 else values
    top = torch.finfo(wire_dtype).max
    if top < torch.finfo(scaled.dtype).max:  # saturate what would overflow the narrower wire
        scaled = torch.where(torch.isfinite(scaled), scaled.clamp(-top, top), scaled)
    wire = scaled.to(wire_dtype)
    back = wire.to(residual.dtype) / wire_scale if wire_scale != 1.0 else wire.to(residual.dtype)
    residual.scatter_(1, idx, chosen - back)  # what was not sent (or rounded off) stays
    if velocity is not None and masking:  # a blocked column sent nothing: its velocity stays
        velocity.scatter_(1, idx, torch.where(blocked[idx], velocity.gather(1, idx), zero))
    if region:
        idx = idx - region_offsets(residual.shape[1], region, k, idx.device)
    return idx.to(index), wire


def region_counts(row: int, region: int, k: int) -> list[tuple[int, int]]:
    """(width, pairs) of each region of a row of ``row`` columns: ``k`` pairs from each full
    region of ``region`` columns, and from the last, shorter one its share ``k * width /
    region`` (rounded up: at least one, all of it when ``k`` is the whole region)."""
    full, last = divmod(row, region)
    k = min(k, region)
    return [(region, k)] * full + ([(last, min(last, max(1, -(-k * last // region))))] if last else [])


def region_offsets(row: int, region: int, k: int, device: torch.device) -> torch.Tensor:
    """The first column of the region of each chosen pair (int64), in the order
    :func:`select_top_k` returns them."""
    counts = region_counts(row, region, k)
    full = row // region  # the full regions, ``counts[0][1]`` pairs each; then the shorter one's
    parts = (
        [torch.arange(full * counts[0][1], dtype=torch.int64, device=device) // counts[0][1] * region] if full else []
    )
    if len(counts) > full:
        parts.append(torch.full((counts[-1][1],), full * region, dtype=torch.int64, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # from host integers: no copy, no wait


def _top_k(score: torch.Tensor, k: int, region: int) -> torch.Tensor:
    """The columns of the ``k`` largest scores of each row (``region``: of each region)."""
    if not region:
        return torch.topk(score, k, dim=1, sorted=False).indices
    row = score.shape[1]
    full = row // region * region
    parts = []
    if full:
        n = score.shape[0]
        local = torch.topk(score[:, :full].reshape(n, -1, region), min(k, region), dim=2, sorted=False).indices
        starts = torch.arange(0, full, region, device=score.device).view(1, -1, 1)
        parts.append((local + starts).reshape(n, -1))
    if full < row:
        last = region_counts(row, region, k)[-1][1]
        parts.append(torch.topk(score[:, full:], last, dim=1, sorted=False).indices + full)
    return torch.cat(parts, dim=1)


def by_destination(
    idx: torch.Tensor, values: torch.Tensor, row: int, world: int, index: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``global_threshold``: the pairs chosen from a bucket seen as one row (``idx``: flat int64
    positions in ``[world, row]``) grouped by destination rank: their columns (``index`` dtype)
    and values, ordered by destination then column, and the count for each destination (int64
    ``[world]``)."""
    order = torch.argsort(idx)
    idx, values = idx[order], values[order]
    dest = idx // row
    return (idx - dest * row).to(index), values, torch.bincount(dest, minlength=world)


class SparseExchange:
    """One bucket's (index, value) exchange in flight; :meth:`finish` gives the summed shard."""

    def __init__(self, ctx: C.CommContext, g: ShardGroup, k: int, wire: torch.dtype, wire_scale: float,
                 index: torch.dtype, send: torch.Tensor, recv: torch.Tensor, handle: C.Handle,
                 offsets: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:  # fmt: skip
        self.ctx, self.group, self.k, self.wire, self.wire_scale = ctx, g, k, wire, wire_scale
        self.index, self.offsets = index, offsets  # offsets: region_indices' region starts
        self.send, self.recv, self.handle = send, recv, handle
        # the pairs received from each rank: ``k`` each, or (global_threshold) as many as it sent
        self.counts = list(counts) if counts is not None else [k] * ctx.world_size

    def finish(self) -> torch.Tensor:
        """Wait, then add every rank's values for this rank's shard into a zeroed scratch row
        (returned; the caller gives it back to the pool)."""
        self.handle.wait()
        g = self.group
        out = self.ctx.pool.get(g.layout.shard_numel, g.master_dtype, g.device)
        out.zero_()
        isz, start = self.index.itemsize, 0
        for c in self.counts:  # one source rank at a time, in rank order: its indices are distinct,
            chunk = self.recv[start : start + c * (isz + self.wire.itemsize)]  # so no two additions
            start += chunk.numel()  # race, on a GPU either
            idx = chunk[: c * isz].clone().view(self.index).to(torch.int64)
            if self.offsets is not None:
                idx += self.offsets
            values = chunk[c * isz :].clone().view(self.wire).to(g.master_dtype)
            if self.wire_scale != 1.0:
                values.div_(self.wire_scale)
            out.index_add_(0, idx, values)
        self.ctx.pool.put(self.send)
        self.ctx.pool.put(self.recv)
        return out


class ErrorFeedback:
    """Each rank's residuals of top-k compression, one ``[world, row]`` tensor per bucket."""

    def __init__(
        self, config: CompressionConfig, groups: Sequence[ShardGroup], ctx: C.CommContext, steps: Callable[[], int]
    ) -> None:
        self.config = config
        self.groups = list(groups)
        self.ctx = ctx
        self._steps = steps  # optimizer steps done (the engine's count)
        self.residuals: dict[int, torch.Tensor] = {}  # group index -> [world, row], once compression started
        # group index -> [world, row]: each rank's SGD velocity (momentum correction), or none
        self.velocities: dict[int, torch.Tensor] = {}
        self._decayed: dict[int, int] = {}  # group index -> the optimizer step its velocity was decayed at
        # local clipping: group index -> (packed gradients, columns without a gradient), held until
        # every bucket of the reduction is packed (the clip needs the whole local norm)
        self.held: dict[int, tuple[torch.Tensor, set[int]]] = {}
        self.last_local_norm: float | None = None  # this rank's local norm at the last clipped reduction
        # the Adam mode: this rank's row of the preconditioner of a group (its shard, from the frozen
        # variance; set by the engine), and every rank's rows of it, gathered at the first use
        self.precondition: Callable[[ShardGroup], torch.Tensor] | None = None
        self.preconditioners: dict[int, torch.Tensor] = {}

    def ratio(self) -> float:
        """This step's share of elements sent (the sparsity warm-up's ramp, then ``ratio``)."""
        return self.config.ratio_at(self._steps())

    def k(self, g: ShardGroup) -> int:
        """The pairs chosen per row (``region_indices``: per full region of a row; a shorter last
        region, or a row shorter than a region, sends its share, :func:`region_counts`)."""
        width = REGION if self.config.region_indices else g.layout.shard_numel
        return max(1, min(width, math.ceil(self.ratio() * width)))

    def pairs(self, g: ShardGroup) -> int:
        """The pairs each rank sends to each destination for ``g`` this step."""
        if not self.config.region_indices:
            return self.k(g)
        return sum(c for _, c in region_counts(g.layout.shard_numel, REGION, self.k(g)))

    def active(self) -> bool:
        """Whether this step's reductions are compressed (all but ``warmup: dense``'s warm-up
        steps and the Adam mode's variance refresh steps); the residuals of every bucket exist from the first compressed step on (the same
        on every rank)."""
        if self.config.dense_at(self._steps()):
            return False
        if not self.residuals:
            self.allocate()
        return True

    def allocate(self) -> None:
        n = self.ctx.world_size
        with torch.inference_mode(False):
            for g in self.groups:
                if g.index not in self.residuals:
                    self.residuals[g.index] = torch.zeros(
                        n, g.layout.shard_numel, dtype=g.master_dtype, device=g.device
                    )
                if self.config.decay > 0 and g.index not in self.velocities:
                    self.velocities[g.index] = torch.zeros_like(self.residuals[g.index])

    def tensors(self) -> list[torch.Tensor]:
        """The residuals and velocities (``memory_stats()`` counts them as ``residuals``)."""
        return [*self.residuals.values(), *self.velocities.values()]

    def reset(self) -> None:
        """Residuals and velocities back to zero (an fp16 step that overflowed: they hold its
        infinities)."""
        for r in (*self.residuals.values(), *self.velocities.values()):
            r.zero_()
        self.preconditioners.clear()  # gathered again from the optimizer state at the next compressed step

    def preconditioner(self, g: ShardGroup, what: str) -> torch.Tensor:
        """The Adam mode's ``[world, row]`` preconditioner of ``g``: every rank's row of it, from
        the frozen variance, gathered once (a collective, at the same reduction on every rank)."""
        pre = self.preconditioners.get(g.index)
        if pre is not None:
            return pre
        if self.precondition is None:
            raise RuntimeError(
                "compression.optimizer: adam: no optimizer is bound to the engine to hold Adam's variance; "
                "initialize(model, optimizer) with torch.optim.SGD(params, lr, momentum=0)"
            )
        n = self.ctx.world_size
        with torch.inference_mode(False):
            pre = torch.zeros(n, g.layout.shard_numel, dtype=g.master_dtype, device=g.device)
            mine = pre[self.ctx.rank]
            mine.copy_(self.precondition(g))
            C.all_gather(self.ctx, pre.view(-1), mine, what=f"Adam preconditioner of {g.name} ({what})").wait()
        self.preconditioners[g.index] = pre
        return pre

    def launch(
        self, g: ShardGroup, packed: torch.Tensor, factor: float, skip: Sequence[int], what: str
    ) -> SparseExchange:
        """Compress ``packed`` (the bucket's full local gradients, rank-major, in the master
        dtype; free to reuse on return) into the residual and send the chosen pairs."""
        n, lay, k = self.ctx.world_size, g.layout, self.k(g)
        residual = self.residuals[g.index]
        cols = [(lay.offsets[i], lay.offsets[i] + lay.chunks[i]) for i in skip]
        # a 16-bit wire carries what DDP's compress hooks send: the loss-scaled gradient / world
        scale = 1.0 / (factor * n) if g.reduce_dtype in (torch.float16, torch.bfloat16) else 1.0
        if self.config.adam:  # Adam's normalised momentum: values near 1, sent as they are
            packed.view(n, -1).mul_(self.preconditioner(g, what))
            factor, scale = factor * (1.0 - self.config.beta1), 1.0
        region = REGION if self.config.region_indices else 0
        index = torch.int16 if region else index_dtype(lay.shard_numel)
        step = self._steps()
        fresh = self._decayed.get(g.index) != step  # the step's first reduction of this bucket
        self._decayed[g.index] = step
        if self.config.global_threshold:
            return self._launch_global(g, residual, packed, factor, n * k, cols, scale, fresh, what)
        idx, values = select_top_k(residual, packed.view(n, -1), factor, k, cols, g.reduce_dtype, scale, index,
                                   self.velocities.get(g.index), self.config.decay, self.config.momentum_masking,
                                   fresh, region)  # fmt: skip
        k = idx.shape[1]  # with regions: the pairs of all regions of a row
        cut = k * idx.element_size()
        width = cut + k * values.element_size()
        send = self.ctx.pool.get(n * width, torch.uint8, g.device).view(n, width)
        send[:, :cut].copy_(idx.view(torch.uint8))
        send[:, cut:].copy_(values.view(torch.uint8))
        recv = self.ctx.pool.get(n * width, torch.uint8, g.device)
        handle = C.all_to_all(self.ctx, recv, send.view(-1), what=f"top-k {what}")
        offsets = region_offsets(lay.shard_numel, region, self.k(g), g.device) if region else None
        return SparseExchange(self.ctx, g, k, g.reduce_dtype, scale, index, send, recv, handle, offsets)

    def _launch_global(self, g: ShardGroup, residual: torch.Tensor, packed: torch.Tensor, factor: float,
                       total: int, cols: Sequence[tuple[int, int]], scale: float, fresh: bool,
                       what: str) -> SparseExchange:  # fmt: skip
        """``global_threshold``: the ``total`` largest entries of the whole bucket (the bucket
        seen as one row of ``world * row`` columns), sent to their rows' ranks in one uneven
        all-to-all after an exchange of the counts."""
        n, row = self.ctx.world_size, g.layout.shard_numel
        flat = [(j * row + lo, j * row + hi) for j in range(n) for lo, hi in cols]
        velocity = self.velocities.get(g.index)
        idx, values = select_top_k(residual.view(1, -1), packed.view(1, -1), factor, total, flat, g.reduce_dtype,
                                   scale, torch.int64, None if velocity is None else velocity.view(1, -1),
                                   self.config.decay, self.config.momentum_masking, fresh)  # fmt: skip
        index = index_dtype(row)
        columns, values, counts = by_destination(idx[0], values[0], row, n, index)
        got = torch.empty_like(counts)
        C.all_to_all(self.ctx, got, counts, what=f"top-k counts {what}").wait()
        sent, received = counts.tolist(), got.tolist()  # the host needs the sizes: one wait per bucket
        pair = index.itemsize + values.element_size()
        send = self.ctx.pool.get(sum(sent) * pair, torch.uint8, g.device)
        start = at = 0
        for c in sent:  # per destination: its columns, then its values
            send[at : at + c * index.itemsize].copy_(columns[start : start + c].view(torch.uint8))
            send[at + c * index.itemsize : at + c * pair].copy_(values[start : start + c].view(torch.uint8))
            start, at = start + c, at + c * pair
        recv = self.ctx.pool.get(sum(received) * pair, torch.uint8, g.device)
        handle = C.all_to_all_v(self.ctx, recv, send, [c * pair for c in sent], [c * pair for c in received],
                                what=f"top-k {what} (global threshold)")  # fmt: skip
        return SparseExchange(self.ctx, g, total, g.reduce_dtype, scale, index, send, recv, handle,
                              counts=received)  # fmt: skip

    # -- local clipping (DGC) ----------------------------------------------------------------
    def hold(self, g: ShardGroup, packed: torch.Tensor, skip: Sequence[int]) -> None:
        """Keep ``packed`` (the bucket's local gradients, from the pool; this takes it) until
        :meth:`release`; a second reduction of the bucket before then adds into it."""
        if g.index in self.held:
            mine, none = self.held[g.index]
            mine.add_(packed)
            self.ctx.pool.put(packed)
            self.held[g.index] = (mine, none & set(skip))
        else:
            self.held[g.index] = (packed, set(skip))

    def release(self, factor: float, what: Callable[[ShardGroup], str]) -> list[tuple[ShardGroup, SparseExchange]]:
        """DGC's local gradient clipping, then the exchanges of every held bucket: this rank's
        share of the averaged gradient (``factor * packed`` over all held buckets) is scaled to
        a norm of at most ``local_clip / sqrt(world)``, so the sum over ranks stays near
        ``local_clip`` as for independent gradients. A non-finite norm (an fp16 overflow) is
        left unscaled, so the overflow check sees it."""
        if not self.held:
            return []
        held = sorted(self.held.items())
        self.held = {}
        total = torch.zeros((), dtype=torch.float64, device=held[0][1][0].device)
        for _, (packed, _none) in held:
            total += packed.to(torch.float64).pow(2).sum()
        norm = float(total.sqrt()) * abs(factor)  # the clip's one host read
        self.last_local_norm = norm
        limit = float(self.config.local_clip or 0.0) / math.sqrt(self.ctx.world_size)
        coef = limit / (norm + 1e-6) if math.isfinite(norm) and norm > limit else 1.0
        out = []
        for index, (packed, none) in held:
            g = self.groups[index]
            out.append((g, self.launch(g, packed, factor * coef, sorted(none), what(g))))
            self.ctx.pool.put(packed)
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_pieces(self, fqn: Callable[[torch.Tensor], str]) -> dict[str, tuple[int, list[Piece]]]:
        """Checkpoint name -> (global numel, this rank's pieces) for every parameter's residual, in
        parameter coordinates: ``compression.world<N>.<fqn>`` is a flat tensor of ``N * numel``
        elements holding rank ``s``'s residual of the parameter at ``s * numel``. This rank's
        part of it sits in its ``[world, row]`` residual as one piece per destination rank: the
        parameter's columns of that row, padding left out. Pieces are views, so a save reads and
        a load writes the residuals in place, and a load under other buckets or another
        load-balance split puts every element where that layout keeps it. Empty before the
        first compressed step; a parameter without elements has no entry."""
        n, me, out = self.ctx.world_size, self.ctx.rank, {}
        for prefix, state in (("compression", self.residuals), ("compression.velocity", self.velocities)):
            for g in self.groups:
                r = state.get(g.index)
                if r is None:
                    continue
                lay = g.layout
                for i, p in enumerate(g.params):
                    b, off, numel = lay.bounds[i], lay.offsets[i], lay.numels[i]
                    if numel == 0:
                        continue
                    pieces = [
                        (me * numel + b[d], r[d, off : off + b[d + 1] - b[d]]) for d in range(n) if b[d + 1] > b[d]
                    ]
                    out[f"{prefix}.world{n}.{fqn(p)}"] = (n * numel, pieces)
        return out


def build_compression(
    config: CompressionConfig, groups: Sequence[ShardGroup], ctx: C.CommContext, *, steps: Callable[[], int]
) -> ErrorFeedback | None:
    """The error-feedback state for ``config`` (None without compression); the engine refused
    what top-k cannot do (ZeRO-3: ``ZeroConfig.conflicts``) before it changed anything."""
    return ErrorFeedback(config, groups, ctx, steps) if config.enabled else None
