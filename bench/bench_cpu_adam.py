"""The host optimizer step of CPU offload, against DeepSpeed's compiled ``DeepSpeedCPUAdam``.

With ``offload_optimizer: {device: cpu}`` the AdamW step runs on the host, on the user's torch
optimizer; when the user leaves ``fused`` and ``foreach`` unset, zero_strategy sets
``fused=True`` (torch's fused CPU kernel). This script times one AdamW step over a flat fp32
shard of N parameters (the shape the engine hands the optimizer: a few large 1-D pieces) for

- ``torch_loop``: torch's default on CPU tensors (the per-tensor loop, ``foreach=False``);
- ``torch_foreach``: ``foreach=True``;
- ``torch_fused``: ``fused=True``, what zero_strategy uses;
- ``ds_cpu_adam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``DS_ACCELERATOR=cpu``; it compiles
  its C++ op on first use, which is timed apart as ``build_s``).

An Adam step reads parameter, gradient and both moments and writes parameter and moments: 28
bytes per fp32 parameter, so memory bandwidth bounds it. Each row prints parameters/s and
that traffic in GB/s beside the machine's STREAM-style bandwidth (copy and add over 256 MiB
arrays), measured in the same run. The shard is far larger than the caches (20M
parameters are 320 MB of state), so nothing is cache-resident; each step's time is the median
of ``--steps`` after ``--warmup``.

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python bench/bench_cpu_adam.py --sizes 20e6,50e6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

BYTES_PER_PARAM = 28  # read p, g, m, v (16) + write p, m, v (12), fp32


def stream_bandwidth(nbytes: int = 256 << 20, repeats: int = 20) -> tuple[float, float]:
    """STREAM-style GB/s, counted as STREAM counts them (bytes read + written by the kernel):
    copy ``c = a`` (2 arrays) and add ``c = a + b`` (3 arrays), the best of ``repeats`` (as STREAM reports). A
    copy's destination is also read by the CPU before it is written (write-allocate), which
    the count leaves out; an Adam step writes only what it read, so "add" is the fairer bound."""
    a, b = torch.randn(nbytes // 4), torch.randn(nbytes // 4)
    c = torch.empty_like(a)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    copy = 2 * nbytes / best(lambda: c.copy_(a)) / 1e9
    add = 3 * nbytes / best(lambda: torch.add(a, b, out=c)) / 1e9
    return copy, add


def _pieces(n: int, k: int = 8) -> list[torch.nn.Parameter]:
    """``n`` parameters as ``k`` 1-D pieces, with gradients (the engine's master pieces)."""
    sizes = [n // k] * (k - 1) + [n - (n // k) * (k - 1)]
    g = torch.Generator().manual_seed(0)
    out = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, generator=g))
        p.grad = torch.randn(s, generator=g) * 1e-3
        out.append(p)
    return out


def make(kind: str, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, float]:
    kw = {"lr": 1e-3, "weight_decay": 0.01}
    if kind == "torch_loop":
        return torch.optim.AdamW(params, foreach=False, **kw), 0.0
    if kind == "torch_foreach":
        return torch.optim.AdamW(params, foreach=True, **kw), 0.0
    if kind == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **kw), 0.0
    if kind == "ds_cpu_adam":
        t0 = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
        return opt, time.perf_counter() - t0
    raise ValueError(kind)


def time_steps(opt: torch.optim.Optimizer, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def agree(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| / max |b| over the pieces (the kernels must compute the same update)."""
    num = max(float((x - y).abs().max()) for x, y in zip(a, b))
    den = max(float(y.abs().max()) for y in b)
    return num / den


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20e6,50e6", help="comma list of parameter counts")
    ap.add_argument("--kinds", default="torch_loop,torch_foreach,torch_fused,ds_cpu_adam")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument(
        "--repeats", type=int, default=2, help="the kernel list is run this many times; the best median counts"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    copy_bw, bw = stream_bandwidth()
    rows = []
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; STREAM copy {copy_bw:.1f} GB/s, "
          f"add {bw:.1f} GB/s\n")  # fmt: skip
    print("| parameters | kernel | step s | G param/s | GB/s (28 B/param) | of STREAM add | vs ds_cpu_adam "
          "| max rel diff vs loop |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        results: dict[str, dict] = {}
        ref_after: list[torch.Tensor] | None = None
        for _ in range(args.repeats):
            for kind in kinds:
                params = _pieces(n)
                try:
                    opt, build_s = make(kind, params)
                except Exception as e:  # a missing DeepSpeed/compiler is reported, not fatal
                    print(f"| {n / 1e6:.0f}M | {kind} | failed: {type(e).__name__}: {e} | | | | | |", file=sys.stderr)
                    continue
                one = time_steps(opt, 0, 1)  # first step from the same start, for the agreement column
                after = [p.detach().clone() for p in params]
                if kind == "torch_loop" and ref_after is None:
                    ref_after = after
                diff = agree(after, ref_after) if ref_after is not None else float("nan")
                t = time_steps(opt, args.warmup, args.steps)
                best = results.get(kind, {}).get("step_s", float("inf"))
                if t < best:
                    results[kind] = {"step_s": t, "build_s": max(build_s, results.get(kind, {}).get("build_s", 0.0)),
                                     "first_step_s": one, "rel_diff": diff}  # fmt: skip
                del opt, params
        base = results.get("ds_cpu_adam", {}).get("step_s")
        for kind, r in results.items():
            pps = n / r["step_s"]
            gbs = BYTES_PER_PARAM * pps / 1e9
            ratio = f"{base / r['step_s']:.2f}x" if base else "-"
            print(f"| {n / 1e6:.0f}M | {kind} | {r['step_s']:.4f} | {pps / 1e9:.3f} | {gbs:.1f} | {gbs / bw:.0%} | "
                  f"{ratio} | {r['rel_diff']:.1e} |")  # fmt: skip
            rows.append(
                {"params": n, "kind": kind, **r, "param_per_s": pps, "gb_per_s": gbs, "stream_add_gb_per_s": bw}
            )
        if "ds_cpu_adam" in results:
            print(f"|  | (ds_cpu_adam build {results['ds_cpu_adam']['build_s']:.0f} s) | | | | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
