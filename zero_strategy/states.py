"""The engine's explicit states (FSDP2-style): one value at a time, checked on transition."""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["GradState", "TrainingState"]


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class GradState(Enum):
    EMPTY = auto()  # no gradient since the last zero_grad
    ACCUMULATING = auto()  # local gradients and/or partly reduced shards
    FINAL = auto()  # reduced everywhere, flags agreed, master grads set
