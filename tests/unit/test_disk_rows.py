"""ZeRO-3's parameter rows on disk (``offload_param: {device: nvme}``) in one process: the
rows leave memory between uses (placeholders: a read gives NaN, a write raises), the I/O buffer
is capped by ``buffer_size`` and chunked reads give the same bits, writes through
``gathered_parameters(modifier_rank=...)`` and ``load_full_state_dict`` reach the files, a
damaged file is named, and the files go with the engine. World size 1 here; the DDP parity at
world sizes 1 and 2 is in ``tests/distributed/test_offload.py``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_strategy as zs
from tests.unit.test_disk_tier import _train
from zero_strategy.sharding.pieces import is_placeholder
from zero_strategy.storage.disk import ALIGN
from zero_strategy.storage.disk_rows import RowSwap


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)) for _ in range(3))
        self.head = nn.Linear(8, 4)
        self.head.bias.requires_grad_(False)  # a frozen parameter: its own row in the file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _setup(tmp_path, opt_device: str | None, **param):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if opt_device is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), **param}
        zero["offload_optimizer"] = {"device": opt_device, "nvme_path": str(tmp_path)}
    policy = {nn.Sequential}
    opt = lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False)
    return zs.initialize(Net(), opt, config={"zero_optimization": zero}, policy=policy)


def _weights(model) -> dict[str, torch.Tensor]:
    with zs.gathered_parameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt_device", ["cpu", "nvme"])
def test_rows_live_in_files_and_train_bit_equal(tmp_path, opt_device: str) -> None:
    ref_model, ref_opt = _setup(tmp_path, None)
    ref = _train(ref_model, ref_opt)
    model, opt = _setup(tmp_path, opt_device, buffer_size=100)  # 100 elements: several chunks per row
    assert _train(model, opt) == ref and all(v == v for v in ref)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model).values(), _weights(ref_model).values()))
    engine = model.zero_engine
    units = engine.params.units
    assert len(units) == 4 and all(is_placeholder(u.row) or u.row.numel() <= 1 for u in units)
    rows = engine.disk.row_swap
    assert rows is not None and rows.chunk_bytes() == ALIGN  # 100 fp32 elements per call, one block
    # the slabs resident rows live in: at most two kept, each one unit's rows (not buffer_size x buffer_count)
    assert 0 < rows.buffer_bytes <= RowSwap.KEEP * max(f.nbytes for f in rows.files)
    stats = engine.memory_stats()
    files = {f.path: os.path.getsize(f.path) for f in rows.files}
    assert stats["param_shards"] == sum(files.values()) == rows.disk_bytes() > 0
    assert stats["swap_buffers"] >= rows.buffer_bytes
    if opt_device == "nvme":  # the masters are the rows: memory-less between steps
        masters = [m for g in engine.groups for m in g.masters]
        assert stats["masters"] == 0 and all(is_placeholder(m) for m in masters if m.numel() > 1)
        assert torch.isnan(masters[0]).all()  # a stray read sees NaN, not freed memory
        with pytest.raises(RuntimeError):
            masters[0].add_(1.0)  # and a write raises
    else:  # fp32 masters and optimizer state on the host, the rows on disk
        assert stats["masters"] > 0 and stats["tier_disk"] == stats["param_shards"]
    paths = list(files)
    zs.destroy(model)
    assert not any(os.path.exists(p) for p in paths)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), _weights(ref_model).values()))


def test_writes_reach_the_files(tmp_path) -> None:
    model, opt = _setup(tmp_path, "nvme")
    _train(model, opt, steps=1)
    with zs.gathered_parameters(model, modifier_rank=0), torch.no_grad():
        model.blocks[1][0].weight.fill_(0.25)
    assert torch.all(_weights(model)["blocks.1.0.weight"] == 0.25)
    full = {k: torch.full_like(v, 0.5) for k, v in _weights(model).items()}
    zs.load_full_state_dict(model, full)
    got = _weights(model)
    assert all(torch.all(v == 0.5) for v in got.values()), {k: v.flatten()[:3] for k, v in got.items()}
    _train(model, opt, steps=1)  # the optimizer steps from the loaded masters
    after = _weights(model)["blocks.0.0.weight"]
    assert not torch.all(after == 0.5) and torch.isfinite(after).all()


def test_a_damaged_row_file_is_named(tmp_path) -> None:
    model, opt = _setup(tmp_path, "cpu")
    f = model.zero_engine.disk.row_swap.files[1]
    os.truncate(f.path, f.nbytes // 2)
    with pytest.raises(RuntimeError, match=rf"swap file {f.path} has \d+ bytes, expected {f.nbytes}"):
        _train(model, opt, steps=1)
