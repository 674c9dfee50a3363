#!/usr/bin/env python
"""Soak: many steps of the small GPT at ZeRO-3 on 2 CPU ranks (gloo), with a checkpoint every
``--save-every`` steps, reporting the resident-set slope after warm-up. A leak of a few KiB per
step shows as a slope; a healthy run's is about zero.

    python bench/bench_soak.py [--steps 1000] [--stage 3] [--save-every 250]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, steps: int, stage: int, save_every: int, root: str) -> dict:
    """``stage`` 0: plain DDP, the same loop (no checkpoints): the reference slope."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=128, n_layer=4, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    if stage == 0:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        net = DDP(model)
        opt.clip_grad_norm_ = lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        save_every = 0
    else:
        net, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
    rss, losses = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = synthetic_batch(cfg, 4, step, seed=rank)
        loss = F.cross_entropy(net(x).view(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_every and (step + 1) % save_every == 0:
            zs.save_checkpoint(root, model, opt, keep_last=1)
        rss.append(_rss_mib())
    wall = time.perf_counter() - t0
    warm = steps // 10
    xs = list(range(warm, steps))
    slope = statistics.linear_regression(xs, rss[warm:]).slope if len(xs) > 2 else float("nan")
    return {"rss_first": rss[warm], "rss_last": rss[-1], "slope_kib_per_step": slope * 1024, "wall_s": wall,
            "loss_first": losses[0], "loss_last": losses[-1],
            "live_state_mib": zs.memory_stats(model)["model_state"] / 2**20 if stage else float("nan")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--stage", type=int, default=3, help="1-3; 0: plain DDP, the reference")
    ap.add_argument("--save-every", type=int, default=250)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zero_strategy.testing import launch

    with tempfile.TemporaryDirectory() as root:
        results = launch(_worker, 2, args=(args.steps, args.stage, args.save_every, root), timeout=7200)
    what = "DDP" if args.stage == 0 else f"ZeRO-{args.stage}, checkpoint every {args.save_every} steps"
    print(f"soak: {args.steps} steps, {what}, 2 ranks")
    for rank, r in enumerate(results):
        print(f"rank {rank}: RSS {r['rss_first']:.1f} -> {r['rss_last']:.1f} MiB after warm-up, slope {r['slope_kib_per_step']:+.3f} KiB/step; "
              f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}; {r['wall_s']:.1f} s; model state {r['live_state_mib']:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
