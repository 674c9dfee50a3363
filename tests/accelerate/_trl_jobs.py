"""TRL's trainers with a LoRA adapter, as a TRL script writes them, several jobs in one launch.

``train(kind, out)`` is an ordinary TRL script that knows nothing of zero_strategy: a tiny GPT-2
and a word-level tokenizer built here (no download), a ``peft`` ``LoraConfig``, and
``SFTTrainer``, ``DPOTrainer`` without a ``ref_model`` (the reference log-probs come from the
same model with the adapter disabled, in ``no_grad``, between the policy's forward and its
backward) or ``DPOTrainer`` with one; then ``save_model``. ``TRL_JOBS`` lists ``name=config``
pairs run in order (``name`` is ``<kind>-<mode>``); ``_trainer_jobs.jobs`` removes
``ZERO_STRATEGY_CONFIG`` for a ``ddp`` job (the Trainer's own DDP) and sets it to the job's
config for any other. ``tests/accelerate/test_trl.py`` launches it and compares with DDP.

Each rank writes ``$ACCEL_JOB_OUT/rank<r>.json``: per job the logged losses and gradient norms
and which wrapper trained; rank 0 saves each adapter under ``$TRL_OUT/<name>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _trainer_jobs import jobs, report, run  # this script's directory is on sys.path

WORDS = "the a cat dog sat ran on under mat log big small red blue quickly slowly yes no".split()


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model(vocab: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def _sentences(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) for _ in range(n)]


def train(kind: str, out: Path) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tokenizer = _tokenizer()
    model = _model(len(tokenizer))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, task_type="CAUSAL_LM")
    common = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=3, learning_rate=5e-2,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, seed=0, dataloader_num_workers=0)  # fmt: skip
    if kind == "sft":
        data = Dataset.from_dict({"text": _sentences(16, 1)})
        args = SFTConfig(**common, max_length=16)
        trainer: Any = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                  peft_config=lora)  # fmt: skip
    else:
        data = Dataset.from_dict({"prompt": _sentences(16, 2), "chosen": _sentences(16, 3),
                                  "rejected": _sentences(16, 4)})  # fmt: skip
        args = DPOConfig(**common, max_length=24, beta=0.5)
        ref = _model(len(tokenizer)) if kind == "dpo-ref" else None
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=lora)  # fmt: skip
    trainer.train()
    trainer.save_model(str(out))
    return trainer


def main() -> None:
    root = Path(os.environ["TRL_OUT"])
    results = {}
    for name in jobs("TRL_JOBS"):
        kind = name.rsplit("-", 1)[0]
        trainer = train(kind, root / name)
        history = trainer.state.log_history
        engine = getattr(trainer.model, "_zero_engine", None)
        if engine is None:  # the engine's model is the one under the adapter
            base = getattr(getattr(trainer.model, "base_model", None), "model", None)
            engine = getattr(base, "_zero_engine", None)
        results[name] = {
            "loss": [e["loss"] for e in history if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in history if "grad_norm" in e],
            "wrapped": type(trainer.model_wrapped).__name__,
            "stage": None if engine is None else int(engine.config.stage),
        }
        if engine is not None:
            import zero_strategy as zs

            zs.destroy(engine.module)
        if dist.is_initialized():
            dist.barrier()
    report(results)


if __name__ == "__main__":
    run(main)
