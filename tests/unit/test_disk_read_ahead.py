"""ZeRO-3 rows on NVMe read ahead in the background (issue 34 item 3): the next unit's rows are
read while the current unit computes, so the gathers find them in memory. Same numbers as
reading them when each gather is issued; the read-ahead count shows the reads moved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.runtime.module import get_engine
from zero_strategy.testing.parity import Cell, Net, batch


def _train(tmp: Path, read_ahead: bool, all_nvme: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    torch.manual_seed(0)
    model = Net(Cell(stage=3, n_blocks=4))
    offload = {"device": "nvme", "nvme_path": str(tmp)}
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": offload,
                                 "offload_optimizer": offload if all_nvme else {"device": "cpu"}}}  # fmt: skip
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    swap = get_engine(model).disk.row_swap
    assert swap is not None
    swap.read_ahead = read_ahead
    losses = []
    for step in range(3):
        x, y = batch(step, 0, 0)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        assert not swap.ahead, "reads ahead left after the step"
    with torch.no_grad():
        model(batch(9, 0, 0)[0])  # an evaluation forward reads ahead too
    reads = dict(swap.reads)
    full = zs.full_state_dict(model)
    get_engine(model).close()
    return losses, full, reads


@pytest.mark.parametrize("all_nvme", [False, True])
def test_rows_read_ahead_give_the_same_numbers_and_leave_the_gathers(tmp_path: Path, all_nvme: bool) -> None:
    want_losses, want, inline_only = _train(tmp_path / "a", False, all_nvme)
    got_losses, got, reads = _train(tmp_path / "b", True, all_nvme)
    assert got_losses == want_losses
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert inline_only["ahead"] == 0 and reads["ahead"] > 0, (inline_only, reads)
    # 4 blocks, prefetch depth 1: in each training pass after the first step (2 forwards, 2
    # backwards) the third and fourth unit's rows are read ahead (the first is gathered at
    # once, the second prefetched at once); the evaluation forward does not prefetch
    assert reads["ahead"] == 8, reads
    assert reads["inline"] + reads["ahead"] == inline_only["inline"], (
        inline_only,
        reads,
    )  # each read moved, none added
