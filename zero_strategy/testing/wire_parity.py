"""The oracles of the cheaper collectives (16-bit and int8 parameter gathers, quantized gradients):
one training loop of the small GPT for the engine and for DDP, used by the tests and the bench.

- ``round_to``: DDP under autocast with its fp32 weights rounded to that dtype for the forward
  and backward (restored before the step): the exact oracle of ``gather_dtype``, whose gathered
  parameters are fp32 tensors holding the 16-bit values.
- ``round_to=None``: plain DDP (under the same autocast, if any): the reference the lossy codecs
  are measured against.

:func:`train` returns a :class:`Run`: the per-step losses, the initial and final parameters and
the bytes each collective kind moved during the steps (``comm_stats``), on this rank;
:func:`update_error` measures a lossy run against its reference.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, synthetic_batch

__all__ = ["SMALL", "Run", "train", "update_error"]

SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4, qkv_bias=False)
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class Run:
    losses: list[float]
    init: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    moved: dict[str, float]  # bytes per collective kind during the steps


def update_error(got: Run, ref: Run) -> float:
    """How far ``got``'s training moved from ``ref``'s, against how far ``ref`` moved:
    ``||got.final - ref.final|| / ||ref.final - ref.init||`` over all parameters (NaN: inf)."""
    num = sum(float((got.final[k] - ref.final[k]).double().square().sum()) for k in ref.final)
    den = sum(float((ref.final[k] - ref.init[k]).double().square().sum()) for k in ref.final)
    err = (num / den) ** 0.5 if den > 0 else float("inf")
    return err if err == err else float("inf")


def train(
    mode: str,
    rank: int,
    *,
    steps: int,
    precision: str = "fp32",
    round_to: torch.dtype | None = None,
    config: dict[str, Any] | None = None,
    cfg: GPTConfig = SMALL,
    lr: float = 1e-2,
    optim: str = "adamw",
    batch: int = 2,
) -> Run:
    """Train ``cfg``'s GPT for ``steps`` with ``optim`` ("adamw" or "sgd") under ``mode`` "ddp" or "zero" (``config``:
    ZeroConfig keywords; stage 3 with every unit freed unless it says otherwise)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    init = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    opt: Any = (torch.optim.AdamW if optim == "adamw" else torch.optim.SGD)(model.parameters(), lr=lr)
    autocast = _AUTOCAST.get(precision)
    scaler = torch.amp.GradScaler("cpu") if autocast == torch.float16 and mode == "ddp" else None
    if mode == "ddp":
        net: Any = DDP(model)
    else:
        kw = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 5000, **(config or {})}
        net, opt = zs.initialize(model, opt, precision=precision, **kw)
    zs.reset_comm_stats()
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, batch, step, seed=rank)
        saved = _round(model, round_to) if mode == "ddp" and round_to is not None else None
        use = torch.autocast("cpu", dtype=autocast) if mode == "ddp" and autocast else contextlib.nullcontext()
        with use:
            logits = net(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            zs.backward(loss, model=net) if mode == "zero" else loss.backward()
        if saved is not None:
            with torch.no_grad():
                for p, s in zip(model.parameters(), saved):
                    p.copy_(s)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    moved = {k: v["bytes"] for k, v in zs.comm_stats().items()}
    with zs.gathered_parameters(model) if mode == "zero" else torch.no_grad():
        final = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    return Run(losses, init, final, moved)


def _round(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """Round every parameter to ``dtype`` in place (kept fp32); the originals, to restore."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            saved.append(p.detach().clone())
            p.copy_(p.to(dtype))
    return saved
