"""Cheaper ZeRO-3 parameter gathers against DDP: error and bytes on the wire over 50 steps.

The small GPT of the tests (``zero_strategy.testing.wire_parity.SMALL``: vocab 64, d 32, 2
layers, seq 16, batch 2 per rank) on 2 ranks, stage 3 with every unit freed after use, once
per configuration with the same seed and data (``wire_parity.train``):

- ``gather_dtype`` bf16 and fp16 under "bf16-mixed"/"16-mixed", AdamW 1e-2, against their
  oracle (DDP under autocast with the weights rounded to 16 bits for the forward) and against
  DDP under autocast alone;
- ``zero_quantized_weights`` (qwZ) in fp32 against DDP, with SGD 0.5 and with AdamW 1e-2.

Printed per run: the largest relative per-step loss error, the update error
(``||zero - ddp|| / ||ddp - init||`` of the final parameters, ``wire_parity.update_error``),
the last losses, and the all-gather bytes as a share of the exact fp32 run's (``comm_stats``).

    PYTHONPATH=. python bench/bench_wire.py --steps 50
"""

from __future__ import annotations

import argparse
import json


def _worker(rank: int, world: int, steps: int) -> list[dict]:
    import torch

    from zero_strategy.testing import rel_error
    from zero_strategy.testing.wire_parity import train, update_error

    rows = []
    exact = train("zero", rank, steps=steps)

    def row(name: str, got, ref, against: str) -> None:
        rows.append({
            "run": name, "against": against, "loss_rel": rel_error(got.losses, ref.losses),
            "update_error": update_error(got, ref), "last_loss": got.losses[-1], "ref_last_loss": ref.losses[-1],
            "gather_bytes_share": got.moved["all_gather"] / exact.moved["all_gather"],
        })  # fmt: skip

    for precision, dtype, name in (("bf16-mixed", torch.bfloat16, "bf16"), ("16-mixed", torch.float16, "fp16")):
        got = train("zero", rank, steps=steps, precision=precision, config={"gather_dtype": name})
        oracle = train("ddp", rank, steps=steps, precision=precision, round_to=dtype)
        plain = train("ddp", rank, steps=steps, precision=precision)
        row(f"gather_dtype={name} ({precision}, adamw)", got, oracle, "DDP, weights rounded")
        row(f"gather_dtype={name} ({precision}, adamw)", got, plain, "DDP under autocast")
    for optim, lr in (("sgd", 0.5), ("adamw", 1e-2)):
        got = train("zero", rank, steps=steps, optim=optim, lr=lr, config={"zero_quantized_weights": True})
        ref = train("ddp", rank, steps=steps, optim=optim, lr=lr)
        row(f"zero_quantized_weights (fp32, {optim})", got, ref, "DDP")
    return rows


def main() -> None:
    from zero_strategy.testing import launch

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = launch(_worker, 2, args=(args.steps,), timeout=1800)[0]
    print("| run | against | max per-step loss error (rel) | update error | last loss (ref) | gather bytes / fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['against']} | {r['loss_rel']:.2e} | {r['update_error']:.3f} | "
              f"{r['last_loss']:.4f} ({r['ref_last_loss']:.4f}) | {r['gather_bytes_share']:.4f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
