"""Run under ``zero-strategy launch`` at ZeRO-3 by ``test_accelerate_pretrained.py``: an
unmodified ``AutoModelForCausalLM.from_pretrained`` builds the model in pieces; prepared with
its optimizer, 3 SGD steps equal DDP on a plain ``from_pretrained`` (loaded with the routing
switched off), and every rank writes its results to ``$ACCEL_JOB_OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM

from zero_strategy.sharding.pieces import is_placeholder
from zero_strategy.testing.lockstep import lockstep_losses

path = os.environ["PRETRAINED_DIR"]
accelerator = Accelerator()
rank = accelerator.process_index
os.environ["ZERO_SHARDED_FROM_PRETRAINED"] = "0"
plain = AutoModelForCausalLM.from_pretrained(path)
os.environ["ZERO_SHARDED_FROM_PRETRAINED"] = "1"
model = AutoModelForCausalLM.from_pretrained(path)
whole = [n for n, p in model.named_parameters() if p.numel() > 1 and not is_placeholder(p)]
model.train()
plain.train()
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
model, opt = accelerator.prepare(model, opt)
ddp = DDP(plain)
ref_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
losses = lockstep_losses(
    {"ddp": (ddp, ref_opt), "zero": (model, opt)},
    lambda step: torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank)),
    lambda m, idx: F.cross_entropy(m(input_ids=idx).logits.reshape(-1, 48), idx.reshape(-1)),
    backward={"zero": accelerator.backward},
)
out = {"whole": whole, "losses": losses, "engine": getattr(model, "zero_engine", None) is not None}
with open(os.path.join(os.environ["ACCEL_JOB_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
accelerator.wait_for_everyone()
