"""Top-k compression with error feedback against dense reduction: loss and gradient bytes.

The bundled GPT task of ``examples/train_gpt.py`` (next-byte prediction on the standard
library's source, d_model 192, 4 layers, AdamW with a cosine schedule, clipping 1.0, batch 8
per rank, 300 steps), on 2 ranks at ZeRO-2, once per configuration with the same seed and data:
dense reduction, then top-k at each ``--ratios`` with a ``--warmup`` of dense steps first
(``--warmup-mode dense``) or DGC's exponential ramp of the ratio (``exponential``).
``--optim sgd-dgc``: SGD with momentum 0.9, which the compressed runs give to the engine
(``compression.momentum``, DGC's momentum correction, with factor masking unless
``--no-masking``); the dense run is torch's SGD with momentum 0.9 under plain ZeRO-2 (DDP's
numbers). ``--optim adamw-frozen``: the dense run is torch's AdamW; the compressed runs use the
frozen-variance Adam mode (``compression.optimizer: adam``, ``--warmup`` dense AdamW steps, then
the variance frozen and the normalised momentum sent with top-k; the user's optimizer is SGD
with AdamW's learning rate and weight decay; masking unless ``--no-masking``;
``--variance-refresh N``: 0/1 Adam's variance refresh, ``compression.variance_refresh``).
``--region-indices``: the compressed runs send int16 offsets inside regions of 32,768 columns
(``compression.region_indices``); ``--global-threshold``: one top-k threshold over the whole
bucket instead of one per row (``compression.global_threshold``); ``--owner-momentum``: the
Adam mode with the momentum kept by each shard's owner (``compression.owner_momentum``); ``--wire bf16``: every run reduces in bf16
(``communication_data_type``).
``--local-clip``: the compressed runs clip with DGC's local clipping at ``--clip`` instead of
``clip_grad_norm_`` (which still clips the dense steps of a ``warmup: dense`` warm-up).

Printed per run: the loss curve (mean training loss over windows of 25 steps), the final
held-out loss (16 fixed batches no run trains on) and its difference from dense, and the
gradient bytes per step (reduce-scatters plus top-k exchanges, ``comm_stats``), averaged over
all steps, warm-up included, as a share of dense.

    PYTHONPATH=. python bench/bench_compression.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

WINDOW = 25


def _worker(rank: int, world: int, ratio: float, warmup: int, steps: int, clip: float, optim: str, mode: str,
            masking: bool, local_clip: bool = False, regions: bool = False, wire: str = "fp32",
            refresh: int = 0, floor: float = 0.0, global_threshold: bool = False,
            owner_momentum: bool = False) -> dict:  # fmt: skip
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.config.comm import CompressionConfig
    from zero_strategy.models import GPT, GPTConfig
    from zero_strategy.models.data import stdlib_corpus, text_batch

    torch.set_num_threads(1)
    corpus = stdlib_corpus()
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=192, n_layer=4, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    frozen = optim == "adamw-frozen" and ratio < 1.0  # the engine runs Adam; the optimizer applies lr
    if frozen:
        opt = torch.optim.SGD(model.parameters(), lr=3e-3, weight_decay=0.1)
    elif optim in ("adamw", "adamw-frozen"):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:  # sgd-dgc: the engine owns the momentum of the compressed runs (DGC's momentum correction)
        own = optim == "sgd-dgc" and ratio < 1.0
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if own else 0.9)
    config: dict = {"zero_optimization": {"stage": 2}}
    block: dict = {"warmup": mode}
    if ratio < 1.0:
        block = {"type": "topk", "ratio": ratio, "warmup_steps": warmup, "warmup": mode}
        if optim == "sgd-dgc":
            block.update(momentum=0.9, momentum_masking=masking)
        if frozen:
            block.update(optimizer="adam", warmup="dense", momentum_masking=masking, variance_refresh=refresh,
                         precondition_floor=floor)  # fmt: skip
        if regions:
            block.update(region_indices=True)
        if global_threshold:
            block.update(global_threshold=True)
        if owner_momentum and frozen:
            block.update(owner_momentum=True)
        if local_clip and clip > 0:
            block.update(local_clip=clip)
        config["zero_strategy"] = {"compression": block}
    if wire != "fp32":
        config["communication_data_type"] = wire
    dense_at = CompressionConfig(**block).dense_at if ratio < 1.0 else (lambda step: True)
    model, opt = zs.initialize(model, opt, config=config)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    zs.reset_comm_stats()
    losses = []
    for step in range(steps):
        x, y = text_batch(corpus, 8, cfg.seq_len, step, rank)
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        loss.backward()
        dense_step = dense_at(step)  # the dense warm-up's and the variance refresh's steps too
        if clip > 0 and (dense_step or not local_clip):
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    stats = zs.comm_stats()
    grad_bytes = sum(stats.get(k, {}).get("bytes", 0) for k in ("reduce_scatter", "all_to_all"))
    with torch.no_grad():  # held out: seed 1 draws windows no training step used
        held = [text_batch(corpus, 8, cfg.seq_len, k, rank, seed=1) for k in range(16)]
        evals = [float(F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))) for x, y in held]
    model.zero_engine.close()
    return {"losses": losses, "grad_bytes_per_step": grad_bytes / steps, "eval": sum(evals) / len(evals),
            "residual_bytes": 4 * sum(p.numel() for p in model.parameters())}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from zero_strategy.testing.launcher import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ratios", default="0.001,0.01")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps at the start (at most 10%% of --steps)")
    ap.add_argument("--warmup-mode", default="dense", choices=("dense", "exponential"),
                    help="dense steps first, or DGC's exponential ramp of the ratio")  # fmt: skip
    ap.add_argument("--no-masking", action="store_true", help="sgd-dgc without momentum factor masking")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    ap.add_argument("--optim", default="adamw", choices=("adamw", "sgd", "sgd-dgc", "adamw-frozen"))
    ap.add_argument("--local-clip", action="store_true", help="compressed runs: DGC's local clipping at --clip")
    ap.add_argument("--region-indices", action="store_true", help="compressed runs: int16 region offsets")
    ap.add_argument("--wire", default="fp32", choices=("fp32", "bf16"), help="communication_data_type")
    ap.add_argument("--max-warmup", type=float, default=0.1, help="the largest --warmup, as a share of --steps")
    ap.add_argument("--variance-refresh", type=int, default=0, help="adamw-frozen: compression.variance_refresh")
    ap.add_argument(
        "--precondition-floor", type=float, default=0.0, help="adamw-frozen: compression.precondition_floor"
    )
    ap.add_argument("--global-threshold", action="store_true", help="compressed runs: compression.global_threshold")
    ap.add_argument("--owner-momentum", action="store_true", help="adamw-frozen: compression.owner_momentum")
    ap.add_argument("--no-dense", action="store_true", help="skip the ratio 1.0 run (the tables then lack 'vs dense')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.warmup > args.max_warmup * args.steps:
        raise SystemExit(f"--warmup {args.warmup} is more than {args.max_warmup:.0%} of --steps {args.steps}")
    runs = {}
    for ratio in ([] if args.no_dense else [1.0]) + [float(r) for r in args.ratios.split(",")]:
        res = launch(
            _worker,
            2,
            args=(
                ratio,
                args.warmup,
                args.steps,
                args.clip,
                args.optim,
                args.warmup_mode,
                not args.no_masking,
                args.local_clip,
                args.region_indices,
                args.wire,
                args.variance_refresh,
                args.precondition_floor,
                args.global_threshold,
                args.owner_momentum,
            ),
            timeout=3600,
            env={"OMP_NUM_THREADS": "1"},
        )
        # the held-out loss of both ranks' batches, and rank 0's bytes (each rank moves as much)
        runs["dense" if ratio == 1.0 else f"topk {ratio}"] = {
            "eval": sum(r["eval"] for r in res) / len(res),
            "curve": [
                sum(sum(r["losses"][i : i + WINDOW]) for r in res) / (WINDOW * len(res))
                for i in range(0, args.steps, WINDOW)
            ],
            "bytes": res[0]["grad_bytes_per_step"],
            "losses": [sum(r["losses"][i] for r in res) / len(res) for i in range(args.steps)],
        }
        last = list(runs.values())[-1]
        print(f"{list(runs)[-1]}: held-out {last['eval']:.4f}, {last['bytes'] / 2**20:.3f} MB per step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    if "dense" not in runs:  # --no-dense: the per-run lines above are the result
        return
    dense = runs["dense"]
    print(
        f"\nGPT task of examples/train_gpt.py, 2 ranks, ZeRO-2, {args.steps} steps, {args.optim}, "
        f"warm-up {args.warmup} steps ({args.warmup_mode})"
    )
    print("\n| run | held-out loss | vs dense | gradient MB per step | bytes vs dense |")
    print("|---|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['eval']:.4f} | {100 * (r['eval'] / dense['eval'] - 1):+.2f}% | "
              f"{r['bytes'] / 2**20:.3f} | {100 * r['bytes'] / dense['bytes']:.2f}% |")  # fmt: skip
    print(f"\nTraining loss, mean over windows of {WINDOW} steps:\n")
    print("| steps | " + " | ".join(runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for i, start in enumerate(range(0, args.steps, WINDOW)):
        print(
            f"| {start}-{min(start + WINDOW, args.steps) - 1} | "
            + " | ".join(f"{r['curve'][i]:.4f}" for r in runs.values())
            + " |"
        )


if __name__ == "__main__":
    main()
