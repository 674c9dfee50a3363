"""Swap bandwidth of the disk tier against ``dd`` with ``O_DIRECT`` on the same path.

The disk tier (``zero_strategy/storage/disk.py``) writes and reads each group's optimizer state whole,
through aligned host buffers and a thread pool calling ``os.pwritev``/``os.preadv`` (with
``O_DIRECT`` where the filesystem allows it). This script moves ``--gib`` GiB as ``--files``
group files of equal size, the way a step does (write all, then read all), and times

- ``dd if=/dev/zero of=F bs=64M count=N oflag=direct conv=notrunc,fsync`` (over a file written
  once before, as swap files are rewritten every step) and ``dd if=F of=/dev/null bs=64M iflag=direct``;
- our ``SwapPool.write``/``SwapPool.read`` over the same bytes, all files in flight at once
  (``fsync`` after the writes).

Each figure is the median of ``--repeats``. Reads after ``O_DIRECT`` writes do not come from
the page cache (the kernel drops cached pages of a file written with ``O_DIRECT``); ``dd``'s
read is direct too.

    PYTHONPATH=. .venv/bin/python bench/bench_swap.py --path /tmp --gib 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from zero_strategy.storage.disk import DiskFile, SwapPool, direct_io_works


def _dd(path: str, gib: float, repeats: int) -> tuple[float, float]:
    count = max(int(gib * 16), 1)  # 64 MiB blocks
    nbytes = count * (64 << 20)
    write = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct", "conv=notrunc,fsync"]
    subprocess.run(write, check=True, capture_output=True)  # the file exists, as a swap file does after its first step
    w, r = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(write, check=True, capture_output=True)
        w.append(nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True)
        r.append(nbytes / (time.perf_counter() - t0) / 1e9)
    os.unlink(path)
    return statistics.median(w), statistics.median(r)


def _ours(directory: str, gib: float, files: int, repeats: int, threads: int) -> tuple[float, float, bool]:

    direct = direct_io_works(directory)
    per_file = int(gib * (1 << 30)) // files // 4096 * 4096
    fs = []
    for k in range(files):
        f = DiskFile(os.path.join(directory, f"g{k}.swap"), per_file, direct)
        os.ftruncate(f.fd, f.nbytes)
        fs.append(f)
    pool = SwapPool(files, per_file, pinned=False, threads=threads)
    bufs = [pool.get() for _ in range(files)]
    for b in bufs:
        b.fill_(7)
    w, r = [], []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for fut in [pool.write(f, b) for f, b in zip(fs, bufs)]:
                fut.result()
            for f in fs:
                os.fsync(f.fd)
            w.append(files * per_file / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for fut in [pool.read(f, b) for f, b in zip(fs, bufs)]:
                fut.result()
            r.append(files * per_file / (time.perf_counter() - t0) / 1e9)
    finally:
        pool.shutdown()
        for f in fs:
            f.close()
            os.unlink(f.path)
    return statistics.median(w), statistics.median(r), direct


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="zero-swap-bench-", dir=args.path)
    try:
        dd_w, dd_r = _dd(os.path.join(work, "dd.bin"), args.gib, args.repeats)
        w, r, direct = _ours(work, args.gib, args.files, args.repeats, args.threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"path {args.path}, {args.gib} GiB as {args.files} files, {args.threads} I/O threads, O_DIRECT {direct}, "
          f"median of {args.repeats}\n")  # fmt: skip
    print("| | write GB/s | read GB/s |")
    print("|---|---:|---:|")
    print(f"| dd (oflag/iflag=direct, bs=64M) | {dd_w:.2f} | {dd_r:.2f} |")
    print(f"| zero_strategy SwapPool | {w:.2f} | {r:.2f} |")
    print(f"| ratio | {w / dd_w:.2f}x | {r / dd_r:.2f}x |")


if __name__ == "__main__":
    main()
