"""Checkpoint save/load time and peak memory, ours against the peers, in one run.

    python bench/bench_checkpoint.py [--repeats 3]

2 ranks, CPU/gloo, the 63M-parameter bench GPT with AdamW state after one step:
- ``ddp_torch_save``: DDP, rank 0 ``torch.save`` of the model and optimizer state dicts; load
  with ``torch.load`` + ``load_state_dict`` on every rank.
- ``fsdp2_dcp``: FSDP2 (``fully_shard`` per block), ``torch.distributed.checkpoint`` with
  ``get_state_dict`` / ``set_state_dict``.
- ``zero2``, ``zero3``: ``zero_strategy.save_checkpoint`` / ``load_checkpoint``.
Peak RSS is the increase of the resident-set high-water mark during the save or the load
(reset through /proc/self/clear_refs before each), max over ranks; times are rank 0's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

ENGINES = ("ddp_torch_save", "fsdp2_dcp", "zero2", "zero3")


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, engine: str, root: str) -> dict:
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig.bench()

    def build():
        torch.manual_seed(0)
        model = GPT(cfg)
        opt_fn = lambda p: torch.optim.AdamW(p, lr=1e-4)
        if engine == "ddp_torch_save":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model), opt_fn(model.parameters())
        if engine == "fsdp2_dcp":
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)
            return model, opt_fn(model.parameters())
        return zs.initialize(model, opt_fn, stage=int(engine[-1]))

    def one_step(model, opt):
        x, y = synthetic_batch(cfg, 2, 0, seed=rank)
        F.cross_entropy(model(x).view(-1, cfg.vocab_size), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    def save(model, opt):
        if engine == "ddp_torch_save":
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, f"{root}/ddp.pt")
        elif engine == "fsdp2_dcp":
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/fsdp2")
        else:
            zs.save_checkpoint(f"{root}/{engine}", model, opt)
        dist.barrier()

    def load(model, opt):
        if engine == "ddp_torch_save":
            sd = torch.load(f"{root}/ddp.pt", map_location="cpu", weights_only=True)
            model.module.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        elif engine == "fsdp2_dcp":
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=f"{root}/fsdp2")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            zs.load_checkpoint(f"{root}/{engine}", model, opt)
        dist.barrier()

    model, opt = build()
    one_step(model, opt)
    out = {}
    for what, fn in (("save", save), ("load", load)):
        if what == "load":
            model, opt = build()
            one_step(model, opt)  # optimizer state exists, as when resuming a run
        dist.barrier()
        _reset_hwm()
        base = _hwm_mib()
        t0 = time.perf_counter()
        fn(model, opt)
        out[f"{what}_s"] = time.perf_counter() - t0
        out[f"{what}_rss"] = _hwm_mib() - base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    from zero_strategy.testing import launch

    engines = args.engines.split(",")
    runs: dict[str, list[list[dict]]] = {e: [] for e in engines}
    for _ in range(args.repeats):  # interleaved
        for e in engines:
            with tempfile.TemporaryDirectory() as root:
                runs[e].append(launch(_worker, 2, args=(e, root), timeout=900))
    print("| engine | save s (median) | load s (median) | save peak RSS +MiB | load peak RSS +MiB |")
    print("|---|---|---|---|---|")
    for e in engines:
        save = statistics.median(r[0]["save_s"] for r in runs[e])
        load = statistics.median(r[0]["load_s"] for r in runs[e])
        srss = max(x["save_rss"] for r in runs[e] for x in r)
        lrss = max(x["load_rss"] for r in runs[e] for x in r)
        print(f"| {e} | {save:.2f} | {load:.2f} | {srss:.0f} | {lrss:.0f} |")


if __name__ == "__main__":
    main()
