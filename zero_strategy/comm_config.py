"""Communication settings blocks of :class:`~zero_strategy.config.ZeroConfig` that the
communication modules read: top-k gradient compression (``compression.py``). A leaf: it
imports only the value rules, so the config and the modules that act on it can both use it.
"""

from __future__ import annotations

import dataclasses

from zero_strategy.config_values import coerce_fields, float_rule, int_rule, setting, to_choice

__all__ = ["CompressionConfig"]

_TYPES = ("none", "topk")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """``compression: {type: topk, ratio: 0.001, warmup_steps: N}`` (in the ``zero_strategy``
    block of a DeepSpeed-style file, or ``ZeroConfig(compression=...)``). ``type: none`` (the
    default) reduces every gradient element."""

    type: str = setting("none", lambda value, where: to_choice(value, where, _TYPES))
    ratio: float = setting(0.001, float_rule(gt=0.0, le=1.0))
    warmup_steps: int = setting(0, int_rule(0))

    def __post_init__(self) -> None:
        coerce_fields(self, "CompressionConfig")

    @property
    def enabled(self) -> bool:
        return self.type != "none"
