"""Offload copies beside the compute, on and off: step time and device memory on one GPU.

With the optimizer (and at ZeRO-3 the parameter rows) in host memory, each step copies
gradients to the host, steps on the host and copies parameters back. On CUDA those copies run
on side streams (``storage/uploads.py``: the rows' copy into each gather, the host step's
uploads group by group; ``reduction/host_copies.py``: the gradients' copies during the
backward). ``ZERO_STRATEGY_OFFLOAD_OVERLAP=0`` turns all of them back into the plain blocking
copies. This bench runs each setting both ways, interleaved ``--repeats`` times, in one
process on one device (the overlap is a property of each rank), and prints the median s/step
(the device synchronised at the end of each step), the ratio on/off and the peak device memory.

    PYTHONPATH=. python bench/bench_offload_overlap.py                  # a GPU
    PYTHONPATH=. python bench/bench_offload_overlap.py --tiny --steps 2 # a smoke run, CPU too

On CPU both rows take the same path (there is no stream to overlap on): a smoke run only,
and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.models import GPT, GPTConfig  # noqa: E402

SETTINGS = {
    "zero3, params and optimizer on the host": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "zero3, optimizer on the host": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero2, optimizer on the host": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def _run(args: argparse.Namespace, zero: dict, overlap: bool, device: torch.device) -> dict[str, float]:
    os.environ["ZERO_STRATEGY_OFFLOAD_OVERLAP"] = "1" if overlap else "0"  # read at initialize
    torch.manual_seed(0)
    if args.tiny:
        cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=64, n_layer=2, n_head=4)
    else:
        cfg = GPTConfig(vocab_size=4096, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=16)
    config = {"zero_optimization": {**zero, "stage3_param_persistence_threshold": 0}}
    model, opt = zs.initialize(GPT(cfg).to(device), lambda p: torch.optim.AdamW(p, lr=1e-4), config=config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())
    finally:
        zs.destroy(model)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else float("nan")
    return {"s_step": statistics.median(times), "peak_mib": peak, "last_loss": losses[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a 0.1M-parameter GPT (a smoke run)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for name, zero in SETTINGS.items():
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for overlap in (False, True):
                runs[overlap].append(_run(args, zero, overlap, device))
        on, off = (statistics.median(r["s_step"] for r in runs[o]) for o in (True, False))
        loss_on, loss_off = runs[True][-1]["last_loss"], runs[False][-1]["last_loss"]
        if loss_on != loss_off:  # the same copies, only their timing differs: the same numbers
            raise SystemExit(f"{name}: the last loss differs on and off ({loss_on} vs {loss_off})")
        rows.append({"setting": name, "off_s": off, "on_s": on, "ratio": on / off,
                     "peak_off_mib": max(r["peak_mib"] for r in runs[False]),
                     "peak_on_mib": max(r["peak_mib"] for r in runs[True])})  # fmt: skip
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (both rows take one path)'}")
    print("| setting | overlap off s/step | on s/step | on / off | peak MiB off | peak MiB on |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setting']} | {r['off_s']:.4f} | {r['on_s']:.4f} | {r['ratio']:.2f}x "
              f"| {r['peak_off_mib']:.0f} | {r['peak_on_mib']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
