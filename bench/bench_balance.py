"""Load balancing: step time with shards by measured rank speed against even shards.

Two ranks of unequal speed. ``--slow busy`` (the default): each rank is pinned to its own core
and rank 1's core is shared with a busy-looping process, so rank 1 runs at about half speed.
``--slow threads``: rank 0 computes with ``--fast-threads`` threads, rank 1 with one (on a
2-core machine the three threads oversubscribe the cores, so rank 0 is not faster there).
The model is a wide MLP trained with AdamW on a small batch, so the optimizer step (which
load balancing makes uneven) is a large part of the step. Each configuration trains
``--warmup`` unmeasured and ``--steps`` measured steps at ZeRO-2; printed per run: the fractions
(measured at start with ``preset: compute``), the mean step time (the slower rank's), and the
optimizer step's own time per rank (``opt.step()``, which ends with the parameter gather, so it
includes waiting for the other rank).

    PYTHONPATH=. python bench/bench_balance.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def _worker(rank: int, world: int, balance: str | None, warmup: int, steps: int, fast: int, width: int,
            slow: str) -> dict:  # fmt: skip
    import os
    import subprocess
    import time

    import torch

    import zero_strategy as zs

    busy = None
    if slow == "busy":
        torch.set_num_threads(1)
        cores = sorted(os.sched_getaffinity(0))
        core = cores[rank % len(cores)]
        os.sched_setaffinity(0, {core})
        if rank == 1:  # a neighbour that wants the whole core
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(busy.pid, {core})
    else:
        torch.set_num_threads(fast if rank == 0 else 1)
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers)
    config: dict = {"zero_optimization": {"stage": 2}}
    if balance:
        config["zero_strategy"] = {"load_balance": balance}
    model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-4), config=config)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    step_times, opt_times = [], []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if k >= warmup:
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
    fractions = model.zero_engine.groups[0].layout.fractions
    stats = model.zero_engine.memory_stats()
    model.zero_engine.close()
    if busy is not None:
        busy.kill()
        busy.wait()
    return {
        "step": sum(step_times) / steps,
        "opt": sum(opt_times) / steps,
        "fractions": fractions,
        "optimizer_state_mb": stats["optimizer_state"] / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    from zero_strategy.testing.launcher import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slow", default="busy", choices=("busy", "threads"), help="how rank 1 is made slower")
    ap.add_argument("--fast-threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=2, help="alternate even and balanced runs this many times")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows: dict[str, list] = {"even": [], "compute": [], "bandwidth": []}
    for _ in range(args.repeats):
        for name in rows:
            balance = None if name == "even" else name
            res = launch(_worker, 2, args=(balance, args.warmup, args.steps, args.fast_threads, args.width, args.slow),
                         timeout=1800, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
            rows[name].append(res)
    how = ("one core each, rank 1's shared with a busy loop" if args.slow == "busy"
           else f"rank 0: {args.fast_threads} threads, rank 1: 1")  # fmt: skip
    print(f"\n2 ranks ({how}), 6x{args.width}^2 MLP, AdamW, ZeRO-2, "
          f"{args.steps} measured steps, best of {args.repeats}\n")  # fmt: skip
    print("| shards | fractions | step s | vs even | opt.step s rank 0 / 1 | optimizer state MB rank 0 / 1 |")
    print("|---|---|---:|---:|---:|---:|")
    best = {name: min(runs, key=lambda res: max(r["step"] for r in res)) for name, runs in rows.items()}
    even_step = max(r["step"] for r in best["even"])
    for name, res in best.items():
        step = max(r["step"] for r in res)
        fr = res[0]["fractions"]
        shown = "even" if fr is None else " / ".join(f"{f:.2f}" for f in fr)
        print(f"| {name} | {shown} | {step:.3f} | {step / even_step:.2f}x | {res[0]['opt']:.3f} / {res[1]['opt']:.3f} | "
              f"{res[0]['optimizer_state_mb']:.0f} / {res[1]['optimizer_state_mb']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
