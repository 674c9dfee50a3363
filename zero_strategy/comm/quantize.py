"""Block-quantized int8: the kernels of ZeRO++'s quantized collectives (qwZ, qgZ).

A flat tensor is cut into blocks of ``BLOCK`` = 256 elements (the last one zero-padded). Each
block keeps one fp32 scale, ``absmax / 127``, and its elements as symmetric int8,
``round(x / scale)`` in [-127, 127]; dequantized, an element is ``q * scale``, within half a
step, ``absmax / 254``, of its value (0.4% of the block's largest magnitude). A block of zeros
has scale 0 and dequantizes to zeros. A NaN or inf in a block makes its scale NaN or inf, so
the whole block dequantizes to non-finite values: an overflow is never hidden.

On the wire a block is 256 int8 bytes and a 4-byte scale: ``(256 + 4) / 1024`` = 0.254 of its
fp32 bytes. :func:`pack` writes the int8 values and the scales of a tensor into one uint8
buffer, so one collective moves both; :func:`unpack` reads every rank's row of such buffers.
Two layouts: ``padded=True`` (qwZ's gathers) writes the last block's zero padding, so the int8
values fill whole blocks; ``padded=False`` (qgZ's all-to-all) sends only the ``numel`` values,
then the scales, and the reader pads the last block back with zeros. Both dequantize alike.
The scales are read as fp32 in place where their offset and the rows' stride are multiples of 4
bytes (qwZ's slots are sized so, ``sharding/gather_codec.py``), else copied first (qgZ's rows).
Pure torch: the same code on the CPU and on a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "blocks_of", "dequantize", "pack", "packed_bytes", "quantize", "unpack"]

BLOCK = 256  # elements per scale
_QMAX = 127.0


def blocks_of(numel: int) -> int:
    """The blocks of a flat tensor of ``numel`` elements (the last one padded)."""
    return -(-numel // BLOCK)


def packed_bytes(numel: int, *, padded: bool = True) -> int:
    """The bytes :func:`pack` writes for ``numel`` elements: int8 values (padded to whole blocks
    unless ``padded=False``), then one fp32 scale per block."""
    nb = blocks_of(numel)
    return (nb * BLOCK if padded else numel) + 4 * nb


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat, any float dtype) as int8 values ``[blocks, BLOCK]`` and fp32 scales ``[blocks]``."""
    n = x.numel()
    nb = blocks_of(n)
    blocks = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    blocks[:n].copy_(x.reshape(-1))
    blocks = blocks.view(nb, BLOCK)
    scales = blocks.abs().amax(dim=1) / _QMAX  # NaN or inf in a block: a NaN or inf scale
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(blocks / safe[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of int8 ``q`` (``[..., blocks, BLOCK]``) with ``scales`` (``[..., blocks]``),
    flattened over the last two dimensions."""
    out = q.to(torch.float32) * scales.unsqueeze(-1)
    return out.flatten(-2)


def pack(x: torch.Tensor, out: torch.Tensor, *, padded: bool = True) -> None:
    """Quantize ``x`` into the uint8 tensor ``out`` (``packed_bytes(x.numel(), padded=padded)``
    long); ``padded=False`` leaves out the last block's padding."""
    q, scales = quantize(x)
    m = q.numel() if padded else x.numel()
    out[:m].copy_(q.view(-1)[:m].view(torch.uint8))
    out[m : m + 4 * scales.numel()].copy_(scales.view(torch.uint8))


def unpack(rows: torch.Tensor, numel: int, *, padded: bool = True) -> torch.Tensor:
    """fp32 ``[ranks, numel]`` from uint8 ``rows`` (``[ranks, >= packed_bytes(numel, padded=padded)]``,
    each row written by :func:`pack` from ``numel`` elements with the same ``padded``)."""
    r, nb = rows.shape[0], blocks_of(numel)
    if padded:
        m = nb * BLOCK
        q = rows[:, :m].view(torch.int8).reshape(r, nb, BLOCK)
    else:
        m = numel
        q = torch.zeros(r, nb * BLOCK, dtype=torch.int8, device=rows.device)
        q[:, :numel].copy_(rows[:, :numel].view(torch.int8))
        q = q.view(r, nb, BLOCK)
    raw = rows[:, m : m + 4 * nb]
    if not _fp32_viewable(raw):  # scales at an odd byte offset or row stride: copied to aligned bytes
        raw = raw.clone(memory_format=torch.contiguous_format)
    return dequantize(q, raw.view(torch.float32))[:, :numel]


def _fp32_viewable(raw: torch.Tensor) -> bool:
    """Whether the uint8 ``[ranks, 4 * blocks]`` ``raw`` reads as fp32 in place: its offset and its
    row stride (checked even for one row) multiples of 4, its bytes contiguous within a row."""
    return raw.stride(-1) == 1 and raw.storage_offset() % 4 == 0 and raw.stride(0) % 4 == 0
