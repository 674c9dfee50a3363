"""Exposed communication per ZeRO stage: how much of each step the host spent waiting on
collectives (``zs.comm_report()``), on 2 ranks, with one Chrome trace per stage.

Each stage trains the bench GPT (``GPTConfig.bench()``, about 63M parameters) for ``--warmup``
unmeasured and ``--steps`` measured steps; the measured ones run under ``zs.profile`` on rank 0
(the trace goes to ``--trace-dir``). Printed per stage: step time, exposed seconds and their
share of the step (the seed benchmark table's "communication overhead" column), the time spent
issuing collectives, and the bytes moved per step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_overlap.py --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def _worker(rank: int, world: int, stage: int, warmup: int, steps: int, trace_dir: str, tiny: bool) -> dict:
    import contextlib

    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=2, n_head=4) if tiny else GPTConfig.bench()
    torch.manual_seed(0)
    model, opt = zs.initialize(
        GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-4), config={"zero_optimization": {"stage": stage}}
    )

    def step(k: int) -> None:
        x, y = synthetic_batch(cfg, 4, k, seed=rank)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()

    for k in range(warmup):
        step(k)
    trace = str(Path(trace_dir, f"zero{stage}.json"))
    zs.reset_comm_stats()
    with zs.profile(trace) if rank == 0 else contextlib.nullcontext():
        for k in range(warmup, warmup + steps):
            step(k)
    out = zs.comm_report()
    out["trace"] = trace if rank == 0 else None
    model.zero_engine.close()
    return out


def main(argv: list[str] | None = None) -> None:
    from zero_strategy.testing.launcher import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 0.5M-parameter GPT (a quick check)")
    ap.add_argument("--trace-dir", default=tempfile.mkdtemp(prefix="zero-traces-"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = {}
    for stage in (int(s) for s in args.stages.split(",")):
        res = launch(_worker, 2, args=(stage, args.warmup, args.steps, args.trace_dir, args.tiny), timeout=1800,
                     env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        rows[stage] = res
    print(
        f"\n2 ranks, {'tiny' if args.tiny else 'bench'} GPT, {args.steps} measured steps; traces in {args.trace_dir}\n"
    )
    print("| stage | rank | step s | exposed comm s | exposed % of step | issuing s | MB per step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for stage, res in rows.items():
        for rank, r in enumerate(res):
            print(f"| zero{stage} | {rank} | {r['step_seconds']:.3f} | {r['exposed_seconds']:.3f} | "
                  f"{r['exposed_pct']:.1f}% | {r['issue_seconds']:.3f} | {r['bytes'] / 2**20:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
