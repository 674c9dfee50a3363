"""Supervised fine-tuning with TRL's ``SFTTrainer`` and a PEFT LoRA adapter: an ordinary TRL script.

Nothing here names zero_strategy: under ``zero-strategy launch --zero-config zero3`` the
Trainer's ``accelerator.prepare`` hands the model to the ZeRO-3 engine; without it the same
script trains with the Trainer's own DDP. docs/finetuning.md has the commands (the model and
data come from ``examples/make_tiny_llama.py``). At the end every process calls
``trainer.save_model`` (at ZeRO-3 it gathers the weights and PEFT keeps the adapter's entries),
and the main process writes ``OUT/log_history.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory or Hub name")
    p.add_argument("--data", required=True, help='a JSON-lines file with a "text" column')
    p.add_argument("--out", required=True, help="where the adapter goes")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    data = load_dataset("json", data_files=args.data, split="train")
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip
    config = SFTConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-2,
                       max_length=64, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                       use_cpu=not torch.cuda.is_available())  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora)
    trainer.train()
    trainer.save_model(args.out)  # every process (a collective at ZeRO-3)
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"sft: losses {' '.join(f'{v:.3f}' for v in losses)}; adapter saved to {args.out}")


if __name__ == "__main__":
    main()
