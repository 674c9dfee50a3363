"""How a gradient bucket's reduce-scatter goes on the wire: exactly, or block-quantized to int8
(ZeRO++'s qgZ, ``zero_quantized_gradients: true``).

The bucket is ``ranks`` rows of ``width`` elements, row ``j`` the part of the gradients that
rank ``j``'s shard holds. A codec says how those rows become this rank's summed row:

- :class:`ExactReduce` (the default): one reduce-scatter in the bucket's reduce dtype.
- :class:`Int8Reduce`: each row is block-quantized (``comm/quantize.py``: int8 and one fp32
  scale per 256 elements) into one row of bytes per destination rank, the rows are exchanged
  with one all-to-all (rank ``j`` receives every rank's bytes of its own row), and the receiver
  dequantizes them and sums them in fp32, in rank order (the same result whichever rank sums).
  A row's bytes are its ``width`` int8 values (the last block's padding is not sent) and one
  fp32 scale per block: ``(256 + 4) / 1024`` = 0.254 of the fp32 reduce-scatter's bytes (0.51 of
  a 16-bit one), a little more for a row shorter than a block.

Numerics: every rank's contribution is rounded to within ``absmax / 254`` of its block's
largest magnitude before the sum (the error is a sum of ``ranks`` such roundings, not exact as
the reduce-scatter is; docs/advanced.md states the measured contract against DDP). A block
holding a NaN or inf dequantizes to non-finite values, so the sum is non-finite where the
exact sum would be, and fp16's overflow check still skips the step.

Hierarchy: with shard groups (``runtime/shard_groups.py``) the quantized all-to-all runs within
the shard group, and the fp32 shard it gives is then all-reduced across the replicas exactly, as
with the exact codec. ZeRO++ quantizes its inter-node hop again; here the replica hop moves one
shard (``1/shard_size`` of the bucket) and is left exact, so each gradient is rounded once, and
the error does not grow with the number of replicas.

Only the sharded reductions use the codec: an MoE experts unit's selected rows
(``sharding/experts/selective.py``) and the full all-reduce without an optimizer
(``AllReduceAtEnd``) stay exact; top-k compression (``compression.py``) is refused with it by the
config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.comm import quantize

__all__ = ["EXACT", "Exchange", "ExactReduce", "GradCodec", "Int8Reduce", "grad_codec", "row_bytes"]


@dataclass
class Exchange:
    """A bucket's reduction in flight: ``handle`` fills ``got``; ``sent`` (if any) is the codec's
    send buffer, kept until the wait."""

    handle: C.Handle
    got: torch.Tensor
    sent: torch.Tensor | None = None


def row_bytes(width: int) -> int:
    """The bytes of one row of ``width`` elements on the wire: int8 values (no padding), then
    fp32 scales (``quantize.pack`` with ``padded=False``)."""
    return quantize.packed_bytes(width, padded=False)


@dataclass(frozen=True)
class GradCodec:
    """The exact reduce-scatter (see the module docstring)."""

    lossy = False

    def launch(self, ctx: C.CommContext, inp: torch.Tensor, width: int, *, what: str) -> Exchange:
        """Start reducing ``inp`` (``ranks * width``, rank-major). After ``handle.wait()``,
        :meth:`combine` gives this rank's summed row."""
        # one rank: its row is the whole input, reduced in place (no copy)
        out = inp if ctx.world_size == 1 else ctx.pool.get(width, inp.dtype, inp.device)
        return Exchange(C.reduce_scatter(ctx, out, inp, what=what), out)

    def combine(self, ctx: C.CommContext, x: Exchange, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's summed row (``width`` elements of ``dtype``, from the pool) after the wait."""
        return x.got


@dataclass(frozen=True)
class ExactReduce(GradCodec):
    pass


@dataclass(frozen=True)
class Int8Reduce(GradCodec):
    """qgZ: int8 blocks in one all-to-all, dequantized and summed in fp32 by the receiver."""

    lossy = True

    def launch(self, ctx: C.CommContext, inp: torch.Tensor, width: int, *, what: str) -> Exchange:
        n, row = ctx.world_size, row_bytes(width)
        send = ctx.pool.get(n * row, torch.uint8, inp.device)
        rows = inp.view(n, width)
        for j in range(n):  # one row of bytes per destination rank
            quantize.pack(rows[j], send[j * row : (j + 1) * row], padded=False)
        got = ctx.pool.get(n * row, torch.uint8, inp.device)
        return Exchange(C.all_to_all(ctx, got, send, what=f"{what}, int8"), got, send)

    def combine(self, ctx: C.CommContext, x: Exchange, width: int, dtype: torch.dtype) -> torch.Tensor:
        n, got = ctx.world_size, x.got
        if x.sent is not None:
            ctx.pool.put(x.sent)
        # fp32 [ranks, width]: every rank's piece of my row
        parts = quantize.unpack(got.view(n, -1), width, padded=False)
        total = parts[0].clone()
        for r in range(1, n):  # in rank order: the same sum on every rank
            total.add_(parts[r])
        ctx.pool.put(got)
        out = ctx.pool.get(width, dtype, got.device)
        out.copy_(total)
        return out


EXACT = ExactReduce()


def grad_codec(quantized: bool) -> GradCodec:
    """The codec of the sharded gradient reductions (``zero_quantized_gradients``)."""
    return Int8Reduce() if quantized else EXACT
