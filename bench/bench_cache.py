#!/usr/bin/env python
"""The ZeRO-3 cache tier (``zero_strategy.memory``, docs/memory_budget.md): cache budget ->
all-gathered bytes per step and step time, beside FSDP2 with ``reshard_after_forward`` True and
False, all in one run (2 CPU ranks, gloo, one thread each).

Every configuration trains the bundled GPT from the same seed for ``--steps`` measured steps
(after one warm-up step) of 2 micro-steps each (gradient accumulation: the second micro-step can
reuse what the first gathered), in the same two processes one after the other. Gathered bytes
are what the all-gathers of parameters brought in, per rank and step: zero-strategy's own count
(``memory_stats()['gathered_bytes']``: full unit bytes per gather) and, for FSDP2, the output
size of every ``all_gather_single``/``all_gather_into_tensor`` it issued, counted by wrapping them.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_cache.py [--steps 4] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

CACHES = ["0", "unit", "quarter", "half", "whole"]  # cache caps, by the model's unit sizes
FSDP = ["fsdp2 reshard_after_forward=True", "fsdp2 reshard_after_forward=False"]


def _worker(rank: int, world: int, layers: int, d_model: int, steps: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch
    from zero_strategy.runtime.module import get_engine

    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=d_model, n_layer=layers, n_head=4)
    out: list[dict] = []

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    def run(model, opt, count) -> tuple[float, float, list[float]]:
        losses, times, moved = [], [], []
        for step in range(steps + 1):
            start, before = time.perf_counter(), count()
            for micro in range(2):
                x, y = synthetic_batch(cfg, 4, 10 * step + micro, seed=rank)
                loss = F.cross_entropy(model(x).view(-1, cfg.vocab_size), y.reshape(-1)) / 2
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if step:  # the first step warms up (and records the unit order)
                times.append(time.perf_counter() - start)
                moved.append(count() - before)
        return statistics.mean(moved), statistics.median(times), losses

    # zero-strategy at stage 3, every unit freed without a cache (persistent tier 0: no persistent units)
    model = build()
    size = 4
    blocks = sorted(sum(p.numel() for p in b.parameters()) * size for b in model.blocks)
    total = sum(p.numel() for p in model.parameters()) * size
    root = total - sum(blocks)
    caps = {"0": 0, "unit": root + blocks[-1], "quarter": root + sum(blocks[: layers // 4]),
            "half": root + sum(blocks[: layers // 2]), "whole": total}  # fmt: skip
    for name in CACHES:
        model = build()
        memory = {"budget": 10**10, "persistent": 0.0, "cache": caps[name], "working": 0.1}
        zcfg = zs.ZeroConfig(stage=3, memory=memory)
        zmodel, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=zcfg)
        engine = get_engine(zmodel)
        moved, secs, losses = run(zmodel, opt, lambda e=engine: e.memory_stats()["gathered_bytes"])
        s = engine.memory_stats()
        out.append({"engine": f"zero3 cache {name}", "cap": caps[name], "moved": moved, "secs": secs,
                    "hits": s["cache_hits"], "evictions": s["cache_evictions"], "peak": s["cache_peak"],
                    "losses": losses})  # fmt: skip
        engine.close()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    counted = [0]
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_gather_single")}

    def counting(name):
        def call(output, *args, **kwargs):
            counted[0] += output.numel() * output.element_size()
            return originals[name](output, *args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        for name in FSDP:
            model = build()
            mesh = init_device_mesh("cpu", (world,))
            reshard = name.endswith("True")
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            moved, secs, losses = run(model, opt, lambda: counted[0])
            out.append({"engine": name, "cap": None, "moved": moved, "secs": secs, "losses": losses})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


def main() -> None:
    from zero_strategy.testing import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    rows = launch(_worker, 2, args=(args.layers, args.d_model, args.steps), timeout=3000)[0]
    ref = rows[0]["losses"]
    print(f"GPT d_model={args.d_model}, {args.layers} blocks; 2 ranks; {args.steps} steps of 2 micro-steps\n")
    print(
        "| engine | cache cap MiB | gathered MiB/step | s/step | hits | evictions | cache peak MiB | max |loss - zero3 cache 0| |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = "" if r["cap"] is None else f"{r['cap'] / 2**20:.2f}"
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref))
        extra = f"{r['hits']} | {r['evictions']} | {r['peak'] / 2**20:.2f}" if "hits" in r else " |  | "
        print(f"| {r['engine']} | {cap} | {r['moved'] / 2**20:.2f} | {r['secs']:.3f} | {extra} | {diff:.1e} |")


if __name__ == "__main__":
    main()
