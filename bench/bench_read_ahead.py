"""ZeRO-3 with the parameter rows on NVMe: step time with the rows read ahead in the background
(the default) against read when each gather is issued (``ZERO_STRATEGY_DISK_READ_AHEAD=0``).

One process (the overlap is a property of each rank: its reader thread against its compute),
the bench GPT, ``offload_param: nvme`` and ``offload_optimizer: cpu``, persistence threshold 0,
so every block's rows are read from its swap file at each gather (``O_DIRECT`` where the
filesystem allows, so the reads come from the disk, not the page cache). The two settings are
interleaved, ``--repeats`` times each; the figure is the median s/step over the measured steps.
It also prints the time the training thread spent reading rows (the reads left on the critical
path) and the numbers of reads ahead and inline.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/bench_read_ahead.py --path /tmp/ra --layers 8 --d-model 512

DeepSpeed's ZeRO-Infinity needs its ``async_io`` op (libaio); on a machine where
``AsyncIOBuilder().is_compatible()`` is False it does not run, and is left out.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig
from zero_strategy.runtime.module import get_engine


def _run(args: argparse.Namespace, read_ahead: bool) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=8)
    swap = tempfile.mkdtemp(dir=args.path)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": swap},
                                    "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    model, opt = zs.initialize(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-4), config=config)
    rows = get_engine(model).disk.row_swap
    if rows is None:
        raise SystemExit("no parameter rows on disk: check offload_param")
    rows.read_ahead = read_ahead
    inline = 0.0
    from zero_strategy.storage import disk_rows  # time the inline reads: DiskRows._read on the training thread

    original = disk_rows.DiskRows._read

    def timed(self, slab, *, skip):  # type: ignore[no-untyped-def]
        nonlocal inline
        t0 = time.perf_counter()
        original(self, slab, skip=skip)
        inline += time.perf_counter() - t0

    disk_rows.DiskRows._read = timed  # type: ignore[method-assign]
    times = []
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            if step == args.warmup:
                inline = 0.0
                rows.reads.update(ahead=0, inline=0)
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        reads = dict(rows.reads)
    finally:
        disk_rows.DiskRows._read = original  # type: ignore[method-assign]
        get_engine(model).close()
        shutil.rmtree(swap, ignore_errors=True)
    return {"s_step": statistics.median(times), "inline_read_s": inline / args.steps,
            "ahead": reads["ahead"] / args.steps, "inline": reads["inline"] / args.steps}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=tempfile.gettempdir(), help="directory for the swap files (a real disk)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for ahead in (False, True):
            results[ahead].append(_run(args, ahead))
    print("| rows read | s/step | ratio | training thread reading rows, s/step | reads ahead / inline per step |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(r["s_step"] for r in results[False])
    for ahead in (False, True):
        rs = results[ahead]
        s = statistics.median(r["s_step"] for r in rs)
        io = statistics.median(r["inline_read_s"] for r in rs)
        name = "ahead, in the background" if ahead else "at each gather (READ_AHEAD=0)"
        print(f"| {name} | {s:.3f} | {s / base:.2f}x | {io:.3f} | {rs[0]['ahead']:.0f} / {rs[0]['inline']:.0f} |")


if __name__ == "__main__":
    main()
