#!/usr/bin/env python
"""Cost of the default ZeRO-3 policy's block agreement (``zero3.py``): before each block of a
list the default policy chose, every rank says which block it enters (one all-gather of one
integer, plus one at the end of the forward).

Measures, on 2 CPU ranks (gloo, ``OMP_NUM_THREADS=1``), in one run:

- the agreement call alone (median of 200 calls);
- ZeRO-3 step time of the bundled GPT under the default policy (agreements on) against the
  same model with ``policy={Block}`` (the same units, declared, so no agreement), interleaved.

    python bench/bench_agreement.py [--config bench|small] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def _worker(rank: int, world: int, config: str, steps: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, Block, GPTConfig, synthetic_batch

    cfg = (
        GPTConfig.bench()
        if config == "bench"
        else GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layer=8, n_head=4)
    )
    models = {}
    for name, policy in (("default", None), ("declared", {Block})):
        torch.manual_seed(0)
        m = GPT(cfg)
        m, opt = zs.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-4), stage=3, policy=policy)
        models[name] = (m, opt)
    hooks = models["default"][0].zero_engine.zero3
    if not hooks.list_of or models["declared"][0].zero_engine.zero3.list_of:
        raise AssertionError("the default policy should check its block list and the declared one should not")
    calls = []
    for _ in range(200):
        t0 = time.perf_counter()
        hooks._agree(1)
        calls.append(time.perf_counter() - t0)
    times: dict[str, list[float]] = {"default": [], "declared": []}
    for _ in range(repeats):
        for name in ("default", "declared"):
            m, opt = models[name]
            per_step = []
            for step in range(steps + 2):
                x, y = synthetic_batch(cfg, 2, step, seed=rank)
                t0 = time.perf_counter()
                F.cross_entropy(m(x).view(-1, cfg.vocab_size), y.reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
                if step >= 2:
                    per_step.append(time.perf_counter() - t0)
            times[name].append(statistics.median(per_step))
    return {"agree_ms": 1e3 * statistics.median(calls), "blocks": cfg.n_layer, "times": times,
            "pinned": sorted(hooks.pinned)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["bench", "small"], default="bench")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zero_strategy.testing import launch

    r = launch(_worker, 2, args=(args.config, args.steps, args.repeats), timeout=3600)[0]
    d, n = statistics.median(r["times"]["default"]), statistics.median(r["times"]["declared"])
    per_step_ms = r["agree_ms"] * (r["blocks"] + 1)
    print(f"config={args.config} blocks={r['blocks']} pinned={r['pinned']}")
    print(
        f"agreement call: {r['agree_ms']:.3f} ms (median of 200); per step: {r['blocks'] + 1} calls = {per_step_ms:.2f} ms"
    )
    print(f"step time: default policy {d:.4f} s, declared policy {n:.4f} s, ratio {d / n:.3f}")
    print(
        f"  per repeat: default {[round(t, 4) for t in r['times']['default']]}, declared {[round(t, 4) for t in r['times']['declared']]}"
    )


if __name__ == "__main__":
    main()
