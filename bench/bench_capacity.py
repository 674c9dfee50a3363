"""The largest GPT that trains 3 steps on 2 ranks under a fixed per-process memory cap.

Each rank caps its address space (``RLIMIT_AS``) at what it uses after start-up plus
``--budget-gib``, builds the model under ``zs.sharded_init()`` (no rank ever holds it whole),
and trains 3 AdamW steps at ZeRO-3. Per configuration, models grow by layers until one fails
(a ``MemoryError``/``RuntimeError`` from the allocator under the cap, or a killed rank); the
largest that finished is reported, with its parameters and the ratio to the no-offload one.

Configurations (``--configs``):

- ``none``: ZeRO-3, everything in memory (16 bytes per parameter / N: parameter shard =
  master, gradient shard, Adam's two moments);
- ``opt_nvme``: ``offload_optimizer: {device: nvme}`` (the moments in swap files);
- ``param_cpu_opt_nvme``: plus ``offload_param: {device: cpu}`` (on this CPU-only machine
  the host row *is* the master: no second fp32 copy);
- ``all_nvme``: ``offload_param: {device: nvme}`` too (ZeRO-Infinity): the rows, which are
  the masters, in swap files as well; between steps only the gradient shards stay.

On a machine without a GPU, "device" and "host" are the same RAM, so offloading to the CPU
saves nothing here; only the disk tier moves bytes out of the cap. The design notes' "ZeRO-3 +
NVMe" row at this machine's scale.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_capacity.py --budget-gib 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

OFFLOAD = {
    "none": {},
    "opt_nvme": {"offload_optimizer": {"device": "nvme"}},
    "param_cpu_opt_nvme": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "cpu"}},
    "all_nvme": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}
D_MODEL, N_HEAD, VOCAB, SEQ = 1024, 16, 4096, 64
# glibc, the same for every configuration: few arenas, and buffers of 1 MiB and more always mapped
# on their own, so that freeing one gives its memory back (glibc's default raises that threshold
# up to 32 MiB after the first free, and the heap then keeps the holes that unit-sized buffers
# leave: the cap would measure fragmentation instead of what each configuration holds)
ALLOCATOR_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def _worker(rank: int, world: int, config: str, layers: int, budget: float, nvme: str, out_dir: str) -> dict:
    import resource

    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig

    def vm() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    offload = {k: dict(v) for k, v in OFFLOAD[config].items()}
    for block in offload.values():
        if block["device"] == "nvme":
            block["nvme_path"] = nvme
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D_MODEL, n_layer=layers, n_head=N_HEAD, tie_embeddings=False)
    torch.manual_seed(0)
    # the I/O threads and the allocator's arenas exist before the cap
    cap = vm() + int(budget * 2**30)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))  # the soft limit: lifted again before teardown
    out: dict = {"layers": layers}
    t0 = time.perf_counter()
    try:
        with zs.sharded_init():
            model = GPT(cfg)
        out["params"] = sum(p.numel() for p in model.parameters())
        model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-4),
                                   config={"zero_optimization": {"stage": 3, **offload}})  # fmt: skip
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
            loss = model.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["ok"], out["losses"] = True, losses
        stats = model.zero_engine.memory_stats()
        out["stats"] = {k: stats[k] for k in ("model_state", "tier_device", "tier_host_pageable", "tier_disk")}
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        model.zero_engine.close()  # the swap files go; no destroy(): it would gather the whole model
    except (MemoryError, RuntimeError) as e:
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-3:]  # where the allocation failed
        out["ok"], out["error"] = False, f"{type(e).__name__}: {str(e)[:200]}"
        out["where"] = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in where]
    out["seconds"] = time.perf_counter() - t0
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # gloo's teardown may allocate
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))  # kept even if the exit goes wrong
    return out


def main(argv: list[str] | None = None) -> None:
    from zero_strategy.testing.launcher import RankFailure, launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--configs", default="none,opt_nvme,param_cpu_opt_nvme,all_nvme")
    ap.add_argument("--start", type=int, default=8, help="layers of the first model tried")
    ap.add_argument("--step", type=int, default=4, help="layers added per try")
    ap.add_argument("--max-layers", type=int, default=64)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = {}
    for config in args.configs.split(","):
        best = None
        layers = args.start
        while layers <= args.max_layers:
            out_dir = tempfile.mkdtemp(prefix="zero-capacity-")
            exit_note = ""
            try:
                res = launch(_worker, 2, args=(config, layers, args.budget_gib, args.nvme_path, out_dir), timeout=900,
                             env=ALLOCATOR_ENV)  # fmt: skip
            except RankFailure as e:  # a rank that trained and then failed at exit still trained
                files = [Path(out_dir, f"rank{r}.json") for r in range(2)]
                res = [json.loads(f.read_text()) for f in files if f.exists()]
                exit_note = f" (exit failed: {str(e).splitlines()[0][:120]})"
                if len(res) < 2:
                    res = [{"error": str(e).splitlines()[0][:200]}]
            ok = len(res) == 2 and all(r.get("ok") for r in res)
            res[0]["exit_note"] = exit_note
            print(f"{config}: {layers} layers -> {'ok' if ok else 'failed'} {res[0].get('params', '')} "
                  f"{res[0].get('seconds', 0):.0f}s {res[0].get('error', '')} {res[0].get('where', '')}{exit_note}",
                  flush=True)  # fmt: skip
            if not ok:
                break
            best = res[0]
            layers += args.step
        rows[config] = best
    base = (rows.get("none") or {}).get("params")
    print(f"\nbudget {args.budget_gib} GiB per process above start-up, 2 ranks, ZeRO-3, fp32 AdamW, d {D_MODEL}\n")
    print(
        "| config | largest that trained 3 steps | parameters | ratio to none | peak RSS GiB | model state GiB | disk GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for config, r in rows.items():
        if r is None:
            print(f"| {config} | none | | | | | |")
            continue
        ratio = f"{r['params'] / base:.2f}x" if base else "-"
        st = r["stats"]
        print(f"| {config} | {r['layers']} layers | {r['params'] / 1e6:.0f}M | {ratio} | {r['peak_rss_gib']:.2f} | "
              f"{st['model_state'] / 2**30:.2f} | {st['tier_disk'] / 2**30:.2f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
