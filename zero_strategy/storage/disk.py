"""The disk tier (``device: nvme``): swap files for the optimizer state (here and in
``swapped_state.py``) and for ZeRO-3's parameter rows (``disk_rows.py``).

Each offloaded group keeps its per-element optimizer state (Adam's two moments, SGD's momentum,
...) in one file per rank. The state exists in memory only while its group steps:

    read group i+1  |  step group i  |  write group i-1

through a small pool of aligned host buffers (pinned on a GPU machine) and a thread pool that
calls ``os.preadv``/``os.pwritev``, with ``O_DIRECT`` where the filesystem allows it (no page
cache: the bytes really leave RAM). No compiled op. The pool is sized from what the largest
group needs: 3 buffers (2 if ``buffer_count`` is smaller), never ``buffer_size`` x
``buffer_count`` blindly.

The fp32 master pieces stay in host memory (``HostMasters``): the parameters follow them after
every step without a read. On disk: 8 of Adam's 12 optimizer bytes per parameter.

Files live in a fresh directory per process, ``<nvme_path>/zero_strategy_swap-<uid>/<host>-<pid>-rank<r>-<id>``
(``nvme_path`` unset: under the temp dir, logged once; the per-user directory is 0700 and must be
a real directory of this user). An owner marker (pid, process start time, host, boot, pid
namespace) lets the next start remove what a killed run left; a normal exit, an exception or
``destroy()`` removes the directory. Reads check each file's size, and a directory whose
marker names another run is refused.

Every read and write is counted (:func:`io_clock`, process-wide): bytes, seconds of I/O in any
thread (``busy_s``), and seconds the training thread *waited* on it (``waited_s``: a read or write
done in that thread, or a wait on the pool's future through :func:`wait_io`), which is the I/O's
share of the step time (``zero-strategy bench``'s offload I/O bar).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import mmap
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN",
    "DiskFile",
    "SwapDir",
    "SwapPool",
    "aligned_empty",
    "clean_stale_runs",
    "direct_io_works",
    "io_at",
    "io_clock",
    "swap_root_name",
    "wait_io",
]

ALIGN = 4096  # O_DIRECT: buffer address, offset and length in multiples of the block size
SWAP_ROOT = "zero_strategy_swap"
OWNER = "owner.json"
_LOGGED: set[tuple[str, str]] = set()


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


def _machine() -> dict[str, str]:
    """What makes a pid meaningful: the host name, this boot, and the pid namespace (two
    containers sharing a host name have different namespaces)."""
    out = {"host": socket.gethostname()}
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        out["boot"] = f.read().strip()
    with contextlib.suppress(OSError):
        out["pidns"] = os.readlink("/proc/self/ns/pid")
    return out


def _owner_alive(owner: dict) -> bool:
    """Whether the run that wrote ``owner`` may still be running. Only an owner from this very
    machine, boot and pid namespace can be judged gone; any other is left alone."""
    if any(owner.get(k) != v for k, v in _machine().items()):
        return True
    pid = int(owner.get("pid", -1))
    return pid > 0 and _proc_start(pid) == owner.get("start")


def swap_root_name() -> str:
    """One directory per user under ``nvme_path``: another user's runs are never in it."""
    return f"{SWAP_ROOT}-{os.getuid()}"


def clean_stale_runs(root: str) -> list[str]:
    """Remove this user's run directories under ``root`` whose owner is gone (a run killed by
    SIGKILL leaves no exit hook). Returns what was removed."""
    base = os.path.join(root, swap_root_name())
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
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


def _private_dir(path: str, what: str) -> None:
    """Create ``path`` (mode 0700) or accept it only if it is a real directory of this user."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(
            f"{what}: {path} is not a directory of this user (a symlink, a file or another user's); remove it or "
            "choose another nvme_path"
        )


def _is_tmpfs(path: str) -> bool:
    best, fstype = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, fstype = mount, parts[2]
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

    def __init__(self, nvme_path: str | None, rank: int, field: str = "offload_optimizer") -> None:
        self.field = field  # the config block this directory serves (named in every error)
        self._fix = f"point {field}.nvme_path at a larger disk" + (
            ", or offload a smaller share (ratio)" if field == "offload_optimizer" else ""
        )
        what = f"initialize(): zero_optimization.{field}.nvme_path"
        root = nvme_path or tempfile.gettempdir()
        try:
            os.makedirs(root, exist_ok=True)
            base = os.path.join(root, swap_root_name())
            _private_dir(base, what)
            for stale in clean_stale_runs(root):
                warnings.warn(
                    f"offload: removed swap files left by a run that is gone: {stale}", UserWarning, stacklevel=4
                )
            self.run = f"{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
            self.path = self.run_dir = os.path.join(base, self.run)
            os.mkdir(self.path, 0o700)  # fresh: never another run's files
            owner = {**_machine(), "pid": os.getpid(), "start": _proc_start(os.getpid()), "run": self.run}
            with open(os.path.join(self.path, OWNER), "x") as f:
                json.dump(owner, f)
        except OSError as e:
            raise RuntimeError(
                f"{what}={root!r}: cannot create the swap directory there ({type(e).__name__}: {e}); point nvme_path "
                "at a writable directory on a local disk"
            ) from e
        if nvme_path is None and (root, field) not in _LOGGED:
            _LOGGED.add((root, field))
            warnings.warn(f"{field}.nvme_path is not set: swap files go to {self.run_dir} "
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

    def reserve(self, f: DiskFile) -> None:
        """Take the file's space now, so that a disk that fills up fails before the first step,
        not in the middle of one (after some masters were updated): ``posix_fallocate``, or,
        where the filesystem cannot allocate ahead (NFS, some FUSE; glibc's fallback then writes
        through the ``O_DIRECT`` descriptor and fails with EINVAL), zeros written through a
        buffered descriptor and synced. Never a sparse file; a failure names the file."""
        try:
            try:
                os.posix_fallocate(f.fd, 0, max(f.nbytes, 1))
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                _write_zeros(f.path, f.nbytes)
            os.ftruncate(f.fd, f.nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.path).free
                raise RuntimeError(
                    f"offload: no space for the swap file {f.path} ({f.nbytes} bytes; {free} bytes free in "
                    f"{self.path}); free space there, or {self._fix}"
                ) from e
            raise RuntimeError(
                f"offload: cannot reserve {f.nbytes} bytes for the swap file {f.path} ({type(e).__name__}: {e}); "
                f"point {self.field}.nvme_path at a local disk"
            ) from e

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
                f"{free / 2**30:.2f} GiB are free ({nbytes} bytes needed, {free} free); free space there, or "
                f"{self._fix}"
            )

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.remove)


def _write_zeros(path: str, nbytes: int) -> None:
    """Allocate ``nbytes`` of ``path`` by writing zeros (a buffered descriptor: no alignment
    needed), synced so that a filesystem that reports a full disk late (NFS) reports it here."""
    fd = os.open(path, os.O_WRONLY)
    try:
        zeros = memoryview(bytes(min(nbytes, 8 << 20)))
        pos = 0
        while pos < nbytes:
            n = os.pwrite(fd, zeros[: nbytes - pos], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"wrote {n} bytes at offset {pos}")
            pos += n
        os.fsync(fd)
    finally:
        os.close(fd)


def aligned_empty(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (rounded up to the block size) whose address is
    block-aligned, as ``O_DIRECT`` needs."""
    size = _round_up(max(nbytes, 1))
    if pinned:  # page-aligned already; one block more would double it in torch's power-of-two host allocator
        out = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if out.data_ptr() % ALIGN == 0:
            return out
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
    """One group's swap file of ``nbytes`` (rounded up to the block size), written and read
    whole through a buffer."""

    def __init__(self, path: str, nbytes: int, direct: bool) -> None:
        self.path = path
        self.nbytes = _round_up(nbytes) if nbytes else 0
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


_CHUNK = 64 << 20  # one preadv/pwritev call per 64 MiB (a file is one task: the pool runs several files at once)


_POOL_THREAD = "zero-swap"
_CLOCK_LOCK = threading.Lock()
_CLOCK = {"bytes_read": 0, "bytes_written": 0, "busy_s": 0.0, "waited_s": 0.0}


def io_clock() -> dict[str, float]:
    """This process's swap-file I/O so far: ``bytes_read``, ``bytes_written``, ``busy_s``
    (seconds in reads and writes, any thread) and ``waited_s`` (seconds the calling threads
    blocked on them; take differences around a step)."""
    with _CLOCK_LOCK:
        return dict(_CLOCK)


def _count(key: str, nbytes: int, seconds: float, waited: bool) -> None:
    with _CLOCK_LOCK:
        _CLOCK[key] += nbytes
        _CLOCK["busy_s"] += seconds
        if waited:
            _CLOCK["waited_s"] += seconds


def wait_io(fut: Future[None]) -> None:
    """``fut.result()``, counting the wait as the training thread's I/O wait."""
    t0 = time.perf_counter()
    try:
        fut.result()
    finally:
        with _CLOCK_LOCK:
            _CLOCK["waited_s"] += time.perf_counter() - t0


def io_at(fn: Callable[..., int], fd: int, buf: torch.Tensor, offset: int, what: str) -> None:
    view = buf.numpy().data  # a memoryview over the tensor's bytes
    pos = 0
    t0 = time.perf_counter()
    try:
        while pos < len(view):
            n = fn(fd, [view[pos : pos + _CHUNK]], offset + pos)
            if n <= 0:
                raise OSError(f"offload: {what} moved {n} bytes at offset {offset + pos}")
            pos += n
    finally:  # in the pool's threads the caller's wait is counted by wait_io
        waited = not threading.current_thread().name.startswith(_POOL_THREAD)
        _count("bytes_written" if fn is os.pwritev else "bytes_read", pos, time.perf_counter() - t0, waited)


class SwapPool:
    """Aligned host buffers (at most ``count``: the pipeline needs 2 or 3, whatever
    ``buffer_count`` says; each as large as the largest file) and a thread pool for the reads
    and writes. Buffers are made on first need, so the pool holds only what
    the pipeline uses (``allocated`` bytes, reported by ``memory_stats``)."""

    def __init__(self, count: int, buffer_bytes: int, pinned: bool, threads: int = 4) -> None:
        self.count = max(count, 2)
        self.buffer_bytes = _round_up(buffer_bytes)
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=_POOL_THREAD)

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
        return self._io.submit(io_at, os.preadv, f.fd, buf[: f.nbytes], 0, f"read of {f.path}")

    def write(self, f: DiskFile, buf: torch.Tensor) -> Future[None]:
        def run() -> None:
            io_at(os.pwritev, f.fd, buf[: f.nbytes], 0, f"write of {f.path}")
            f.written = True

        return self._io.submit(run)

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        self._free.clear()


def views(buf: torch.Tensor, regions: Sequence[Region]) -> Iterator[tuple[Region, torch.Tensor]]:
    """Typed views of each region inside a uint8 buffer."""
    for r in regions:
        yield r, buf[r.offset : r.offset + r.nbytes].view(r.dtype)
