"""Run by ``test_multinode.py`` under two ``torchrun`` agents ("nodes") of 2 processes each, with
a c10d rendezvous on 127.0.0.1: ZeRO-2 and ZeRO-3 against DDP, then a save and a load.
Writes ``<out>/rank<r>.json`` after the final barrier."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_strategy as zs
from zero_strategy.testing import assert_close, assert_state_close
from zero_strategy.testing.parity import SEQ, VOCAB, Cell, Net


def train(mode: str, stage: int, rank: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Net(Cell(dtype="float64")).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "ddp":
        net = DDP(model)
    else:
        net, opt = zs.initialize(model, opt, stage=stage, reduce_bucket_size=700)
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        data = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        loss = F.cross_entropy(net(data[:, :-1]).reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zs.gathered_parameters(model) if mode == "zero" else torch.no_grad():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, model, opt


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {
        "world": dist.get_world_size(),
        "node": os.environ.get("GROUP_RANK"),
        "local_rank": os.environ.get("LOCAL_RANK"),
    }
    ref_losses, ref_state, _, _ = train("ddp", 0, rank)
    for stage in (2, 3):
        losses, state, model, opt = train("zero", stage, rank)
        assert_close(losses, ref_losses, rtol=1e-9, what=f"zero{stage} losses against DDP")
        assert_state_close(state, ref_state, rtol=1e-6, atol=1e-12, what=f"zero{stage} against DDP")
        path = zs.save_checkpoint(os.path.join(out_dir, f"ck{stage}"), model, opt, extra={"stage": stage})
        _, _, fresh, fresh_opt = train("zero", 5 - stage, rank)  # the other stage, then load into it
        result[f"zero{stage}_extra"] = zs.load_checkpoint(path, fresh, fresh_opt)
        with zs.gathered_parameters(fresh):
            loaded = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
        assert_state_close(loaded, state, rtol=0.0, atol=0.0, what=f"zero{stage} reloaded at stage {5 - stage}")
        result[f"zero{stage}_checked"] = True
        zs.destroy(model)
        zs.destroy(fresh)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
