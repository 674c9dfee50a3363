"""A plain Accelerate training script that knows nothing of zero_strategy.

It is written as Accelerate's documentation and examples write one: ``accelerator.prepare(model,
optimizer, loader, scheduler)``, ``accelerator.accumulate``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` on the synchronising step, an evaluation through
``gather_for_metrics``, ``accelerator.get_state_dict`` at the end. The model has dropout and an
``abc.ABC`` base, as many real models do. ``tests/accelerate/test_unmodified_scripts.py`` runs it
under plain ``accelerate launch`` (DDP), under ``zero-strategy launch --zero-config ...`` and
under ``accelerate launch`` with ``ZERO_STRATEGY_CONFIG`` set, and compares.

Output: ``$ACCEL_JOB_OUT/rank<r>.json`` (losses, norms, evaluation loss, which engine each rank's
model ran on) and, from rank 0, ``$ACCEL_JOB_OUT/weights.pt``. ``UNMOD_PREPARE_MODEL=1`` prepares
the model with ``accelerator.prepare_model`` instead (a script that ends in DDP);
``UNMOD_LATE_OPTIMIZER=1`` prepares the model alone, then the optimizer and the rest in a second
call; ``UNMOD_MAIN_ONLY_STATE=1`` first calls ``get_state_dict`` under ``if
accelerator.is_main_process:`` (its error, if any, is recorded). ``accelerate launch
--dynamo_backend B`` compiles the model, as ``Accelerator(dynamo_backend=B)``.
"""

from __future__ import annotations

import abc
import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import is_compiled_module, set_seed
from torch import nn

VOCAB, SEQ, WIDTH, BATCH = 64, 8, 32, 4  # BATCH per process
STEPS, GAS, CLIP = 6, 2, 0.5


class Base(nn.Module, abc.ABC):
    @abc.abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor: ...


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(F.gelu(self.up(self.norm(h)))))


class TinyLM(Base):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(WIDTH, VOCAB)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    out = os.environ["ACCEL_JOB_OUT"]
    accelerator = Accelerator(gradient_accumulation_steps=GAS)
    set_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS * GAS * BATCH * accelerator.num_processes, SEQ + 1), generator=g)
    loader = torch.utils.data.DataLoader(list(data), batch_size=BATCH, shuffle=True, generator=g)
    evaluation = torch.utils.data.DataLoader(list(data[:13]), batch_size=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if os.environ.get("UNMOD_PREPARE_MODEL"):
        model = accelerator.prepare_model(model)
    if os.environ.get("UNMOD_LATE_OPTIMIZER"):  # the model first, the rest in a later call (legal in Accelerate)
        model = accelerator.prepare(model)
        optimizer, loader, scheduler, evaluation = accelerator.prepare(optimizer, loader, scheduler, evaluation)
    else:
        model, optimizer, loader, scheduler, evaluation = accelerator.prepare(
            model, optimizer, loader, scheduler, evaluation
        )

    losses, norms = [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in evaluation:
            logits = model(batch[:, :-1])
            per = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), reduction="none")
            per = accelerator.gather_for_metrics(per.reshape(batch.shape[0], -1).mean(1))
            total, count = total + float(per.sum()), count + per.numel()

    main_only = None
    if os.environ.get("UNMOD_MAIN_ONLY_STATE"):  # a common mistake: the collective on the main process only
        if accelerator.is_main_process:
            try:
                accelerator.get_state_dict(model)
            except RuntimeError as exc:
                main_only = str(exc)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, os.path.join(out, "weights.pt"))
    # the test's instrument, not the script's business: which engine holds the model
    engine = type(getattr(accelerator.unwrap_model(model), "_zero_engine", None)).__name__
    record = {"losses": losses, "norms": norms, "eval": total / count, "engine": engine,
              "ddp": isinstance(model, nn.parallel.DistributedDataParallel), "main_only": main_only,
              "compiled": is_compiled_module(model)}  # fmt: skip
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    accelerator.wait_for_everyone()
    with open(os.path.join(out, f"rank{accelerator.process_index}.done"), "w") as f:
        f.write("")
    accelerator.end_training()


if __name__ == "__main__":
    from _trainer_jobs import run  # the test harness's error report (this script's directory is on sys.path)

    run(main)
    sys.exit(0)
