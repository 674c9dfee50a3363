"""The ``muon`` job of ``_job.py``: one optimizer with Muon groups and AdamW groups
(``MuonWithAdamW``, ``_muon_optim.py``) through Accelerate and through the ``Trainer``.

The launch starts with ``ZERO_STRATEGY_CONFIG`` set (so the start-up hook wraps the
``Trainer``); each DDP run removes it and each ZeRO run sets it back.

- Accelerate: ``_job.py``'s loop (accumulation 2, ``clip_grad_norm_``, an LR schedule) on its
  tiny GPT, the blocks' 2-D weights in the Muon group: Accelerate's DDP
  (``accelerator.prepare(model, optimizer, ...)``), then ``ZeroPlugin.prepare`` at ZeRO-3
  (units freed);
- the ``Trainer``: a 2-layer GPT-2, ``Trainer(..., optimizers=(MuonWithAdamW, LambdaLR))``
  (the ``h.*`` 2-D weights in the Muon group), accumulation 2 and ``max_grad_norm``: its own
  DDP, then on the engine with the config ``MUON_TRAINER_CONFIG`` names.

Each run reports its losses, norms, final full weights and how many matrices the engine steps
whole; ``test_muon_accelerate.py`` compares them with DDP's.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
from _job import build, final_weights, train
from _muon_optim import MuonWithAdamW, one_optimizer, split

import zero_strategy as zs

ENV = "ZERO_STRATEGY_CONFIG"


@contextmanager
def _engine_requested(config: str | None):
    """``ZERO_STRATEGY_CONFIG`` set to ``config`` (None: removed) for one run."""
    saved = os.environ.get(ENV)
    if config is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = config
    try:
        yield
    finally:
        if saved is not None:
            os.environ[ENV] = saved


def _whole(model: Any) -> int:
    engine = getattr(model, "zero_engine", None) or getattr(model, "_zero_engine", None)
    return -1 if engine is None else len(engine.whole.entries)


def _accelerate(out: dict[str, Any]) -> None:
    for mode in ("ddp", "zero3"):
        with _engine_requested(None):
            acc, model, opt, sched, _ = build(mode, optimizer=lambda m: one_optimizer(m, "blocks"))
            res = train(acc, model, opt, sched, 0, None)
            res["weights"] = {k: v.tolist() for k, v in final_weights(acc, model).items()}
            res["whole"] = _whole(model)
            out[f"accelerate-{mode}"] = res


def _trainer(mode: str, config: str | None) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    root = os.path.join(os.environ["ACCEL_JOB_OUT"], f"trainer-{mode}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))  # fmt: skip
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    matrices, rest = split(model, "transformer.h")
    opt = MuonWithAdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))
    args = TrainingArguments(output_dir=root, use_cpu=True, report_to="none", max_steps=4, logging_steps=1,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
                             save_strategy="no", disable_tqdm=True)  # fmt: skip
    with _engine_requested(config):
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
        trainer.train()
        engine_model = trainer.model
        with zs.gathered_parameters(engine_model) if _whole(engine_model) >= 0 else torch.no_grad():
            weights = {k: v.detach().clone().tolist() for k, v in engine_model.state_dict().items()}
        whole = _whole(engine_model)
        if whole >= 0:
            zs.destroy(engine_model)
    history = trainer.state.log_history
    return {
        "losses": [e["loss"] for e in history if "loss" in e],
        "norms": [e["grad_norm"] for e in history if "grad_norm" in e],
        "weights": weights,
        "whole": whole,
    }


def job_muon(out: dict[str, Any]) -> None:
    _accelerate(out)
    out["trainer-ddp"] = _trainer("ddp", None)
    out["trainer-zero"] = _trainer("zero", os.environ["MUON_TRAINER_CONFIG"])
