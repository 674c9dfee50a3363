"""Worker-side subtest helpers (FSDP2-style): run one function over a config grid.

Every rank must build the same grid and run it in the same order, so collectives
inside the subtests line up; :func:`subtest_grid` is deterministic for that reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SubtestFailure", "run_subtests", "subtest_grid"]


class SubtestFailure(AssertionError):
    """A subtest failed; the message names the failing configuration."""

    def __init__(self, message: str, config: dict[str, Any], index: int) -> None:
        super().__init__(message)
        self.config = config
        self.index = index


def subtest_grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Cartesian product of the axes, in keyword order, last axis varying fastest.

    >>> subtest_grid(a=[1, 2], b=["x"])
    [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'x'}]
    """
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(
                f"subtest_grid axis {name!r} must be a list/tuple of values "
                f"(unordered collections would break cross-rank ordering), got {values!r}"
            )
        if len(values) == 0:
            raise ValueError(f"subtest_grid axis {name!r} is empty, so the grid would run nothing")
    names = list(axes)
    return [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]


def run_subtests(fn: Callable[..., None], grid: list[dict[str, Any]], *, label: str = "") -> None:
    """Call ``fn(**cfg)`` for each cfg in order; stop at the first failure.

    The failure is re-raised as :class:`SubtestFailure` (an ``AssertionError``)
    chained to the original exception, with the config in the message.
    """
    if not grid:
        raise ValueError(f"run_subtests{f'({label})' if label else ''}: empty grid runs nothing")
    prefix = f"{label}: " if label else ""
    for index, cfg in enumerate(grid):
        try:
            fn(**cfg)
        except Exception as exc:
            message = f"{prefix}subtest {index + 1}/{len(grid)} {cfg} failed: {type(exc).__name__}: {exc}"
            raise SubtestFailure(message, dict(cfg), index) from exc
