"""Train a small GPT on the Python standard library's source with ZeRO stage 1, 2 or 3.

    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 2
    python examples/train_gpt.py --stage 1            # one process works too

Runs on CPU (gloo) or CUDA (NCCL). Prints the loss and, per rank, the bytes of model state
this rank holds next to what plain DDP would hold.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, num_parameters
from zero_strategy.models.data import stdlib_corpus, text_batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--config", help="YAML/JSON config (DeepSpeed key names); --stage then must agree with it")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step (uses no_sync)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--precision", default=None, choices=(None, "bf16", "fp16"))
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--clip", type=float, default=1.0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and dist.is_initialized()
        else torch.device("cpu")
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    corpus = stdlib_corpus()
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    psi = num_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    overrides = {"stage": args.stage}
    if args.precision:
        overrides["precision"] = args.precision
    model, opt = zs.initialize(model, opt, config=args.config, **overrides)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    if rank == 0:
        print(
            f"GPT {psi / 1e6:.2f}M parameters, ZeRO stage {args.stage}, {world} rank(s), corpus {corpus.numel() / 1e6:.1f} MB of stdlib source"
        )

    t0 = time.perf_counter()
    for step in range(args.steps):
        for micro in range(args.accum):
            x, y = (t.to(device) for t in text_batch(corpus, args.batch, cfg.seq_len, step * args.accum + micro, rank))
            quiet = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with quiet:
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, 256), y.reshape(-1))
                zs.backward(loss / args.accum, model=model)
        opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - t0:.1f}s",
                flush=True,
            )

    stats = zs.memory_stats(model)
    ddp_bytes = 4 * psi + 4 * psi + 8 * psi  # fp32 params + grads + Adam moments, replicated
    line = (
        f"rank {rank}: model state {stats['model_state'] / 2**20:.1f} MiB "
        f"(params {stats['params'] / 2**20:.1f}, grad shards {stats['grad_shards'] / 2**20:.1f}, "
        f"optimizer {stats['optimizer_state'] / 2**20:.1f}, masters {stats['masters'] / 2**20:.1f}); "
        f"DDP would hold {ddp_bytes / 2**20:.1f} MiB"
    )
    if dist.is_initialized():
        lines = [None] * world
        dist.all_gather_object(lines, line)
        if rank == 0:
            print("\n".join(lines))
        dist.barrier()
        dist.destroy_process_group()
    else:
        print(line)


if __name__ == "__main__":
    main()
