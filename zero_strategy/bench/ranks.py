"""How ``zero-strategy bench`` starts its ranks: ``torchrun`` where torch has it, else the test
harness's own launcher (:func:`zero_strategy.testing.launch`).

Both run the same rank program (``python -m zero_strategy.testing._child``) with the same file
protocol: the function and its arguments are pickled into a private directory, each rank writes
its result there, meets the others at a final barrier and writes a marker before the process
group goes. With torchrun, torch's elastic agent starts the ranks (``RANK``, ``WORLD_SIZE`` and
the rendezvous come from it, on 127.0.0.1) and its exit code is read together with those files:
gloo sometimes aborts a rank at teardown after every rank passed the final barrier, which is
not a failure of the run, as with the own launcher.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zero_strategy.testing import launch
from zero_strategy.testing.launcher import (
    _REPO_ROOT,
    LaunchTimeout,
    RankFailure,
    _free_port,
    _load_results,
    _write_spec,
    barrier_path,
    error_path,
    result_path,
)

__all__ = ["LAUNCHERS", "choose_launcher", "has_torchrun", "start_ranks"]

LAUNCHERS = ("auto", "torchrun", "own")
PG_TIMEOUT_S = 60.0
TAIL_CHARS = 4000


def has_torchrun() -> bool:
    """Whether ``python -m torch.distributed.run`` (what the ``torchrun`` script runs) exists."""
    try:
        return importlib.util.find_spec("torch.distributed.run") is not None
    except ModuleNotFoundError:
        return False


def choose_launcher(launcher: str = "auto") -> str:
    """``"torchrun"`` or ``"own"``: ``auto`` picks torchrun when present."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"bench: --launcher {launcher!r}: choose one of {LAUNCHERS}")
    if launcher == "torchrun" and not has_torchrun():
        raise ValueError("bench: --launcher torchrun: torch.distributed.run is not importable; use --launcher own")
    if launcher == "auto":
        return "torchrun" if has_torchrun() else "own"
    return launcher


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
    launcher: str = "auto",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the per-rank results in rank
    order. Raises :class:`RankFailure` (a rank failed) or :class:`LaunchTimeout`."""
    if choose_launcher(launcher) == "own":
        return launch(fn, world_size, args=args, timeout=timeout, env=env)
    return _torchrun(fn, world_size, args, timeout, env or {})


def _torchrun(fn: Callable[..., Any], n: int, args: tuple[Any, ...], timeout: float, env: dict[str, str]) -> list[Any]:
    launch_dir = tempfile.mkdtemp(prefix="zero_torchrun_")
    try:
        _write_spec(launch_dir, fn, args, {}, PG_TIMEOUT_S, frozenset())
        child_env = dict(os.environ)
        child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        child_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()}})
        old = child_env.get("PYTHONPATH", "")
        child_env["PYTHONPATH"] = str(_REPO_ROOT) + (os.pathsep + old if old else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
               "-m", "zero_strategy.testing._child", launch_dir]  # fmt: skip
        log = Path(launch_dir, "torchrun.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=child_env, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise LaunchTimeout(f"torchrun ({n} ranks) timed out after {timeout:g} s\n{_tail(log)}",
                                    list(range(n))) from None  # fmt: skip
        errors = [r for r in range(n) if error_path(launch_dir, r).exists()]
        missing = [r for r in range(n) if not result_path(launch_dir, r).exists()]
        passed = all(barrier_path(launch_dir, r).exists() for r in range(n))
        if errors or missing or (rc != 0 and not passed):
            detail = "".join(f"--- rank {r}:\n{error_path(launch_dir, r).read_text()[-TAIL_CHARS:]}" for r in errors)
            raise RankFailure(
                f"torchrun ({n} ranks) exited with {rc}: rank(s) {errors or missing} failed\n{detail}{_tail(log)}",
                errors or missing,
            )
        return _load_results(launch_dir, "torchrun", n, frozenset())
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _tail(log: Path) -> str:
    try:
        return "--- torchrun output (tail):\n" + log.read_text(errors="replace")[-TAIL_CHARS:]
    except OSError:
        return ""
