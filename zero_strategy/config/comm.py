"""Communication settings blocks of :class:`~zero_strategy.config.ZeroConfig` that the
communication modules read: top-k gradient compression (``compression.py``) and load
balancing (``balance.py``). A leaf: it imports only the value rules, so the config and the
modules that act on it can both use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from zero_strategy.config.values import (
    coerce_fields,
    float_rule,
    int_rule,
    optional,
    setting,
    to_bool,
    to_choice,
    to_float,
)

__all__ = ["PRESETS", "CompressionConfig", "LoadBalanceConfig"]

_TYPES = ("none", "topk")
_OPTIMIZERS = ("sgd", "adam")
_WARMUPS = ("exponential", "dense")
_RAMP = 0.25  # DGC's warm-up keeps 25%, 6.25%, 1.5625%, 0.39%, ... of the elements


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """``compression: {type: topk, ratio: 0.001, warmup_steps: N, warmup: exponential,
    momentum: 0.9, momentum_masking: true}`` (in the ``zero_strategy`` block of a
    DeepSpeed-style file, or ``ZeroConfig(compression=...)``). ``type: none`` (the default)
    reduces every gradient element.

    - ``warmup: exponential`` (the default): DGC's sparsity warm-up. The ``warmup_steps`` first
      optimizer steps are compressed at a ratio that falls exponentially, ``0.25, 0.0625,
      0.0156, ...`` (one equal stretch of the warm-up per value above ``ratio``), then
      ``ratio``. ``warmup: dense``: the ``warmup_steps`` first steps reduce every element
      uncompressed, then ``ratio`` at once (the behaviour before the ramp).
    - ``momentum`` (0: off): DGC's momentum correction, the engine owns SGD's momentum. Each
      rank keeps a velocity ``u = momentum * u + g`` and accumulates ``u`` (not ``g``) into
      its residual; the exchanged update is then the velocity, and the user's ``torch.optim.SGD``
      steps with ``momentum=0`` on it (the engine refuses an optimizer with momentum).
    - ``momentum_masking`` (true): DGC's momentum factor masking, the velocity of each sent
      element restarts from zero (so a stale velocity does not keep pushing it). At
      ``ratio: 1.0`` this sends each step's gradient alone: plain SGD, not SGD with momentum.
    - ``local_clip`` (unset: off): DGC's local gradient clipping. Before compression each rank
      scales its share of the averaged gradient (all buckets of the reduction together) to a
      norm of at most ``local_clip / sqrt(world)``. The buckets are then exchanged at the end
      of the backward, not while it runs. ``clip_grad_norm_`` still clips and reports the
      global norm of the exchanged update (see ``docs/compression.md``).
    - ``optimizer: adam``: the frozen-variance Adam mode (1-bit / 0/1 Adam's idea, top-k
      instead of sign). The engine owns Adam's moments (``beta1``, ``beta2``, ``eps``): the
      ``warmup_steps`` first steps (``warmup: dense``, required) are dense AdamW; then the
      variance is frozen, each rank's velocity ``u = beta1 * u + (1 - beta1) * g / (sqrt(v) +
      eps)`` goes through error feedback, and the user's ``torch.optim.SGD`` (momentum 0; its
      ``weight_decay`` is AdamW's decoupled one) steps on the exchanged update.
    - ``variance_refresh`` (0: off; Adam mode only): 0/1 Adam's variance refresh. After the
      warm-up come ``N`` compressed steps, one dense step, ``2N`` compressed, one dense, ``4N``,
      ... (the intervals double). A refresh step reduces the gradient uncompressed and is an
      AdamW step: it updates the variance and the dense momentum (``exp_avg``), and the
      compressed steps after it use the new variance.
    - ``precondition_floor`` (0: off; Adam mode only): the compressed steps scale by ``P = 1 /
      (max(sqrt(v_hat), f * median) + eps)``, ``median`` the median of the nonzero ``sqrt(v_hat)``
      of each master tensor's shard at the freeze: a cap on the normalised update of elements
      whose variance was tiny at the freeze.
    - ``region_indices`` (false): top-k per region of 32,768 columns, each index sent as an int16
      offset inside its region: 6 bytes per pair instead of 8 (4 instead of 6 on a 16-bit wire).
    - ``owner_momentum`` (false; Adam mode only): Adam's momentum of the compressed steps is kept
      by each shard's owner, from what it received (1-bit Adam's synchronised momentum, kept
      where the shard lives), instead of in each rank's velocity: each rank sends its normalised
      gradient share ``(1 - beta1) * g / (sqrt(v_hat) + eps)`` through error feedback (no
      velocity, no masking), and the owner steps on ``w = beta1 * w + received``. Not with
      ``variance_refresh``.
    - ``global_threshold`` (false): one threshold over the whole bucket instead of one per row:
      each rank sends the ``world * k`` largest entries of its compensated bucket, however they
      fall across the destinations (the same number of pairs in all, an uneven number to each
      rank; one small exchange of the counts first, a host wait per bucket).
    """

    type: str = setting("none", lambda value, where: to_choice(value, where, _TYPES))
    ratio: float = setting(0.001, float_rule(gt=0.0, le=1.0))
    warmup_steps: int = setting(0, int_rule(0))
    warmup: str = setting("exponential", lambda value, where: to_choice(value, where, _WARMUPS))
    momentum: float = setting(0.0, float_rule(ge=0.0, le=0.999))
    momentum_masking: bool = setting(True, to_bool)
    local_clip: float | None = setting(None, optional(float_rule(gt=0.0)))
    optimizer: str = setting("sgd", lambda value, where: to_choice(value, where, _OPTIMIZERS))
    beta1: float = setting(0.9, float_rule(ge=0.0, le=0.999))
    beta2: float = setting(0.999, float_rule(ge=0.0, le=0.99999))
    eps: float = setting(1e-8, float_rule(gt=0.0))
    region_indices: bool = setting(False, to_bool)
    variance_refresh: int = setting(0, int_rule(0))
    precondition_floor: float = setting(0.0, float_rule(ge=0.0))
    global_threshold: bool = setting(False, to_bool)
    owner_momentum: bool = setting(False, to_bool)

    def __post_init__(self) -> None:
        coerce_fields(self, "CompressionConfig")
        if self.adam and (self.momentum > 0 or self.warmup != "dense" or self.warmup_steps < 1):
            raise ValueError(
                "compression.optimizer: adam learns Adam's variance in dense steps, then freezes it: set warmup: "
                "dense and warmup_steps >= 1 (e.g. 5% of the run), and momentum: 0 (the velocity decays with beta1; "
                f"got warmup: {self.warmup}, warmup_steps: {self.warmup_steps}, momentum: {self.momentum})"
            )
        if self.precondition_floor and not self.adam:
            raise ValueError(
                "compression.precondition_floor floors Adam's frozen preconditioner; set compression.optimizer: adam "
                f"(and type: topk), or precondition_floor: 0 (got optimizer: {self.optimizer}, type: {self.type})"
            )
        if self.variance_refresh and not self.adam:
            raise ValueError(
                "compression.variance_refresh refreshes Adam's frozen variance; set compression.optimizer: adam "
                f"(and type: topk), or variance_refresh: 0 (got optimizer: {self.optimizer}, type: {self.type})"
            )
        if self.owner_momentum and not self.adam:
            raise ValueError(
                "compression.owner_momentum keeps Adam's momentum at each shard's owner; set compression.optimizer: "
                f"adam (and type: topk), or owner_momentum: false (got optimizer: {self.optimizer}, type: {self.type})"
            )
        if self.owner_momentum and self.variance_refresh:
            raise ValueError(
                "compression.owner_momentum is not built with variance_refresh (the owner's momentum is scaled by the "
                f"frozen variance); set variance_refresh: 0 or owner_momentum: false (got {self.variance_refresh})"
            )
        if self.global_threshold and not self.enabled:
            raise ValueError(
                "compression.global_threshold sets how top-k chooses; set compression.type: topk, or "
                "global_threshold: false (got type: none)"
            )
        if self.global_threshold and self.region_indices:
            raise ValueError(
                "compression.global_threshold chooses over the whole bucket, and region_indices chooses per region of "
                "each row (its int16 offsets need that); set one of them to false"
            )
        if self.momentum > 0 and self.warmup == "dense" and self.warmup_steps > 0:
            raise ValueError(
                "compression: momentum correction runs through the sparse exchange from the first step, and "
                "warmup: dense reduces the warm-up steps uncompressed (without the velocity); use warmup: "
                "exponential, or warmup_steps: 0"
            )

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    @property
    def adam(self) -> bool:
        """The frozen-variance Adam mode (``optimizer: adam``)."""
        return self.enabled and self.optimizer == "adam"

    @property
    def decay(self) -> float:
        """The velocity's decay: ``beta1`` in the Adam mode (0 with ``owner_momentum``: the owner
        keeps the momentum), else ``momentum`` (0: no velocity)."""
        if self.adam:
            return 0.0 if self.owner_momentum else self.beta1
        return self.momentum

    def dense_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) reduces uncompressed (``warmup: dense``'s
        warm-up, and the Adam mode's variance refresh steps)."""
        return (self.warmup == "dense" and step < self.warmup_steps) or self.refresh_at(step)

    def refresh_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a variance refresh step (``variance_refresh: N``):
        after the warm-up, stretches of ``N, 2N, 4N, ...`` compressed steps, each followed by one."""
        if not self.variance_refresh or not self.adam:
            return False
        start, length = self.warmup_steps, self.variance_refresh
        while start + length < step:
            start, length = start + length + 1, 2 * length
        return step == start + length

    def ratio_at(self, step: int) -> float:
        """The share of elements sent at optimizer step ``step`` (0-based). With ``warmup:
        exponential``, the warm-up is cut into ``m`` equal stretches, ``m`` the number of powers
        ``0.25**j`` (j >= 1) above ``ratio``; stretch ``j`` sends ``0.25**(j + 1)``. DGC's
        schedule at ratio 0.001: 25%, 6.25%, 1.56%, 0.39%, then 0.1%."""
        if self.warmup != "exponential" or step >= self.warmup_steps or self.ratio >= _RAMP:
            return self.ratio
        stretches = math.ceil(math.log(self.ratio) / math.log(_RAMP) - 1e-9) - 1
        if stretches <= 0:
            return self.ratio
        j = step * stretches // self.warmup_steps
        return max(self.ratio, _RAMP ** (j + 1))


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
