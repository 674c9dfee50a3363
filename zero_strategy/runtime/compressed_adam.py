"""The frozen-variance Adam mode of top-k compression (``compression: {optimizer: adam}``).

Top-k with error feedback delivers each coordinate in bursts, and Adam's per-coordinate
normalisation, which learns its variance from those bursts, shrinks them: a compressed AdamW
lags dense AdamW. 1-bit Adam and 0/1 Adam (DeepSpeed) avoid that by learning the variance in a
dense warm-up, freezing it, and then compressing the *momentum* with error feedback: with the
variance fixed, Adam is momentum SGD with a fixed per-coordinate scale, which error feedback
handles as it handles SGD. This mode is that idea with top-k in place of their sign:

- The engine owns Adam's moments. The user builds ``torch.optim.SGD(params, lr, momentum=0,
  weight_decay=wd)``: the engine writes Adam's update direction into each master gradient
  just before that SGD steps, so ``p -= lr * (direction + wd * p)``, which is AdamW's decoupled
  weight decay (and the learning rate and any LR scheduler stay the user's). The moments are
  kept in that optimizer's state under torch Adam's names (``exp_avg``, ``exp_avg_sq``,
  ``step``; and ``variance_step``, the number of variance updates), so checkpoints save and
  reshard them as any optimizer state.
- The ``warmup_steps`` first optimizer steps (``warmup: dense``) reduce every element; the
  engine then does AdamW's step exactly (DDP's numbers with ``torch.optim.AdamW``).
- From then on ``exp_avg_sq`` is frozen. Each rank's velocity (``compression.py``) carries its
  share of Adam's momentum already divided by ``sqrt(v_hat) + eps``; what the owner receives is
  the sum of the sent velocities. The momentum of the dense steps stays in ``exp_avg`` and
  decays by ``beta1`` per step; the direction is ``(exp_avg * P + received) / (1 - beta1**t)``
  with ``P = 1 / (sqrt(v_hat) + eps)``. At ratio 1.0 without masking that is Adam whose
  variance stops at the freeze: ``m_t / (1 - beta1**t) * P`` with DDP's gradients.
- ``variance_refresh: N`` (0/1 Adam's refresh): after the warm-up, ``N`` compressed steps, one
  dense step, ``2N`` compressed, one dense, ... A refresh step reduces uncompressed and is the
  warm-up's AdamW step (``exp_avg`` and ``exp_avg_sq`` take the gradient); it drops the gathered
  preconditioners, so the next compressed step scales by the new variance. The velocities and
  residuals stay: they hold momentum already scaled by the old variance, and go out with the
  following compressed steps (they neither move the parameters nor decay on the refresh step).
- ``precondition_floor: f`` floors the frozen ``sqrt(v_hat)`` at ``f`` times its median (the
  median of the nonzero ``sqrt(v_hat)`` of each master tensor's shard, so it depends on how the
  tensor is sharded): an element whose variance was tiny at the freeze no longer gets a huge
  normalised update. Ratio 1.0 then equals Adam with that floored frozen variance, not AdamW.
- ``owner_momentum`` (1-bit Adam's synchronised momentum, kept where the shard lives): the
  ranks keep no velocity; each sends its normalised gradient share ``(1 - beta1) * g * P``
  through error feedback, and the owner keeps ``update_avg = beta1 * update_avg + received``
  (optimizer state, beside ``exp_avg``), so the direction is ``(exp_avg * P + update_avg) /
  (1 - beta1**t)``. A burst that error feedback delivers is then spread by the owner's momentum
  over the following steps, as Adam's momentum spreads a gradient, instead of being applied at
  once; and nothing is masked. At ratio 1.0 it is the same frozen-variance Adam (the oracle's
  ``w`` is ``update_avg``).
- An element whose variance is still zero at the freeze (no gradient in the whole warm-up)
  gets ``P = 0``: the compressed steps do not move it (weight decay still does), where
  ``1 / eps`` would throw it far.
"""

from __future__ import annotations

import math
import weakref

import torch

from zero_strategy.reduction.compression import ErrorFeedback
from zero_strategy.sharding.group import ShardGroup

__all__ = ["adam_direction", "bind_adam"]


def bind_adam(optimizer: torch.optim.Optimizer, feedback: ErrorFeedback | None, *, check_only: bool = False) -> None:
    """Refuse an optimizer that would add its own moments (before the engine changes anything),
    and (``check_only`` False: once its parameters are the masters) let the compression read the
    frozen variance from ``optimizer``'s state. A no-op outside the Adam mode."""
    fb = feedback if feedback is not None and feedback.config.adam else None
    if fb is None:
        return
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"initialize(): compression.optimizer: adam makes the engine run Adam's moments, and the optimizer only "
            f"applies the learning rate, but it is a {type(optimizer).__name__}; build torch.optim.SGD(params, "
            "lr=..., weight_decay=...) (its weight_decay is AdamW's decoupled one), or set compression.optimizer: sgd"
        )
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("momentum", 0) or group.get("nesterov", False) or group.get("dampening", 0):
            raise ValueError(
                f"initialize(): compression.optimizer: adam keeps Adam's momentum in the engine, but "
                f"optimizer.param_groups[{gi}] has momentum={group.get('momentum')}, nesterov="
                f"{group.get('nesterov')}, dampening={group.get('dampening')}; build torch.optim.SGD(params, lr) "
                "with momentum=0"
            )
    if check_only:
        return
    cfg = fb.config

    def precondition(g: ShardGroup) -> torch.Tensor:
        row = torch.zeros(g.layout.shard_numel, dtype=g.master_dtype, device=g.device)
        for i, m in enumerate(g.masters):
            state = optimizer.state.get(m)
            if state and "exp_avg_sq" in state:
                g.layout.local_view(row, i).copy_(_scale(state, cfg.beta2, cfg.eps, cfg.precondition_floor))
        return row

    fb.precondition = precondition
    fb.preconditioners.clear()


# the frozen variance -> (its version counter, variance_step, the median of its nonzero
# sqrt(v_hat)): the variance changes only on dense steps and loads, so the median (a masked
# select and a sort: a host sync on a GPU) is taken once per freeze, not on every compressed
# step; kept outside the optimizer state, so checkpoints do not change
# (keyed by id: a WeakKeyDictionary would compare tensors with ==; each entry goes with its tensor)
_MEDIANS: dict[int, tuple[weakref.ref[torch.Tensor], int, float, float | None]] = {}


def _median(v: torch.Tensor, root: torch.Tensor, steps: float) -> float | None:
    """The median of ``root`` (``sqrt(v_hat)``) where ``v`` is nonzero, None if it is zero everywhere."""
    hit = _MEDIANS.get(id(v))
    if hit is not None and hit[0]() is v and hit[1] == v._version and hit[2] == steps:
        return hit[3]
    nonzero = root[v > 0]
    median = float(nonzero.median()) if nonzero.numel() else None
    if hit is None or hit[0]() is not v:
        weakref.finalize(v, _MEDIANS.pop, id(v), None)
    _MEDIANS[id(v)] = (weakref.ref(v), v._version, steps, median)
    return median


def _scale(state: dict, beta2: float, eps: float, floor: float = 0.0) -> torch.Tensor:
    """``1 / (max(sqrt(v_hat), floor * median) + eps)`` of the frozen variance, 0 where it is
    still zero (``median``: of the nonzero ``sqrt(v_hat)`` of this tensor, taken once per freeze)."""
    v = state["exp_avg_sq"]
    steps = float(state["variance_step"])
    correction = math.sqrt(1.0 - beta2**steps) if steps > 0 else 1.0
    root = v.sqrt() / correction
    if floor > 0:
        median = _median(v, root, steps)
        if median is not None:
            root = root.clamp(min=median * floor)
    denom = root.add_(eps)
    return torch.where(v > 0, denom.reciprocal(), torch.zeros((), dtype=v.dtype, device=v.device))


def adam_direction(feedback: ErrorFeedback | None, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Turn each master gradient of ``optimizer`` into Adam's direction for optimizer step
    ``step`` (0-based), in place: called before the optimizer steps, after clipping, not on a
    skipped step. A no-op outside the Adam mode."""
    if feedback is None or not feedback.config.adam:
        return
    cfg = feedback.config
    b1, b2 = cfg.beta1, cfg.beta2
    compressed = not cfg.dense_at(step)  # how this step's gradients were reduced
    with torch.no_grad():
        for group in optimizer.param_groups:
            for m in group["params"]:
                grad = m.grad
                if grad is None:
                    continue
                state = optimizer.state[m]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["variance_step"] = torch.tensor(0.0, dtype=torch.float32)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                correction1 = 1.0 - b1 ** float(state["step"])
                if compressed:  # grad: the sum of the sent velocities, normalised already
                    exp_avg.mul_(b1)  # the dense steps' momentum, decaying
                    if cfg.owner_momentum:  # received: this step's normalised gradient; the owner's momentum
                        if "update_avg" not in state:
                            state["update_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                        grad.copy_(state["update_avg"].mul_(b1).add_(grad))
                    grad.addcmul_(exp_avg, _scale(state, b2, cfg.eps, cfg.precondition_floor)).div_(correction1)
                    continue
                state["variance_step"] += 1  # as torch's AdamW (single-tensor path)
                exp_avg.lerp_(grad, 1.0 - b1)
                exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                correction2 = 1.0 - b2 ** float(state["variance_step"])
                denom = (exp_avg_sq.sqrt() / math.sqrt(correction2)).add_(cfg.eps)
                torch.div(exp_avg, denom, out=grad).div_(correction1)
    if cfg.refresh_at(step):  # the variance moved: every rank gathers P again at the next compressed step
        feedback.preconditioners.clear()
