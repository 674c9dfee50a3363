"""One rank of :func:`zero_strategy.testing.launch`; run as ``python -m zero_strategy.testing._child``.

argv: ``<launch_dir> <rank> <world_size>``, or ``<launch_dir>`` alone under torchrun (which sets
``RANK`` and ``WORLD_SIZE``; :mod:`zero_strategy.bench.ranks`). Protocol (see launcher.py):
reads ``spec.pkl``, writes ``result_<rank>.pkl`` (atomically) on success, then meets the other
ranks at a final barrier and writes ``barrier_<rank>`` before destroying the process group; on
failure it writes ``error_<rank>.txt`` and exits 1 (without any barrier).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from zero_strategy.testing.launcher import EXIT_AFTER_RESULT_ENV, SPEC_FILE, barrier_path, error_path, result_path


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_module(source: str) -> ModuleType:
    name = "_zero_launch_target_" + "".join(c if c.isalnum() else "_" for c in Path(source).stem)
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot build an import spec for {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so dataclasses / pickling by reference inside the module work
    spec.loader.exec_module(module)
    return module


def _resolve(module: ModuleType, qualname: str, source: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise AttributeError(f"{qualname!r} not found in {source} (missing {part!r})") from exc
    if not callable(obj):
        raise TypeError(f"{qualname!r} in {source} is not callable: {obj!r}")
    return obj


def _run(launch_dir: str, rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from zero_strategy.testing import _pg

    torch.set_num_threads(1)
    with open(Path(launch_dir, SPEC_FILE), "rb") as f:
        spec: dict[str, Any] = pickle.load(f)
    fn = _resolve(_load_module(spec["source"]), spec["qualname"], spec["source"])
    _pg.init_default_group("gloo", spec["pg_timeout"])
    result = fn(rank, world_size, *spec["args"], **spec["kwargs"])
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"return value of {spec['qualname']} is not picklable: {exc}") from exc
    _write_atomic(result_path(launch_dir, rank), payload)
    return spec


def _test_exit(rank: int, point: str) -> None:
    """The launcher's self-tests end a rank at ``point`` (see EXIT_AFTER_RESULT_ENV)."""
    wanted = os.environ.get(EXIT_AFTER_RESULT_ENV, "")
    if wanted.partition(":")[0] != str(rank):
        return
    how = wanted.partition(":")[2]
    _flush()
    if how == f"abort_{point}":
        os.abort()
    if how == f"exit1_{point}":
        os._exit(1)
    if how == f"traceback_abort_{point}":
        sys.stderr.write('Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: late failure\n')
        _flush()
        os.abort()


def _teardown(launch_dir: str, rank: int, spec: dict[str, Any]) -> None:
    """The final barrier, its marker file, then the group's destruction. Launches where a rank
    may die on purpose skip the barrier (the survivors have nobody to meet)."""
    from zero_strategy.testing import _pg

    _test_exit(rank, "before_barrier")
    if not spec.get("may_die"):
        _pg.barrier_default_group()
    _write_atomic(barrier_path(launch_dir, rank), b"")
    _test_exit(rank, "after_barrier")
    _pg.destroy_default_group(barrier=False)


def _report_failure(launch_dir: str, rank: int, exc: BaseException) -> None:
    """Write the traceback to error_<rank>.txt (stderr gets a pointer, or the text as fallback)."""
    text = traceback.format_exc()
    try:
        _write_atomic(error_path(launch_dir, rank), text.encode("utf-8", errors="replace"))
        sys.stderr.write(f"rank {rank} failed: {type(exc).__name__}: {exc} (traceback in error_{rank}.txt)\n")
    except BaseException:
        sys.stderr.write(text)
    _flush()


def main(argv: list[str]) -> int:
    if len(argv) == 1 and "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        argv = [argv[0], os.environ["RANK"], os.environ["WORLD_SIZE"]]
    if len(argv) != 3:
        print(f"usage: python -m zero_strategy.testing._child LAUNCH_DIR [RANK WORLD_SIZE] (without them: RANK and "
              f"WORLD_SIZE from the environment, as torchrun sets them); got {argv}", file=sys.stderr)  # fmt: skip
        return 2
    launch_dir, rank, world_size = argv[0], int(argv[1]), int(argv[2])
    faulthandler.enable(all_threads=True)  # segfault / abort -> Python stacks on stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launcher asks for stacks on timeout
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        spec = _run(launch_dir, rank, world_size)
    except BaseException as exc:
        _report_failure(launch_dir, rank, exc)
        os._exit(1)  # never wait on a barrier after a failure
    try:
        _teardown(launch_dir, rank, spec)
    except BaseException:
        sys.stderr.write("process-group teardown failed after the result was written:\n")
        sys.stderr.write(traceback.format_exc())
        _flush()
        os._exit(1)
    _flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
