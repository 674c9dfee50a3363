"""Feedback on long checkpoint work: a progress bar with bytes per second while
``zero-strategy export`` writes or ``load_full_state_dict`` reads a large file, and one log
line (``logging``, INFO, logger ``zero_strategy.checkpoint``) per checkpoint save and load with
its duration and size.

The bar shows on rank 0 only, only when standard error is a terminal (never in pipes, logs or
tests) and only for at least :data:`MIN_BYTES`; it is drawn by ``rich`` when that is installed
(``pip install zero-strategy[bench]``) and is silently absent otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["MIN_BYTES", "byte_progress", "dir_bytes", "log"]

log = logging.getLogger("zero_strategy.checkpoint")
MIN_BYTES = 64 * 2**20  # smaller reads and writes end before a bar would help


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


@contextlib.contextmanager
def byte_progress(
    total: int, description: str, *, rank: int = 0, stream: IO[str] | None = None, min_bytes: int = MIN_BYTES
) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(nbytes)``; a bar with bytes/s is shown when ``rank`` is 0, ``stream``
    (standard error by default) is a terminal and ``total`` is at least ``min_bytes``."""
    out = sys.stderr if stream is None else stream
    try:
        shown = rank == 0 and total >= min_bytes and out.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        shown = False
    if not shown:
        yield lambda nbytes: None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:
        yield lambda nbytes: None
        return
    columns: list[Any] = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          TimeRemainingColumn()]  # fmt: skip
    with Progress(*columns, console=Console(file=out, force_terminal=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)
