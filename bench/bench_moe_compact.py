#!/usr/bin/env python
"""MoE at ZeRO-3: compact expert gathers (``moe_compact_gather``) against full-size ones, memory.

A Mixtral with one MoE layer of stacked experts (hidden 128, intermediate 128: 192 KiB per
expert, so 12 MiB for 64 experts and 192 MiB for 1,024), top-2, random token ids over a
4,096-token vocabulary (near-uniform routing at initialisation), AdamW, 2 CPU ranks (gloo, one
thread each). For 64 and 1,024 experts and 16, 256 and 4,096 tokens per step over both ranks,
each mode runs in fresh processes: one warm-up step, then ``--steps`` measured steps.
- "compact": the default. The union's rows become ``[U, ...]`` parameters; gradients are compact.
- "full-size": ``moe_compact_gather: false``, the zeroed full-size parameters of before.
Both keep the default cost switch (``moe_full_gather_share`` 0.2).

Per rank it reports:
- **layer peak**: ``memory_stats()["moe_peak_layer_bytes"]``, the most one layer's gathered
  expert parameters took at once;
- **process peak**: the growth of the process's peak resident memory over the measured steps
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, less ``VmRSS`` before them).
  It covers the gathered parameters, their gradients, the communication buffers and the
  activations;
- the union share and the step time.
The ratios compact / full-size are printed beside the union share.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_moe_compact.py [--steps 3] [--experts 64 1024] [--tokens 16 256 4096]
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
VOCAB = 4096
MODES = {"compact": True, "full-size": False}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, world: int, experts: int, tokens: int, compact: bool, steps: int, impl: str) -> dict:
    import torch
    import transformers

    import zero_strategy as zs

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=experts, num_experts_per_tok=K, max_position_embeddings=8192,
    )  # fmt: skip
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zcfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, moe_compact_gather=compact)
    model, opt = zs.initialize(model, opt, config=zcfg)
    engine = model.zero_engine
    times: list[float] = []
    base = hwm = 0
    before = engine.memory_stats()
    for step in range(steps + 1):
        if step == 1:  # after the warm-up: the peak from here on
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_kib("VmRSS")
            before = engine.memory_stats()
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (1, tokens // world), generator=g)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
    hwm = _status_kib("VmHWM")
    after = engine.memory_stats()
    seen = after["moe_experts_seen"] - before["moe_experts_seen"]
    return {
        "layer_peak": after["moe_peak_layer_bytes"],
        "full_layer": after["moe_full_bytes"] // max(after["moe_gathers"], 1),
        "process_peak": (hwm - base) * 1024,
        "union": (after["moe_union_experts"] - before["moe_union_experts"]) / max(seen, 1),
        "compact_gathers": after["moe_compact_gathers"] - before["moe_compact_gathers"],
        "whole_gathers": after["moe_full_gathers"] - before["moe_full_gathers"],
        "step_s": statistics.median(times),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    from zero_strategy.testing import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--experts", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--impl", default="grouped_mm", help="transformers' experts forward: eager, grouped_mm, batched_mm")
    args = ap.parse_args(argv)
    header = ["E", "tokens", "union share", "mode", "layer peak MiB", "x full layer", "process peak MiB", "step s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    ratios = []
    for e in args.experts:
        for t in args.tokens:
            got = {}
            for mode, compact in MODES.items():
                per_rank = launch(_worker, 2, args=(e, t, compact, args.steps, args.impl), timeout=1800)
                r = {k: max(x[k] for x in per_rank) for k in per_rank[0]}  # the larger rank's numbers
                got[mode] = r
                row = [
                    e, t, f"{r['union']:.3f}", mode, _mib(r["layer_peak"]),
                    f"{r['layer_peak'] / r['full_layer']:.2f}", _mib(r["process_peak"]), f"{r['step_s']:.3f}",
                ]  # fmt: skip
                print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
            c, f = got["compact"], got["full-size"]
            ratios.append((e, t, c["union"], c["layer_peak"] / f["layer_peak"], c["process_peak"] / f["process_peak"]))
    print("\n| E | tokens | union share | layer peak compact / full-size | process peak compact / full-size |")
    print("|---|---|---|---|---|")
    for e, t, u, lr, pr in ratios:
        print(f"| {e} | {t} | {u:.3f} | {lr:.2f} | {pr:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
