"""The disk tier (``offload_optimizer: {device: nvme}``): optimizer state in swap files.

Each offloaded group keeps its per-element optimizer state (Adam's two moments, SGD's momentum,
...) in one file per rank. The state exists in memory only while its group steps:

    read group i+1  |  step group i  |  write group i-1

through a small pool of aligned host buffers (pinned on a GPU machine) and a thread pool that
calls ``os.preadv``/``os.pwritev``, with ``O_DIRECT`` where the filesystem allows it (no page
cache: the bytes really leave RAM). No compiled op. The pool is sized from what the largest
group needs, at most ``buffer_count`` buffers, never ``buffer_size`` x ``buffer_count`` blindly.

The fp32 master pieces stay in host memory (``HostMasters``): the parameters follow them after
every step without a read. On disk: 8 of Adam's 12 optimizer bytes per parameter.

Files live in a fresh directory per process, ``<nvme_path>/zero_strategy_swap/<host>-<pid>-rank<r>-<id>``
(``nvme_path`` unset: under the temp dir, logged once). An owner marker (pid, host, process start
time) lets the next start remove what a killed run left; a normal exit, an exception or
``destroy()`` removes the directory. Reads check each file's size, and a directory whose
marker names another run is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import mmap
import os
import shutil
import socket
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "DiskFile", "SwapDir", "SwapPool", "clean_stale_runs", "direct_io_works"]

ALIGN = 4096  # O_DIRECT: buffer address, offset and length in multiples of the block size
SWAP_ROOT = "zero_strategy_swap"
OWNER = "owner.json"
_LOGGED: set[str] = set()


def _round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _proc_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone: a pid that was
    reused by another process has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # another machine's run (a shared filesystem): never ours to judge
    pid = int(owner.get("pid", -1))
    return pid > 0 and _proc_start(pid) == owner.get("start")


def clean_stale_runs(root: str) -> list[str]:
    """Remove the run directories under ``root/zero_strategy_swap`` whose owner on this host is
    gone (a run killed by SIGKILL leaves no exit hook). Returns what was removed."""
    base = os.path.join(root, SWAP_ROOT)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(base):
            run = os.path.join(base, name)
            try:
                with open(os.path.join(run, OWNER)) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue  # no marker (yet, or not ours): leave it
            if not _owner_alive(owner):
                shutil.rmtree(run, ignore_errors=True)
                removed.append(run)
    return removed


def _is_tmpfs(path: str) -> bool:
    best, fstype = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype in ("tmpfs", "ramfs")


def direct_io_works(directory: str) -> bool:
    """Whether ``O_DIRECT`` opens and writes in ``directory`` (tmpfs and some overlays refuse it)."""
    path = os.path.join(directory, f".odirect-{uuid.uuid4().hex}")
    buf = mmap.mmap(-1, ALIGN)  # page-aligned
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
        try:
            os.pwritev(fd, [buf], 0)
        finally:
            os.close(fd)
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


class SwapDir:
    """This run's swap directory on one rank: created fresh, marked with its owner, removed at
    exit (``atexit``), on :meth:`remove` and when the engine is destroyed."""

    def __init__(self, nvme_path: str | None, rank: int) -> None:
        root = nvme_path or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        for stale in clean_stale_runs(root):
            warnings.warn(f"offload: removed swap files left by a run that is gone: {stale}", UserWarning, stacklevel=4)
        self.run = f"{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
        self.path = self.run_dir = os.path.join(root, SWAP_ROOT, self.run)
        os.makedirs(self.path, exist_ok=False)  # fresh: never another run's files
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()), "run": self.run}
        with open(os.path.join(self.path, OWNER), "x") as f:
            json.dump(owner, f)
        if nvme_path is None and root not in _LOGGED:
            _LOGGED.add(root)
            warnings.warn(f"offload_optimizer.nvme_path is not set: swap files go to {self.run_dir} "
                          "(removed at exit)", UserWarning, stacklevel=4)  # fmt: skip
        if _is_tmpfs(os.path.realpath(root)):
            warnings.warn(
                f"offload nvme_path {root} is on tmpfs: the 'disk' is RAM and O_DIRECT fails there; point "
                "nvme_path at a real disk for offload to save memory",
                UserWarning,
                stacklevel=4,
            )
        self.direct = direct_io_works(self.path)
        self._removed = False
        atexit.register(self.remove)

    def check_owner(self) -> None:
        """Refuse a directory that another run marked (files must be this run's)."""
        try:
            with open(os.path.join(self.run_dir, OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"offload: the swap directory {self.run_dir} lost its owner marker ({e})") from e
        if owner.get("run") != self.run:
            raise RuntimeError(
                f"offload: the swap directory {self.run_dir} belongs to run {owner.get('run')!r}, not this run "
                f"({self.run!r}); refusing to read its files. Use a separate nvme_path per job."
            )

    def check_space(self, nbytes: int) -> None:
        """A clear error before the first step when the swap space does not fit."""
        free = shutil.disk_usage(self.path).free
        if nbytes > free:
            raise RuntimeError(
                f"offload: the swap files need {nbytes / 2**30:.2f} GiB in {self.path} but only "
                f"{free / 2**30:.2f} GiB are free ({nbytes} bytes needed, {free} free); free space there, point "
                "offload_optimizer.nvme_path at a larger disk, or offload a smaller share (ratio)"
            )

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.remove)


def aligned_empty(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (rounded up to the block size) whose address is
    block-aligned, as ``O_DIRECT`` needs."""
    size = _round_up(max(nbytes, 1))
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + size]


@dataclass(frozen=True)
class Region:
    """One state tensor's place in a group's file and in its buffer."""

    key: str
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class DiskFile:
    """One group's swap file: its regions (one per state tensor of each master), written and
    read whole through a buffer."""

    def __init__(self, path: str, regions: Sequence[Region], direct: bool) -> None:
        self.path = path
        self.regions = list(regions)
        self.nbytes = _round_up(max((r.offset + r.nbytes for r in regions), default=0))
        flags = os.O_CREAT | os.O_RDWR | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        self.written = False

    def check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.nbytes:
            raise RuntimeError(
                f"offload: swap file {self.path} has {size} bytes, expected {self.nbytes}; it was changed or "
                "truncated outside this run (the optimizer state in it is lost)"
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


_CHUNK = 64 << 20  # one preadv/pwritev call per 64 MiB: several threads share a large file


def _io(fn: Callable[..., int], fd: int, buf: torch.Tensor, offset: int, what: str) -> None:
    view = buf.numpy().data  # a memoryview over the tensor's bytes
    pos = 0
    while pos < len(view):
        n = fn(fd, [view[pos : pos + _CHUNK]], offset + pos)
        if n <= 0:
            raise OSError(f"offload: {what} moved {n} bytes at offset {offset + pos}")
        pos += n


class SwapPool:
    """Aligned host buffers (at most ``count``, each as large as the largest file) and a thread
    pool for the reads and writes. Buffers are made on first need, so the pool holds only what
    the pipeline uses (``allocated`` bytes, reported by ``memory_stats``)."""

    def __init__(self, count: int, buffer_bytes: int, pinned: bool, threads: int = 4) -> None:
        self.count = max(count, 2)
        self.buffer_bytes = _round_up(buffer_bytes)
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zero-swap")

    @property
    def allocated(self) -> int:
        return self._made * self.buffer_bytes

    def get(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made >= self.count:
                raise RuntimeError(
                    f"offload: all {self.count} swap buffers are in use (an engine bug: please report it)"
                )
            self._made += 1
        return aligned_empty(self.buffer_bytes, self.pinned)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def read(self, f: DiskFile, buf: torch.Tensor) -> Future[None]:
        f.check_size()
        return self._io.submit(_io, os.preadv, f.fd, buf[: f.nbytes], 0, f"read of {f.path}")

    def write(self, f: DiskFile, buf: torch.Tensor) -> Future[None]:
        def run() -> None:
            _io(os.pwritev, f.fd, buf[: f.nbytes], 0, f"write of {f.path}")
            f.written = True

        return self._io.submit(run)

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        self._free.clear()


def views(buf: torch.Tensor, regions: Sequence[Region]) -> Iterator[tuple[Region, torch.Tensor]]:
    """Typed views of each region inside a uint8 buffer."""
    for r in regions:
        yield r, buf[r.offset : r.offset + r.nbytes].view(r.dtype)
