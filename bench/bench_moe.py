#!/usr/bin/env python
"""MoE at ZeRO-3 (docs/moe.md): gathering only the selected experts against gathering all of them.

Part 1, the cost switch (``moe_full_gather_share``): one experts layer of a small Mixtral
(hidden 128, intermediate 128: 196 KiB per expert, 12 MiB for 64), its
selective gather of random unions of growing size timed against one whole gather, so the share
of a whole gather's bytes where selective stops paying is measured, not guessed.

Part 2, training steps: a one-layer tiny Mixtral (hidden 16, intermediate 4: tiny experts, so
1,024 fit), top-2, 2 CPU ranks (gloo, one thread each), for 8, 64 and 1,024 experts and 16, 256
and 4,096 tokens per step (over both ranks), with the default switch (0.2), with selective gathers
whenever they move fewer bytes (share 1.0, "selected") and with ``moe_full_gather_share`` so small
that every gather is whole ("all experts"). Per step: expert
bytes gathered (forward and backward) and reduced, step time, and the union share measured next
to the formula ``1 - (1 - k/E)^T`` for uniform routing.

Part 3, decoding: greedy ``generate`` of 32 tokens on both ranks with 64 experts: tokens/s and
expert bytes gathered per token, for the same settings.

Parts 1 to 3 also run the expert owners' layout (``moe_expert_layout: owners``: each expert
whole on one rank, each rank fetching only its own selection from the owners and sending the
gradient back to them), with selective fetches whenever they move fewer bytes ("owners") and
with the default switch.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_moe.py [--steps 3] [--quick]
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

K = 2


def _model(experts: int, hidden: int = 16, inter: int = 4):
    import torch
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=experts, num_experts_per_tok=K, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _engine(experts: int, share: float, hidden: int = 16, inter: int = 4, layout: str = "sharded"):
    import torch

    import zero_strategy as zs

    model = _model(experts, hidden, inter)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = zs.ZeroConfig(
        stage=3, stage3_param_persistence_threshold=0, moe_full_gather_share=share, moe_expert_layout=layout
    )
    return zs.initialize(model, opt, config=cfg)


def _switch(rank: int, experts: int, reps: int) -> list[dict]:
    """Selective gathers of random unions against whole gathers of one experts layer."""
    import torch

    model, _ = _engine(experts, 1.0, hidden=128, inter=128)  # 196 KiB per expert: bytes, not overheads
    x = next(iter(model.zero_engine.zero3.experts.values()))
    g = torch.Generator().manual_seed(0)
    whole = _timed(x, None, reps)
    rows = []
    for size in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64):
        if size > experts:
            break
        union = tuple(sorted(torch.randperm(experts, generator=g)[:size].tolist()))
        _, _, width = x._whole(union)
        share = width / x.unit.layout.shard_numel
        rows.append({"experts": size, "width_share": share, "ratio": _timed(x, union, reps) / whole})
    return rows


def _owner_switch(rank: int, world: int, experts: int, reps: int) -> list[dict]:
    """Owners' fetches (each rank its own random experts) against whole gathers of one layer."""
    import torch

    from zero_strategy.sharding.experts.owners import OwnerPick

    model, _ = _engine(experts, 1.0, hidden=128, inter=128, layout="owners")
    x = next(iter(model.zero_engine.zero3.experts.values()))
    whole = _timed(x, None, reps)
    rows = []
    for size in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64):
        if size > experts:
            break
        gens = [torch.Generator().manual_seed(10 * size + r) for r in range(world)]  # every rank knows every pick
        picks = tuple(tuple(sorted(torch.randperm(experts, generator=g)[:size].tolist())) for g in gens)
        pick = OwnerPick(tuple(sorted(set().union(*picks))), picks)
        fetch = x._fetch(pick)
        moved = fetch.moved if fetch is not None else world * x.unit.layout.shard_numel  # whole
        rows.append({"experts": size, "union": len(pick.union), "width_share": moved / (world * x.unit.layout.shard_numel),
                     "ratio": _timed(x, pick, reps) / whole})  # fmt: skip
    return rows


def _timed(x, union, reps: int) -> float:
    """The best of ``reps`` gathers of ``union`` (None: whole), each freed again."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.gather(union, "bench")
        x.release(force=True)
        best = min(best, time.perf_counter() - t0)
    return best


def _steps(rank: int, world: int, experts: int, tokens: int, share: float, steps: int, layout: str) -> dict:
    import torch

    model, opt = _engine(experts, share, layout=layout)
    engine = model.zero_engine
    times, before = [], None
    for step in range(steps + 1):
        ids = torch.randint(0, 64, (1, tokens // world), generator=torch.Generator().manual_seed(100 * step + rank))
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:  # warm-up
            before = engine.memory_stats()
        else:
            times.append(time.perf_counter() - t0)
    after = engine.memory_stats()
    assert before is not None
    d = {k: (after[k] - before[k]) / steps for k in after if k.startswith("moe_")}
    return {
        "gathered": d["moe_gathered_bytes"],
        "reduced": d["moe_reduced_bytes"],
        "union": d["moe_union_experts"] / max(d["moe_experts_seen"], 1),
        "peak_scratch": after["comm_scratch_peak"],
        "peak_gather": after["moe_peak_gather_bytes"],  # the largest one gather, warm-up included
        "step_s": statistics.median(times),
    }


def _decode(rank: int, experts: int, share: float, new_tokens: int, layout: str) -> dict:
    """``generate`` on every rank (greedy, one prompt each): tokens/s and expert bytes per token."""
    import torch

    model, _ = _engine(experts, share, layout=layout)
    model.eval()
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        before = model.zero_engine.memory_stats()
        t0 = time.perf_counter()
        model.generate(prompt, **kw)
        seconds = time.perf_counter() - t0
    after = model.zero_engine.memory_stats()
    return {
        "tokens_per_s": new_tokens / seconds,
        "bytes_per_token": (after["moe_gathered_bytes"] - before["moe_gathered_bytes"]) / new_tokens,
        "union": (after["moe_union_experts"] - before["moe_union_experts"])
        / max(after["moe_experts_seen"] - before["moe_experts_seen"], 1),
    }


def _worker(rank: int, world: int, steps: int, quick: bool, decode_only: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    reps = 3 if quick else 10
    out: dict = {
        "switch": [] if decode_only else _switch(rank, 64, reps),
        "owner_switch": [] if decode_only else _owner_switch(rank, world, 64, reps),
        "steps": [],
        "decode": [],
    }
    for name, share, layout in MODES:
        out["decode"].append({"mode": name, **_decode(rank, 64, share, 8 if quick else 32, layout)})
    grid = [(8, 16), (64, 256)] if quick else [(e, t) for e in (8, 64, 1024) for t in (16, 256, 4096)]
    grid = [] if decode_only else grid
    for experts, tokens in grid:
        for name, share, layout in MODES:
            r = _steps(rank, world, experts, tokens, share, steps, layout)
            out["steps"].append({"E": experts, "T": tokens, "mode": name, **r})
    return out


# (name, moe_full_gather_share, moe_expert_layout)
MODES = (
    ("switch 0.2", 0.2, "sharded"),
    ("selected", 1.0, "sharded"),
    ("owners", 1.0, "owners"),
    ("owners, switch 0.2", 0.2, "owners"),
    ("all experts", 1e-9, "sharded"),
)


def _table(title: str, header: list[str], rows: list[list]) -> None:
    """One markdown table under its heading (the part 1, 2 and 3 tables of bench/RESULTS.md)."""
    print(f"## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    print()


def main(argv: list[str] | None = None) -> int:
    from zero_strategy.testing import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small grid (the test's)")
    ap.add_argument("--decode-only", action="store_true", help="part 3 only")
    args = ap.parse_args(argv)
    res = launch(_worker, 2, args=(args.steps, args.quick, args.decode_only), timeout=1800)[0]
    _table(
        "Cost switch: one selective gather / one whole gather (E=64, 196 KiB experts, 2 ranks, best of reps)",
        ["union experts", "selective bytes / whole bytes", "time / whole gather's"],
        [[r["experts"], f"{r['width_share']:.2f}", f"{r['ratio']:.2f}"] for r in res["switch"]],
    )
    _table(
        "Owners: one fetch of each rank's own experts / one whole gather (same layer, rank 0's numbers)",
        ["experts per rank", "union", "fetched bytes / whole bytes", "time / whole gather's"],
        [[r["experts"], r["union"], f"{r['width_share']:.2f}", f"{r['ratio']:.2f}"] for r in res["owner_switch"]],
    )
    _table(
        "Decoding: E=64, top-2, greedy generate on both ranks (one prompt each, rank 0's numbers)",
        ["mode", "union share", "expert KiB per token", "tokens/s"],
        [
            [r["mode"], f"{r['union']:.3f}", f"{r['bytes_per_token'] / 1024:.1f}", f"{r['tokens_per_s']:.1f}"]
            for r in res["decode"]
        ],
    )
    _table(
        "Steps (per rank and step, forward + backward; 2 ranks, top-2)",
        ["E", "tokens", "mode", "union share", "formula", "gathered KiB", "peak gather KiB", "reduced KiB", "step ms"],
        [
            [
                r["E"],
                r["T"],
                r["mode"],
                f"{r['union']:.3f}",
                f"{1 - (1 - K / r['E']) ** r['T']:.3f}",
                f"{r['gathered'] / 1024:.1f}",
                f"{r['peak_gather'] / 1024:.1f}",
                f"{r['reduced'] / 1024:.1f}",
                f"{1000 * r['step_s']:.1f}",
            ]  # fmt: skip
            for r in res["steps"]
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
