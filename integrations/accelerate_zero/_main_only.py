"""A collective called on the main process only: found from the caller's source, at once.

``accelerator.get_state_dict(model)`` of a ZeRO-3 model gathers every sharded parameter from
all processes, so every process must call it; under ``if accelerator.is_main_process:`` the
main process waits in the first gather for processes that never come, until the collective's
timeout. No message can reach the waiting process from the others, so the call is checked where
it is made: the source lines of the calling frames (outside Accelerate, torch and this
package) are parsed, and a call inside the body of an ``if`` whose test names the process
(``is_main_process``, ``is_local_main_process``, ``process_index``, ``local_process_index``,
``get_rank``) is refused with the fix, before any collective. A call the check cannot see
(source not available, a flag computed elsewhere) waits as before and ends at ``comm_timeout``
with the named collective error.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
from functools import lru_cache
from types import FrameType

import accelerate
import torch

import zero_strategy

__all__ = ["main_process_only_test"]

_PROCESS_NAMES = ("is_main_process", "is_local_main_process", "process_index", "local_process_index", "get_rank")
_LIBRARIES = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (accelerate.__file__, torch.__file__, zero_strategy.__file__, __file__)
    if path is not None
)


@lru_cache(maxsize=64)
def _tree(filename: str, size: int) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _guard(tree: ast.Module, line: int) -> str | None:
    """The test of an ``if`` whose body (not its ``else``) holds ``line`` and names the process."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not node.body:
            continue
        end = node.body[-1].end_lineno or node.body[-1].lineno
        if node.body[0].lineno <= line <= end:
            test = ast.unparse(node.test)
            if any(name in test for name in _PROCESS_NAMES):
                return test
    return None


def main_process_only_test(depth: int = 2) -> str | None:
    """The ``if`` test (its source) under which the caller's caller runs on some processes only, or None."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_LIBRARIES):
            linecache.checkcache(filename)
            tree = _tree(filename, len(linecache.getlines(filename)))
            test = _guard(tree, frame.f_lineno) if tree is not None else None
            if test is not None:
                return test
        frame = frame.f_back
    return None
