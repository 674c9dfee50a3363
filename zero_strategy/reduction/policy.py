"""The reduction policy: how gradients are reduced into shards, resolved once.

The composition root (``runtime/compose.py``) turns the user's config into one frozen
:class:`ReducePolicy`; the reducer is built from it. It holds whether reductions overlap the
backward (``overlap_comm``: up to two buckets in flight), the ZeRO-1/2 bucket size (DeepSpeed's
``reduce_bucket_size`` and ``allgather_bucket_size``, the smaller: one bucket is reduced and
gathered as one), the top-k compression section
(``compression.py``) and the wire format of the sharded reductions (``quantized.py``: exact or
int8, ZeRO++'s qgZ). *When* a reduction runs is the gradient schedule, chosen by stage and
optimizer (``schedule.py``), not a setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from zero_strategy.config.comm import CompressionConfig
from zero_strategy.reduction.quantized import GradCodec, grad_codec

__all__ = ["ReducePolicy", "ReduceSettings", "reduce_policy"]


class ReduceSettings(Protocol):
    """What :func:`reduce_policy` reads of a config (``ZeroConfig`` has these)."""

    @property
    def overlap_comm(self) -> bool: ...
    @property
    def reduce_bucket_size(self) -> int: ...
    @property
    def allgather_bucket_size(self) -> int: ...
    @property
    def compression(self) -> CompressionConfig: ...
    @property
    def zero_quantized_gradients(self) -> bool: ...


@dataclass(frozen=True)
class ReducePolicy:
    overlap: bool = True
    bucket_size: int = 4_000_000  # elements per ZeRO-1/2 bucket
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    quantized: bool = False

    @property
    def max_in_flight(self) -> int:
        """Reductions left in flight while the backward goes on (0: each one waited at once)."""
        return 2 if self.overlap else 0

    def codec(self) -> GradCodec:
        return grad_codec(self.quantized)


def reduce_policy(config: ReduceSettings) -> ReducePolicy:
    return ReducePolicy(
        overlap=config.overlap_comm,
        bucket_size=min(config.reduce_bucket_size, config.allgather_bucket_size),
        compression=config.compression,
        quantized=config.zero_quantized_gradients,
    )
