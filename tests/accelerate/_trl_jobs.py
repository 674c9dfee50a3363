"""TRL's trainers with a LoRA adapter, as a TRL script writes them, several jobs in one launch.

``train(kind, out)`` is an ordinary TRL script that knows nothing of zero_strategy: a tiny GPT-2
and a word-level tokenizer built here (no download), a ``peft`` ``LoraConfig``, and
``SFTTrainer``, ``DPOTrainer`` without a ``ref_model`` (the reference log-probs come from the
same model with the adapter disabled, in ``no_grad``, between the policy's forward and its
backward) or ``DPOTrainer`` with one; then ``save_model``. Kind ``peft`` is the plain
``Trainer`` with ``get_peft_model`` on a tiny Llama, then the script's own
``save_pretrained`` (bare, and with ``state_dict=accelerator.get_state_dict(model)``). ``TRL_JOBS`` lists ``name=config``
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
    return _as_a_script_loads_it(GPT2LMHeadModel(cfg))


def _llama(vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                      bos_token_id=1, eos_token_id=1, attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    return _as_a_script_loads_it(LlamaForCausalLM(cfg))


def _as_a_script_loads_it(model: Any) -> Any:
    """Saved, then loaded with ``AutoModelForCausalLM.from_pretrained`` as a TRL script loads its
        ``model_name_or_path`` (at ZeRO-3 with ``ZERO_SHARDED_FROM_PRETRAINED=1``, which the test sets:
    the sharded load, issue 33 item 1)."""
    import tempfile

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:  # each rank its own files (save_pretrained writes on rank 0 only)
        model.config.save_pretrained(d)
        save_model(model, f"{d}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(d)


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _held_bytes(model: Any) -> int:
    """Parameter bytes this rank holds for ``model``: its shards on the engine, else every parameter."""
    import zero_strategy as zs

    ours = next((m for m in model.modules() if getattr(m, "_zero_engine", None) is not None), None)
    if ours is None:
        return _param_bytes(model)
    stats = zs.memory_stats(ours)
    return int(stats["params"] + stats["param_shards"])


def _every_rank(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _peft_trainer(out: Path, tokenizer: Any, common: dict[str, Any]) -> Any:
    """The plain ``Trainer`` with ``get_peft_model`` on a tiny Llama, as a PEFT script writes it."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(_llama(len(tokenizer)), lora)
    data = Dataset.from_dict({"text": _sentences(16, 5)}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=16), remove_columns=["text"]
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return Trainer(model=model, args=TrainingArguments(**common), train_dataset=data, data_collator=collator)


def _plain_peft_save(trainer: Any, out: Path) -> str | None:
    """A PEFT script's own save after training: ``save_pretrained(dir)`` as it is (refused at
    ZeRO-3: the error text, else None), then DeepSpeed's form with ``accelerator.get_state_dict``."""
    model, main = trainer.model, trainer.accelerator.is_main_process
    error = None
    try:
        model.save_pretrained(str(out / "bare"), is_main_process=main)
    except RuntimeError as exc:
        error = str(exc)
    state_dict = trainer.accelerator.get_state_dict(model)  # every rank: a collective at ZeRO-3
    model.save_pretrained(str(out / "plain"), state_dict=state_dict, is_main_process=main)
    return error


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
    ref_full: int | None = None
    if kind == "peft":
        trainer: Any = _peft_trainer(out, tokenizer, common)
    elif kind == "sft":
        data = Dataset.from_dict({"text": _sentences(16, 1)})
        args = SFTConfig(**common, max_length=16)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                  peft_config=lora)  # fmt: skip
    else:
        data = Dataset.from_dict({"prompt": _sentences(16, 2), "chosen": _sentences(16, 3),
                                  "rejected": _sentences(16, 4)})  # fmt: skip
        args = DPOConfig(**common, max_length=24, beta=0.5)
        ref = _model(len(tokenizer)) if kind == "dpo-ref" else None
        ref_full = None if ref is None else _param_bytes(ref)
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=lora)  # fmt: skip
    trainer.train()
    trainer.save_model(str(out))
    trainer.zero_info = {}  # what the test checks besides the logs
    if kind == "peft":
        trainer.zero_info["bare_save_error"] = _plain_peft_save(trainer, out)
    if ref_full is not None:  # the reference model's parameter bytes on each rank, and its full size
        ref_engine = getattr(trainer.ref_model, "_zero_engine", None)
        trainer.zero_info |= {"ref_full": ref_full, "ref_held": _every_rank(_held_bytes(trainer.ref_model)),
                              "ref_stage": None if ref_engine is None else int(ref_engine.config.stage),
                              "policy_held": _every_rank(_held_bytes(trainer.model))}  # fmt: skip
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
            **trainer.zero_info,
        }
        import zero_strategy as zs

        for module in (engine.module if engine is not None else None, getattr(trainer, "ref_model", None)):
            if getattr(module, "_zero_engine", None) is not None:
                zs.destroy(module)
        if dist.is_initialized():
            dist.barrier()
    report(results)


if __name__ == "__main__":
    run(main)
