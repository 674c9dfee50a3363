"""Multi-rank test launcher: run a module-level function on N fresh gloo ranks.

Every rank is a fresh ``python -m zero_strategy.testing._child`` subprocess in its
own session (so a rank's whole process tree can be killed), with a CPU gloo
process group. The function is located by source file + ``__qualname__`` so that
pytest test files imported with ``--import-mode=importlib`` work. Arguments and
return values travel by pickle through files in a private temp directory.

This module must stay importable without pytest (it only needs the stdlib; torch
is imported by the children, and by ``pickle`` when results contain tensors).
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LaunchTimeout",
    "RankFailure",
    "TeardownAbort",
    "TeardownAbortWarning",
    "launch",
    "teardown_aborts",
]

# --- file protocol shared with zero_strategy.testing._child ---------------------
SPEC_FILE = "spec.pkl"
KEEP_DIR_ENV = "ZERO_KEEP_LAUNCH_DIR"
# Test-only hook honoured by the child, "<rank>:<how>": that rank ends after writing its result,
# how = abort_after_barrier (gloo's teardown SIGABRT, tolerated), abort_before_barrier,
# exit1_after_barrier, traceback_abort_after_barrier (all failures).
EXIT_AFTER_RESULT_ENV = "ZERO_LAUNCH_TEST_EXIT_AFTER_RESULT"

POLL_INTERVAL_S = 0.1
FAILURE_GRACE_S = 2.0
STACK_DUMP_WAIT_S = 1.0
REAP_TIMEOUT_S = 2.0
TAIL_LINES = 40
TAIL_MAX_BYTES = 64 * 1024

_REPO_ROOT = Path(__file__).resolve().parents[2]


def result_path(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(launch_dir) / f"result_{rank}.pkl"


def error_path(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(launch_dir) / f"error_{rank}.txt"


def barrier_path(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    """Written by a rank after the final barrier, before the process group is destroyed."""
    return Path(launch_dir) / f"barrier_{rank}"


def stdout_path(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(launch_dir) / f"stdout_{rank}.txt"


def stderr_path(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(launch_dir) / f"stderr_{rank}.txt"


# --- public error / bookkeeping types --------------------------------------------
class RankFailure(RuntimeError):
    """One or more ranks failed; the message has every rank's status and output."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class LaunchTimeout(RankFailure):
    """The launch exceeded its timeout; ``failed_ranks`` are the ranks still running."""


class TeardownAbortWarning(RuntimeWarning):
    """A rank wrote its result but then died during process-group teardown."""


@dataclass(frozen=True)
class TeardownAbort:
    """Record of a rank that finished its work but exited non-zero in teardown."""

    fn: str
    rank: int
    returncode: int
    status: str


# Every tolerated teardown abort seen by this process, oldest first. Mutated in
# place only (never rebound), so ``from ... import teardown_aborts`` stays live.
teardown_aborts: list[TeardownAbort] = []


# --- internals ---------------------------------------------------------------------
@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    killed_by_launcher: bool = False


def _describe_fn(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _locate(fn: Callable[..., Any]) -> tuple[str, str]:
    """Return (absolute source file, qualname) for a module-level function."""
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(qualname, str):
        raise TypeError(f"launch() needs a function, got {fn!r}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"launch() needs a module-level function (children re-load it from its file "
            f"by qualified name); {qualname!r} is a lambda or is nested in a function"
        )
    try:
        source = inspect.getsourcefile(fn)
    except TypeError as exc:
        raise ValueError(f"launch() cannot find the source file of {qualname!r}: {exc}") from exc
    if source is None or not os.path.isfile(source):
        raise ValueError(f"launch() cannot find the source file of {qualname!r} (got {source!r})")
    return os.path.abspath(source), qualname


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_env(rank: int, world_size: int, port: int, launch_dir: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if sys.platform.startswith("linux"):
        # Keep gloo on loopback even where the hostname resolves to an unreachable address.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    old_path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(_REPO_ROOT) + (os.pathsep + old_path if old_path else "")
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ZERO_LAUNCH_DIR=launch_dir,
    )
    return env


def _start_rank(rank: int, world_size: int, launch_dir: str, env: dict[str, str]) -> _Rank:
    cmd = [sys.executable, "-m", "zero_strategy.testing._child", launch_dir, str(rank), str(world_size)]
    with open(stdout_path(launch_dir, rank), "wb") as out, open(stderr_path(launch_dir, rank), "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True)
    return _Rank(rank=rank, proc=proc)


def _signal_group(r: _Rank, sig: signal.Signals) -> None:
    try:
        os.killpg(r.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(ranks: list[_Rank]) -> None:
    """SIGKILL every rank's process group (also reaps leftovers of exited ranks)."""
    for r in ranks:
        if r.proc.poll() is None:
            r.killed_by_launcher = True
        _signal_group(r, signal.SIGKILL)
    for r in ranks:
        try:
            r.proc.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass


def _dump_stacks(ranks: list[_Rank]) -> None:
    """Ask live ranks for faulthandler stack dumps (to their stderr) and wait briefly."""
    live = [r for r in ranks if r.proc.poll() is None]
    for r in live:
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)  # leader only: it has the handler
        except ProcessLookupError:
            pass
    if live:
        time.sleep(STACK_DUMP_WAIT_S)


def _status(r: _Rank) -> str:
    code = r.proc.returncode
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        suffix = " (sent by the launcher)" if r.killed_by_launcher and -code == signal.SIGKILL else ""
        return f"killed by {name}{suffix}"
    return f"exit code {code}"


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_MAX_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _rank_report(launch_dir: str, r: _Rank) -> str:
    has_result = result_path(launch_dir, r.rank).exists()
    parts = [f"--- rank {r.rank}: {_status(r)}" + (" [result written]" if has_result else " [no result]")]
    err = error_path(launch_dir, r.rank)
    if err.exists():
        parts.append("  traceback:\n" + _indent(err.read_text(errors="replace").rstrip()))
    for label, path in (("stderr", stderr_path(launch_dir, r.rank)), ("stdout", stdout_path(launch_dir, r.rank))):
        tail = _tail(path)
        if tail.strip():
            parts.append(f"  {label} (last {TAIL_LINES} lines):\n" + _indent(tail))
    return "\n".join(parts)


def _full_report(headline: str, launch_dir: str, ranks: list[_Rank], kept: bool) -> str:
    sections = [headline]
    sections.extend(_rank_report(launch_dir, r) for r in ranks)
    if kept:
        sections.append(f"(launch dir kept at {launch_dir})")
    return "\n".join(sections)


def _failed_without_result(launch_dir: str, ranks: list[_Rank], may_die: frozenset[int]) -> list[int]:
    return [
        r.rank
        for r in ranks
        if r.rank not in may_die and r.proc.poll() is not None and not result_path(launch_dir, r.rank).exists()
    ]


def _wait(ranks: list[_Rank], launch_dir: str, timeout: float, may_die: frozenset[int]) -> tuple[str, list[int]]:
    """Poll until all exit ("done"), a rank fails ("failed"), or time runs out ("timeout").

    After the first failure the other ranks get FAILURE_GRACE_S to finish writing
    their own tracebacks; the timeout no longer applies then (the grace is bounded).
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        now = time.monotonic()
        all_done = all(r.proc.poll() is not None for r in ranks)
        failed = _failed_without_result(launch_dir, ranks, may_die)
        if failed and failed_at is None:
            failed_at = now
        if all_done:
            return ("failed", failed) if failed else ("done", [])
        if failed_at is not None and now - failed_at >= FAILURE_GRACE_S:
            return "failed", failed
        if failed_at is None and now >= deadline:
            return "timeout", [r.rank for r in ranks if r.proc.poll() is None]
        time.sleep(POLL_INTERVAL_S)


def _python_exception_in_output(launch_dir: str, rank: int) -> bool:
    for path in (stderr_path(launch_dir, rank), stdout_path(launch_dir, rank), error_path(launch_dir, rank)):
        try:
            if "Traceback (most recent call last)" in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def torchrun_teardown_abort(stderr: str) -> bool:
    """Whether an elastic launcher (torchrun, ``accelerate launch``) reported only gloo's
    teardown abort: some child died of SIGABRT (``exitcode : -6``) and every other failed child
    of the SIGTERM the launcher then sends to the rest (``-15``). The caller adds its own
    evidence that the work was done first (results written, last words printed): this alone
    does not say when the abort came."""
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]
    return -signal.SIGABRT in codes and all(c in (-signal.SIGABRT, -signal.SIGTERM) for c in codes)


def _teardown_abort_ok(launch_dir: str, r: _Rank, ranks: list[_Rank], may_die: frozenset[int]) -> bool:
    """The one tolerated non-zero exit: gloo's teardown SIGABRT, after the final barrier, with
    every rank's result written and no Python exception in any rank's output."""
    if r.proc.returncode != -signal.SIGABRT or not barrier_path(launch_dir, r.rank).exists():
        return False
    if any(not result_path(launch_dir, o.rank).exists() for o in ranks if o.rank not in may_die):
        return False
    return not any(_python_exception_in_output(launch_dir, o.rank) for o in ranks)


def _check_exits(fn_name: str, launch_dir: str, ranks: list[_Rank], may_die: frozenset[int], keep: bool) -> None:
    """Every rank that wrote its result must also have exited cleanly; a crash after the result
    (an exception in teardown, an abort before the final barrier) fails the launch."""
    bad = []
    for r in ranks:
        if r.proc.returncode == 0 or r.rank in may_die:
            continue
        if _teardown_abort_ok(launch_dir, r, ranks, may_die):
            record = TeardownAbort(fn=fn_name, rank=r.rank, returncode=int(r.proc.returncode), status=_status(r))
            teardown_aborts.append(record)
            warnings.warn(
                f"launch({fn_name}): rank {r.rank} wrote its result, passed the final barrier, then exited with "
                f"{record.status} while destroying the process group (gloo's known teardown abort): counted as success",
                TeardownAbortWarning,
                stacklevel=3,
            )
            continue
        bad.append(r.rank)
    if bad:
        headline = (
            f"launch({fn_name}, world_size={len(ranks)}) failed: rank(s) {bad} exited non-zero after writing their "
            "result; only gloo's teardown SIGABRT after the final barrier, with no Python exception in any "
            "rank's output, is tolerated"
        )
        raise RankFailure(_full_report(headline, launch_dir, ranks, keep), bad)


def _load_results(launch_dir: str, fn_name: str, world_size: int, may_die: frozenset[int]) -> list[Any]:
    results: list[Any] = []
    for rank in range(world_size):
        if rank in may_die and not result_path(launch_dir, rank).exists():
            results.append(None)
            continue
        try:
            with open(result_path(launch_dir, rank), "rb") as f:
                results.append(pickle.load(f))
        except Exception as exc:
            raise RuntimeError(
                f"launch({fn_name}): cannot unpickle rank {rank}'s result ({type(exc).__name__}: {exc}); "
                f"return plain data or tensors, not objects of classes defined in the test file"
            ) from exc
    return results


def _write_spec(
    launch_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    pg_timeout: float,
    may_die: frozenset[int],
) -> None:
    source, qualname = _locate(fn)
    spec = {
        "source": source,
        "qualname": qualname,
        "args": tuple(args),
        "kwargs": dict(kwargs),
        "pg_timeout": float(pg_timeout),
        "may_die": sorted(may_die),
    }
    try:
        payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"launch({qualname}): args/kwargs must be picklable (plain data / tensors): {exc}") from exc
    Path(launch_dir, SPEC_FILE).write_bytes(payload)


def _validate(world_size: int, timeout: float, pg_timeout: float) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch(): world_size must be a positive int, got {world_size!r}")
    if timeout <= 0 or pg_timeout <= 0:
        raise ValueError(f"launch(): timeout and pg_timeout must be > 0, got {timeout}, {pg_timeout}")


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    pg_timeout: float = 60.0,
    may_die: frozenset[int] | set[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function in a ``.py`` file; each rank re-loads that
    file under a private module name. Returns the per-rank return values, in rank
    order. Raises :class:`RankFailure` when a rank exits without a result and
    :class:`LaunchTimeout` after ``timeout`` seconds (with stack dumps of live
    ranks). A rank that exits non-zero after writing its result fails the launch too,
    with one exception: gloo's teardown SIGABRT, after the final barrier, with every
    rank's result written and no Python exception in any rank's output; it is recorded
    in :data:`teardown_aborts` and a :class:`TeardownAbortWarning` is emitted. Ranks in
    ``may_die`` (for failure-injection tests) may exit without a result; their entry in
    the returned list is ``None``, and no rank waits at the final barrier.
    """
    may_die = frozenset(may_die)
    _validate(world_size, timeout, pg_timeout)
    fn_name = _describe_fn(fn)
    keep = os.environ.get(KEEP_DIR_ENV) == "1"
    launch_dir = tempfile.mkdtemp(prefix="zero_launch_")
    ranks: list[_Rank] = []
    try:
        _write_spec(launch_dir, fn, args, kwargs or {}, pg_timeout, may_die)
        port = _free_port()
        for rank in range(world_size):
            child_env = _child_env(rank, world_size, port, launch_dir, env)
            ranks.append(_start_rank(rank, world_size, launch_dir, child_env))
        outcome, bad = _wait(ranks, launch_dir, timeout, may_die)
        if outcome == "timeout":
            _dump_stacks(ranks)
            _kill_all(ranks)
            headline = (
                f"launch({fn_name}, world_size={world_size}) timed out after {timeout:g} s; ranks still running: {bad}"
            )
            raise LaunchTimeout(_full_report(headline, launch_dir, ranks, keep), bad)
        if outcome == "failed":
            _kill_all(ranks)
            headline = (
                f"launch({fn_name}, world_size={world_size}) failed: rank(s) {bad} exited without writing a result"
            )
            raise RankFailure(_full_report(headline, launch_dir, ranks, keep), bad)
        _check_exits(fn_name, launch_dir, ranks, may_die, keep)
        return _load_results(launch_dir, fn_name, world_size, may_die)
    finally:
        _kill_all(ranks)  # no-op for reaped ranks; guarantees nothing outlives us
        if not keep:
            shutil.rmtree(launch_dir, ignore_errors=True)
