"""A rank's piece of a flattened tensor at any offset, described to DCP.

``torch.distributed.checkpoint`` asks each state-dict entry where its local data sits in the
global tensor: a DTensor ``Shard(0)`` answers with ``torch.chunk``'s offsets, which is right for
even shards and silently wrong for load-balanced ones (``layout.py``): a reshard would read
another rank's elements. :class:`UnevenPiece` answers with the real range through DCP's
checkpointable protocol (``__create_write_items__`` when saving, ``__create_chunk_list__`` and
``__get_tensor_shard__`` when loading), so a checkpoint records the true offsets and loads
into any layout: even or uneven, any world size.

:class:`ScatteredPiece` is the same for several ranges held in separate tensors: top-k
compression's residual of one parameter sits in one padded row per destination rank
(``compression.py``), and is saved in, and loaded from, parameter coordinates in place.

:class:`RowsPiece` loads from a tensor saved in its own shape (another engine's checkpoint,
``foreign.py``): the whole rows (slices along dim 0) that cover a rank's flat range, which the
caller then cuts to the range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["RowsPiece", "ScatteredPiece", "UnevenPiece", "covering_rows"]


class _FlatPiece(torch.Tensor):
    """A state-dict entry that DCP sees as part of a flat tensor of ``_zs_numel`` elements."""

    _zs_numel: int

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # anything computed from a piece is a plain tensor: only the state-dict entry is special
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def size(self, dim: int | None = None) -> Any:
        """The *global* size: DCP compares it with the saved tensor's before planning a load."""
        full = torch.Size([self._zs_numel])
        return full if dim is None else full[dim]

    def _write_item(self, fqn: str, chunk: ChunkStorageMetadata, data: torch.Tensor) -> WriteItem:
        return WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(data), size=torch.Size([self._zs_numel])
            ),
        )


class UnevenPiece(_FlatPiece):
    """Elements ``offset : offset + len(self)`` of a flat tensor of ``numel`` elements; the
    tensor itself shares ``local``'s memory (DCP saves from it and loads into it)."""

    _zs_offset: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, numel: int) -> UnevenPiece:
        if local.dim() != 1 or not 0 <= offset <= offset + local.numel() <= numel:
            raise AssertionError(f"UnevenPiece: {tuple(local.shape)} at {offset} does not fit in {numel} elements")
        piece = torch.Tensor._make_subclass(cls, local.detach(), False)
        piece._zs_offset, piece._zs_numel = offset, numel
        return piece

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self._zs_offset]), sizes=torch.Size([self.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.numel() == 0:  # an empty piece holds nothing to write
            return []
        return [self._write_item(fqn, self._chunk(), self.as_subclass(torch.Tensor))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


class ScatteredPiece(_FlatPiece):
    """Ranges of a flat tensor of ``numel`` elements, each held by its own 1-D tensor: ``parts``
    is ``[(offset, local)]``, the ranges disjoint and non-empty. DCP saves each range from its
    tensor and loads it into it (they are views of the caller's storage); the piece's own data
    is an empty tensor of their dtype and device."""

    _zs_parts: dict[int, torch.Tensor]

    @staticmethod
    def __new__(cls, parts: Sequence[tuple[int, torch.Tensor]], numel: int, like: torch.Tensor) -> ScatteredPiece:
        for offset, local in parts:
            if local.dim() != 1 or local.numel() == 0 or not 0 <= offset <= offset + local.numel() <= numel:
                raise AssertionError(
                    f"ScatteredPiece: {tuple(local.shape)} at {offset} is not a non-empty range of {numel} elements"
                )
        piece = torch.Tensor._make_subclass(cls, like.detach().new_empty(0), False)
        piece._zs_parts, piece._zs_numel = {offset: local.detach() for offset, local in parts}, numel
        return piece

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([local.numel()]))
            for offset, local in self._zs_parts.items()
        ]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [self._write_item(fqn, c, self._zs_parts[c.offsets[0]]) for c in self._chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is None or index.offset[0] not in self._zs_parts:
            raise AssertionError(f"ScatteredPiece {index.fqn}: no range starts at {index.offset}")
        return self._zs_parts[index.offset[0]]


def covering_rows(shape: Sequence[int], lo: int, hi: int) -> tuple[int, int, int]:
    """``(first, last, skip)``: the rows ``first : last`` along dim 0 of a row-major tensor of
    ``shape`` that hold its flat elements ``lo : hi``, which start ``skip`` elements into them."""
    if len(shape) == 0:
        return 0, 0, lo
    row = 1
    for n in shape[1:]:
        row *= int(n)
    if row == 0 or hi <= lo:
        return 0, 0, 0
    first, last = lo // row, -(-hi // row)
    return first, last, lo - first * row


class RowsPiece(torch.Tensor):
    """Rows ``first : first + len(self)`` of a tensor of ``shape`` saved in that shape (DTensors
    sharded on any dim, or plain); DCP loads them into this tensor. A 0-d ``shape``: the value."""

    _zs_shape: torch.Size
    _zs_first: int

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @staticmethod
    def __new__(cls, shape: Sequence[int], first: int, last: int, dtype: torch.dtype) -> RowsPiece:
        shape = torch.Size(shape)
        local = torch.empty(shape if len(shape) == 0 else (last - first, *shape[1:]), dtype=dtype)
        piece = torch.Tensor._make_subclass(cls, local, False)
        piece._zs_shape, piece._zs_first = shape, first
        return piece

    def size(self, dim: int | None = None) -> Any:
        """The *global* size, which DCP compares with the saved tensor's."""
        return self._zs_shape if dim is None else self._zs_shape[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        local = self.as_subclass(torch.Tensor)
        offsets = torch.Size([self._zs_first] + [0] * (local.dim() - 1)) if local.dim() else torch.Size([])
        return [ChunkStorageMetadata(offsets=offsets, sizes=local.shape)] if local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)
