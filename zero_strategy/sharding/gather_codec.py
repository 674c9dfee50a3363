"""What a ZeRO-3 parameter gather puts on the wire: the unit's rows as they are, cast to 16 bits,
or block-quantized to int8 (ZeRO++'s qwZ).

Each rank sends one slot: its persistent rows (trainable, then frozen) and the unit's tag
(``gather_checks.py``), in one all-gather. A codec says how the slot is written and read:

- :class:`Exact` (the default): the rows in the unit's compute dtype (fp32, or the 16-bit
  ``param_dtype``); the gathered parameters are the shards' values.
- :class:`Cast` (``gather_dtype: bf16|fp16`` with fp32 parameters, for mixed precision): the rows
  cast to 16 bits, half the bytes of fp32; the gathered parameters keep their fp32 dtype and
  hold the 16-bit values. Under autocast a matmul casts its fp32 weight to the same 16 bits
  anyway, so only what autocast leaves in fp32 (embeddings, norms, biases added outside a
  linear) sees rounded weights; gradients are fp32 and reduced into the fp32 shard as before.
- :class:`Int8` (``zero_quantized_weights: true``): the rows block-quantized
  (``comm/quantize.py``: int8 and an fp32 scale per 256 elements, 0.254 of fp32's bytes) and
  dequantized into the unit's dtype on arrival. The slot is padded to a multiple of 4 bytes so
  every rank's scales are fp32-aligned in the gathered buffer, one rank included.

The lossy codecs serve the forward's and backward's gathers only. ``gathered_parameters``
(which a user reads and may write through), the persistent units (small, never partitioned for
their readers) and ``destroy`` gather exactly, so the fp32 shard, the master, is never written
from a rounded copy.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_strategy.comm import quantize
from zero_strategy.sharding.gather_checks import TAG, write_tag

__all__ = ["Cast", "CodecSettings", "Exact", "GatherCodec", "Int8", "gather_codec"]


class CodecSettings(Protocol):
    """What :func:`gather_codec` reads of a config (``ZeroConfig`` has these)."""

    @property
    def zero_quantized_weights(self) -> bool: ...
    @property
    def gather_dtype(self) -> torch.dtype | None: ...


class GatherCodec:
    """How a unit's slot is written and read (see the module docstring); the exact one."""

    lossy = False

    def wire_dtype(self, unit_dtype: torch.dtype) -> torch.dtype:
        return unit_dtype

    def slot_numel(self, shard_numel: int) -> int:
        """Elements of the wire dtype one rank sends, the tag included."""
        return shard_numel + TAG

    def encode(
        self, slot: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], tag: int, *, non_blocking: bool = False
    ) -> None:
        """Write this rank's ``rows`` (trainable, frozen) and ``tag`` into ``slot``; ``non_blocking``:
        rows in pinned host memory are copied without a host wait (a feed fences them, ``storage/uploads.py``)."""
        t, f = rows[0].numel(), rows[1].numel()
        slot[:t].copy_(rows[0], non_blocking=non_blocking)  # cast to the wire dtype
        slot[t : t + f].copy_(rows[1], non_blocking=non_blocking)
        write_tag(slot, slot.numel() - TAG, tag)

    def decode(self, gathered: torch.Tensor, shard_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's values (``[ranks, >= shard_numel]``, copied into the full parameters)
        and tag digits (``[ranks, TAG]``) from the gathered ``[ranks, slot]``."""
        return gathered, gathered[:, -TAG:]


class Exact(GatherCodec):
    pass


class Cast(GatherCodec):
    """The rows cast to a 16-bit ``dtype`` on the wire; the tag's base-256 digits stay exact."""

    lossy = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def wire_dtype(self, unit_dtype: torch.dtype) -> torch.dtype:
        return self.dtype


class Int8(GatherCodec):
    """Block-quantized int8 rows and fp32 scales, then the tag, as bytes."""

    lossy = True

    def wire_dtype(self, unit_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def slot_numel(self, shard_numel: int) -> int:
        """Rounded up to a multiple of 4 bytes: every rank's scales then start 4-byte aligned in
        the gathered buffer (``quantize.unpack`` reads them in place at any world size)."""
        return -(-(quantize.packed_bytes(shard_numel) + TAG) // 4) * 4

    def encode(
        self, slot: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], tag: int, *, non_blocking: bool = False
    ) -> None:
        if non_blocking:  # rows in pinned host memory: copied first, quantized on the device (no host block)
            rows = (rows[0].to(slot.device, non_blocking=True), rows[1].to(slot.device, non_blocking=True))
        flat = torch.cat([rows[0].reshape(-1), rows[1].reshape(-1).to(rows[0].dtype)])
        quantize.pack(flat, slot)
        slot[quantize.packed_bytes(flat.numel()) : slot.numel() - TAG].zero_()  # the alignment's bytes
        write_tag(slot, slot.numel() - TAG, tag)

    def decode(self, gathered: torch.Tensor, shard_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize.unpack(gathered, shard_numel), gathered[:, -TAG:].float()


EXACT = Exact()


def gather_codec(config: CodecSettings) -> GatherCodec:
    """The codec of ZeRO-3's forward and backward gathers under ``config`` (its conflicts, such as
    ``gather_dtype`` with 16-bit parameters, are refused by the config itself)."""
    if config.zero_quantized_weights:
        return Int8()
    if config.gather_dtype is not None:
        return Cast(config.gather_dtype)
    return EXACT
