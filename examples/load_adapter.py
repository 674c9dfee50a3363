"""Load a saved LoRA adapter on its base model with PEFT, check it was trained, and generate.

``python examples/load_adapter.py BASE ADAPTER``: one process, no zero_strategy. PEFT starts
``lora_B`` at zero, so an adapter whose ``lora_B`` tensors are all zero (or not finite) was not
trained, or was saved from placeholders; that exits with an error. Then it completes a prompt
with the adapter merged in.
"""

from __future__ import annotations

import argparse

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="the base model's directory or Hub name")
    p.add_argument("adapter", help="the directory trainer.save_model wrote")
    p.add_argument("--prompt", default="def copy(self):\n")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.base), args.adapter)
    lora = {name: t for name, t in model.named_parameters() if "lora_" in name}
    trained = [name for name, t in lora.items() if "lora_B" in name and t.abs().sum() > 0]
    if not lora or not trained or not all(torch.isfinite(t).all() for t in lora.values()):
        raise SystemExit(
            f"{args.adapter}: {len(lora)} adapter tensors, {len(trained)} trained lora_B: not a trained adapter"
        )
    model = model.merge_and_unload()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(
        f"adapter: {len(lora)} tensors, {len(trained)} lora_B trained; completion: {tokenizer.decode(out[0, ids.shape[1] :])!r}"
    )


if __name__ == "__main__":
    main()
