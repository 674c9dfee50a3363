"""The communication policy: how the engine's process-group contexts talk.

The composition root (``runtime/compose.py``) resolves the user's config once into a
:class:`CommPolicy` (FSDP2's way with its ``MixedPrecisionPolicy``); every context made for the
engine after that (the world, the shard and replica groups, hpZ's groups) is made from it, so a
reader of ``shard_groups.py`` or ``sharding/secondary.py`` sees the two settings it depends on,
not the whole config. The wire formats are the gather's and the reduction's own business
(``sharding/gather_policy.py``, ``reduction/policy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zero_strategy.comm import collectives as C

__all__ = ["CommPolicy", "CommSettings", "comm_policy"]


class CommSettings(Protocol):
    """What :func:`comm_policy` reads of a config (``ZeroConfig`` has these)."""

    @property
    def comm_timeout(self) -> float | None: ...
    @property
    def collective_impl(self) -> str: ...


@dataclass(frozen=True)
class CommPolicy:
    """``timeout_s``: a collective's wait before every rank raises (None: the process group's
    own timeout); ``impl``: ``"auto"``, ``"native"`` or ``"p2p"`` (``collectives.py``)."""

    timeout_s: float | None = None
    impl: str = "auto"

    def context(self, group: Any, device: torch.device | None) -> C.CommContext:
        """A context for ``group`` (None: the default group) on ``device``, with this policy."""
        return C.make_context(group, self.timeout_s, self.impl, device)


def comm_policy(config: CommSettings) -> CommPolicy:
    return CommPolicy(timeout_s=config.comm_timeout, impl=config.collective_impl)
