"""DPO with TRL's ``DPOTrainer`` and a separate reference model: an ordinary TRL script.

The policy is fine-tuned in full; ``ref_model`` is a second copy of the starting weights that
TRL prepares for evaluation alone. Under ``zero-strategy launch --zero-config zero3`` both go
to the ZeRO-3 engine (the reference without an optimizer), so each process holds about
1/world of each; with ``ZERO_SHARDED_FROM_PRETRAINED=1`` as well, both ``from_pretrained``
calls below build the models in pieces read from the files, so no process ever holds either
whole. docs/finetuning.md has the commands. At the end every process calls
``trainer.save_model`` (at ZeRO-3 it gathers the full weights) and the main process writes
``OUT/log_history.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory or Hub name")
    p.add_argument("--data", required=True, help='a JSON-lines file with "prompt", "chosen", "rejected" columns')
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model)
    data = load_dataset("json", data_files=args.data, split="train")
    config = DPOConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                       beta=0.1, max_length=64, logging_steps=1, save_strategy="no", report_to="none",
                       disable_tqdm=True, use_cpu=not torch.cuda.is_available())  # fmt: skip
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(args.out)  # every process (a collective at ZeRO-3)
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"dpo: losses {' '.join(f'{v:.3f}' for v in losses)}; model saved to {args.out}")


if __name__ == "__main__":
    main()
