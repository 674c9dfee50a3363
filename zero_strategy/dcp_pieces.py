"""A rank's piece of a flattened tensor at any offset, described to DCP.

``torch.distributed.checkpoint`` asks each state-dict entry where its local data sits in the
global tensor: a DTensor ``Shard(0)`` answers with ``torch.chunk``'s offsets, which is right for
even shards and silently wrong for load-balanced ones (``layout.py``): a reshard would read
another rank's elements. :class:`UnevenPiece` answers with the real range through DCP's
checkpointable protocol (``__create_write_items__`` when saving, ``__create_chunk_list__`` and
``__get_tensor_shard__`` when loading), so a checkpoint records the true offsets and loads
into any layout: even or uneven, any world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["UnevenPiece"]


class UnevenPiece(torch.Tensor):
    """Elements ``offset : offset + len(self)`` of a flat tensor of ``numel`` elements; the
    tensor itself shares ``local``'s memory (DCP saves from it and loads into it)."""

    _zs_offset: int
    _zs_numel: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, numel: int) -> UnevenPiece:
        if local.dim() != 1 or not 0 <= offset <= offset + local.numel() <= numel:
            raise AssertionError(f"UnevenPiece: {tuple(local.shape)} at {offset} does not fit in {numel} elements")
        piece = torch.Tensor._make_subclass(cls, local.detach(), False)
        piece._zs_offset, piece._zs_numel = offset, numel
        return piece

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # anything computed from a piece is a plain tensor: only the state-dict entry is special
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def size(self, dim: int | None = None) -> Any:
        """The *global* size: DCP compares it with the saved tensor's before planning a load."""
        full = torch.Size([self._zs_numel])
        return full if dim is None else full[dim]

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self._zs_offset]), sizes=torch.Size([self.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.numel() == 0:  # an empty piece holds nothing to write
            return []
        plain = self.as_subclass(torch.Tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self._zs_offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(plain),
                    size=torch.Size([self._zs_numel]),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)
