"""The explicit states (FSDP2-style): one value at a time, changed in one place each, which
checks the state it leaves against a table of allowed transitions.

- :class:`TrainingState` (the engine): idle, in forward, in backward. A backward may start
  inside a forward (``torch.autograd.grad`` in ``forward``; Lightning's manual optimization).
- :class:`GradState` (the engine): no gradient, accumulating, reduced and final.
- :class:`ShardedState` (a ZeRO-3 unit): sharded, being gathered, gathered.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, auto
from typing import TypeVar

__all__ = [
    "GRAD_TRANSITIONS",
    "GradState",
    "SHARDED_TRANSITIONS",
    "ShardedState",
    "TRAINING_TRANSITIONS",
    "TrainingState",
    "check_transition",
]


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class GradState(Enum):
    EMPTY = auto()  # no gradient since the last zero_grad
    ACCUMULATING = auto()  # local gradients and/or partly reduced shards
    FINAL = auto()  # reduced everywhere, flags agreed, master grads set


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDING = auto()
    UNSHARDED = auto()


# To a state (key), from the states allowed (value).
TRAINING_TRANSITIONS: dict[TrainingState, tuple[TrainingState, ...]] = {
    TrainingState.FORWARD: (TrainingState.IDLE,),
    TrainingState.BACKWARD: (TrainingState.IDLE, TrainingState.FORWARD),
    TrainingState.IDLE: (TrainingState.FORWARD, TrainingState.BACKWARD),
}
GRAD_TRANSITIONS: dict[GradState, tuple[GradState, ...]] = {
    GradState.ACCUMULATING: (GradState.EMPTY, GradState.ACCUMULATING, GradState.FINAL),
    GradState.FINAL: (GradState.EMPTY, GradState.ACCUMULATING),
    GradState.EMPTY: (GradState.EMPTY, GradState.ACCUMULATING, GradState.FINAL),
}
SHARDED_TRANSITIONS: dict[ShardedState, tuple[ShardedState, ...]] = {
    ShardedState.UNSHARDING: (ShardedState.SHARDED,),
    ShardedState.UNSHARDED: (ShardedState.UNSHARDING,),
    ShardedState.SHARDED: (ShardedState.UNSHARDING, ShardedState.UNSHARDED),
}

S = TypeVar("S", bound=Enum)


def check_transition(table: Mapping[S, tuple[S, ...]], current: S, new: S, what: str, note: str = "") -> S:
    """``new`` if ``table`` allows leaving ``current`` for it; else a RuntimeError naming the call
    (``what``), both states and the allowed ones."""
    allowed = table[new]
    if current not in allowed:
        raise RuntimeError(
            f"{what} moves it to {new.name}, which needs state {' or '.join(a.name for a in allowed)}, "
            f"but it is {current.name}{f' ({note})' if note else ''}"
        )
    return new
