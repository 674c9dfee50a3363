"""The gather policy: how ZeRO-3 brings a unit's full parameters back, resolved once.

The composition root (``runtime/compose.py``) turns the user's config into one frozen
:class:`GatherPolicy`; the unit storage, the secondary shards and the scheduler receive it (or
the few fields they use), never the config. It holds:

- **when** a unit is gathered ahead of use: ``prefetch`` units, at most
  ``prefetch_bucket_size`` elements beyond the first, and DeepSpeed's live-parameter and
  reuse-distance caps;
- **what stays gathered**: units smaller than ``persistence_threshold`` elements (-1: the memory
  budget chooses);
- **how it travels**: the wire codec (``gather_codec.py``: exact, a 16-bit cast, or int8) and
  hpZ's secondary group size (``secondary.py``);
- **how it is checked**: the unit order, and the gathered tags read at once or once per step
  (``checks``: ``"auto"`` defers them on a GPU, where reading them waits for the device);
- **the MoE switches** (``sharding/experts/``): the share above which an experts unit is gathered
  whole, the bytes of expert rows kept between steps, the compact layout, and whether the
  experts are cut by owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from zero_strategy.sharding.experts.selective import FULL_SHARE
from zero_strategy.sharding.gather_codec import EXACT, CodecSettings, GatherCodec, gather_codec

__all__ = ["GatherPolicy", "GatherSettings", "gather_policy"]


class GatherSettings(CodecSettings, Protocol):
    """What :func:`gather_policy` reads of a config (``ZeroConfig`` has these), the codec's
    fields included."""

    @property
    def prefetch(self) -> int: ...
    @property
    def stage3_prefetch_bucket_size(self) -> int: ...
    @property
    def stage3_max_live_parameters(self) -> int: ...
    @property
    def stage3_max_reuse_distance(self) -> int: ...
    @property
    def stage3_param_persistence_threshold(self) -> int: ...
    @property
    def check_unit_order(self) -> bool: ...
    @property
    def gather_checks(self) -> str: ...
    @property
    def zero_hpz_partition_size(self) -> int: ...
    @property
    def moe_full_gather_share(self) -> float: ...
    @property
    def moe_expert_cache(self) -> int: ...
    @property
    def moe_compact_gather(self) -> bool: ...
    @property
    def moe_expert_layout(self) -> str: ...


@dataclass(frozen=True)
class GatherPolicy:
    prefetch: int = 1
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    persistence_threshold: int = 100_000
    check_unit_order: bool = True
    checks: str = "auto"  # "auto" | "deferred" | "immediate"
    hpz_size: int = 1
    codec: GatherCodec = EXACT
    moe_full_share: float = FULL_SHARE
    moe_expert_cache: int = 0
    moe_compact: bool = True
    moe_expert_layout: str = "sharded"

    def defer_checks(self, device: torch.device) -> bool:
        """Whether the gathered tags are read once per step (deferred) on ``device``."""
        return self.checks == "deferred" or (self.checks == "auto" and device.type != "cpu")


def gather_policy(config: GatherSettings) -> GatherPolicy:
    return GatherPolicy(
        prefetch=config.prefetch,
        prefetch_bucket_size=config.stage3_prefetch_bucket_size,
        max_live_parameters=config.stage3_max_live_parameters,
        max_reuse_distance=config.stage3_max_reuse_distance,
        persistence_threshold=config.stage3_param_persistence_threshold,
        check_unit_order=config.check_unit_order,
        checks=config.gather_checks,
        hpz_size=config.zero_hpz_partition_size,
        codec=gather_codec(config),
        moe_full_share=config.moe_full_gather_share,
        moe_expert_cache=config.moe_expert_cache,
        moe_compact=config.moe_compact_gather,
        moe_expert_layout=config.moe_expert_layout,
    )
