"""Communication settings blocks of :class:`~zero_strategy.config.ZeroConfig` that the
communication modules read: top-k gradient compression (``compression.py``) and load
balancing (``balance.py``). A leaf: it imports only the value rules, so the config and the
modules that act on it can both use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from zero_strategy.config.values import coerce_fields, float_rule, int_rule, optional, setting, to_choice, to_float

__all__ = ["PRESETS", "CompressionConfig", "LoadBalanceConfig"]

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


# (alpha, beta): the weights of compute and memory bandwidth in a rank's score (design notes)
PRESETS = {"compute": (0.7, 0.3), "bandwidth": (0.3, 0.7)}


def _to_scores(value: Any, where: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{where}: expected a list of positive numbers, one per rank, got {value!r}")
    scores = tuple(to_float(v, f"{where}[{i}]", gt=0.0) for i, v in enumerate(value))
    if not scores:
        raise ValueError(f"{where}: the list is empty; give one positive score per rank, or leave scores unset")
    return scores


@dataclasses.dataclass(frozen=True)
class LoadBalanceConfig:
    """``load_balance`` (ZeRO-1/2): each rank's share of every shard group follows its score.

    - ``{scores: [3, 1]}``: given, one positive number per rank;
    - ``{alpha: 0.7, beta: 0.3}``: measured at start, ``score = alpha * compute + beta *
      memory bandwidth`` (each normalised by its mean over the ranks);
    - ``{preset: compute}`` (alpha 0.7, beta 0.3) or ``{preset: bandwidth}`` (0.3, 0.7); the
      string ``load_balance: compute`` is the same.

    Unset (the default): even shards."""

    alpha: float | None = setting(None, optional(float_rule(ge=0.0)))
    beta: float | None = setting(None, optional(float_rule(ge=0.0)))
    scores: tuple[float, ...] | None = setting(None, _to_scores)
    preset: str | None = setting(None, optional(lambda value, where: to_choice(value, where, tuple(PRESETS))))

    def __post_init__(self) -> None:
        coerce_fields(self, "LoadBalanceConfig")
        weights = self.alpha is not None or self.beta is not None
        if self.scores is not None and (weights or self.preset is not None):
            raise ValueError(
                "load_balance: scores are used as given; remove alpha/beta/preset, or remove scores to measure"
            )
        if self.preset is not None and weights:
            raise ValueError("load_balance: give a preset or alpha and beta, not both")
        if weights and (self.alpha is None or self.beta is None):
            raise ValueError("load_balance: give both alpha and beta (e.g. {alpha: 0.7, beta: 0.3}), or a preset")
        if weights and self.alpha == 0 and self.beta == 0:
            raise ValueError("load_balance: alpha and beta are both 0; give them positive weights, or a preset")

    @property
    def enabled(self) -> bool:
        return self.scores is not None or self.preset is not None or self.alpha is not None

    def weights(self) -> tuple[float, float]:
        """(alpha, beta) of a measured score."""
        if self.preset is not None:
            return PRESETS[self.preset]
        return (self.alpha or 0.0, self.beta or 0.0)
