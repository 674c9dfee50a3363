"""Train a small GPT-2 (transformers, random init, no download) with a plain Accelerate loop.

Nothing here names zero_strategy: the launch picks the engine. On CPU, 2 processes (gloo);
``configs/accelerate_cpu.yaml`` has ``distributed_type: MULTI_GPU`` and ``num_processes: 2``
(``--cpu`` would start one process only). From the repository root::

    ACCELERATE_USE_CPU=true zero-strategy launch --zero-config zero3 \\
        --config_file configs/accelerate_cpu.yaml examples/accelerate_hf_gpt2.py
    # the same:
    ACCELERATE_USE_CPU=true ZERO_STRATEGY_CONFIG=zero3 \\
        accelerate launch --config_file configs/accelerate_cpu.yaml examples/accelerate_hf_gpt2.py
    # and without a ZeRO config, Accelerate's own DDP:
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate_cpu.yaml examples/accelerate_hf_gpt2.py

On GPUs, ``--config_file configs/accelerate_gpu.yaml`` (one process per GPU) without
``ACCELERATE_USE_CPU``. Under ZeRO-3 each ``GPT2Block`` is a unit (the model's
``_no_split_modules``, as Accelerate's FSDP wraps it). The data is byte-level text from the
Python standard library's source. At the end it saves a sharded ``save_state`` checkpoint and
the model with ``save_pretrained`` from the gathered full weights, reloads it with
``from_pretrained`` and checks the weights are equal.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from zero_strategy.models.data import stdlib_corpus, text_batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    p.add_argument("--out", default="runs/gpt2-zero", help="save_pretrained directory (runs/ is git-ignored)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision)
    torch.manual_seed(0)  # every process builds the same model (the engine also broadcasts rank 0's)
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=192, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.print(f"{accelerator.num_processes} processes, mixed_precision={accelerator.mixed_precision}")

    corpus = stdlib_corpus(2_000_000)
    model.train()
    for step in range(args.steps * args.accum):
        x, y = text_batch(corpus, args.batch, 64, step, rank=accelerator.process_index)
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and (step // args.accum) % 10 == 0:
            mean = accelerator.reduce(loss.detach(), reduction="mean")
            accelerator.print(f"step {step // args.accum:4d}  loss {mean.item():.3f}  grad norm {norm.item():.3f}")

    accelerator.save_state(f"{args.out}-state")  # sharded: loads again at any number of processes
    state_dict = accelerator.get_state_dict(model)  # full weights on the main process, {} elsewhere
    accelerator.unwrap_model(model).save_pretrained(
        args.out,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=dict(state_dict),
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        reloaded = GPT2LMHeadModel.from_pretrained(args.out).state_dict()
        if not state_dict or set(reloaded) != set(state_dict):
            raise SystemExit(f"saved {len(state_dict)} tensors; from_pretrained gave {len(reloaded)} other names")
        differ = sorted(k for k, v in state_dict.items() if not torch.equal(reloaded[k], v))
        if differ:  # torch.equal is False for NaN too
            raise SystemExit(f"from_pretrained gave other weights for {differ}")
        print(f"saved {args.out}/ with save_pretrained; from_pretrained gives the same weights")
    accelerator.end_training()


if __name__ == "__main__":
    main()
