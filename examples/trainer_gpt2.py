"""Train a small GPT-2 with the Hugging Face ``Trainer``: an ordinary script, no zero_strategy import.

The same file trains with the ``Trainer``'s own DDP or on the ZeRO engine; only the launch
differs. On CPU, 2 processes (gloo), from the repository root::

    # the Trainer's own DDP
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate_cpu.yaml examples/trainer_gpt2.py
    # the ZeRO engine (stage 3): either launch
    ACCELERATE_USE_CPU=true zero-strategy launch --zero-config zero3 \\
        --config_file configs/accelerate_cpu.yaml examples/trainer_gpt2.py
    ACCELERATE_USE_CPU=true ZERO_STRATEGY_CONFIG=zero3 \\
        accelerate launch --config_file configs/accelerate_cpu.yaml examples/trainer_gpt2.py

On GPUs use ``--config_file configs/accelerate_gpu.yaml`` without ``ACCELERATE_USE_CPU``.

The model is built from a config (no download); the data is byte-level text from the Python
standard library's source. The run evaluates and saves a checkpoint every ``--save-steps``,
keeps ``--save-total-limit`` of them, loads the best one at the end, then writes the model with
``trainer.save_model()`` to ``OUT/final`` and ``trainer.state.log_history`` to
``OUT/log_history.json``. ``--resume CHECKPOINT`` continues a run from one of its checkpoints
(at any number of processes: give the same global batch, e.g. ``--batch 8`` on 1 process for
``--batch 4`` on 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class ByteWindows(Dataset):
    """Fixed windows of ``seq`` bytes from the standard library's ``*.py`` files (no download)."""

    def __init__(self, count: int, seq: int, offset: int) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:40])
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        start = offset * seq
        self.windows = tokens[start : start + count * seq].view(count, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/trainer-gpt2", help="output_dir of the Trainer (runs/ is git-ignored)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (max_steps)")
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--save-steps", type=int, default=2, help="save_steps and eval_steps")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2's three dropout rates")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (transformers' activation_checkpointing)")  # fmt: skip
    p.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    p.add_argument("--save-only-model", action="store_true",
                   help="TrainingArguments(save_only_model=True): checkpoints hold the weights alone")  # fmt: skip
    p.add_argument("--evaluate-first", action="store_true", help="trainer.evaluate() before training")
    p.add_argument("--greater-is-better", action="store_true",
                   help="keep the checkpoint with the highest eval loss as the best (tests: an early one)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Trainer:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)  # fmt: skip
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accum,
        learning_rate=3e-3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        load_best_model_at_end=True,
        save_only_model=args.save_only_model,
        metric_for_best_model="eval_loss",
        greater_is_better=args.greater_is_better,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing or None,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=ByteWindows(64, 32, offset=0),
        eval_dataset=ByteWindows(16, 32, offset=64),
    )
    if args.evaluate_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(os.path.join(args.out, "final"))  # every process calls it, as with DDP
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    return trainer


if __name__ == "__main__":
    main()
