"""Top-k selection with error feedback, its config, and what it refuses (one process)."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.config.comm import CompressionConfig
from zero_strategy.reduction.compression import index_dtype, select_top_k
from zero_strategy.testing.compare import assert_close


def test_sent_plus_residual_is_the_compensated_gradient() -> None:
    torch.manual_seed(0)
    residual = torch.randn(3, 50) * 0.1
    packed = torch.randn(3, 50)
    compensated = residual + 0.5 * packed
    idx, values = select_top_k(residual, packed, 0.5, k=4, skip=[(10, 20)], wire_dtype=torch.float32)
    assert idx.shape == values.shape == (3, 4) and idx.dtype == torch.int32
    sent = torch.zeros(3, 50).scatter_(1, idx.long(), values)
    assert_close(sent + residual, compensated, rtol=0.0, atol=0.0, what="sent + residual")
    for row in range(3):
        chosen = set(idx[row].tolist())
        assert not chosen & set(range(10, 20)), "a skipped column was sent"
        others = [j for j in range(50) if j not in chosen and not 10 <= j < 20]
        assert compensated[row, idx[row].long()].abs().min() >= compensated[row, others].abs().max()
        assert residual[row, idx[row].long()].abs().max() == 0  # fp32 wire: nothing left of what was sent
    assert_close(residual[:, 10:20], compensated[:, 10:20], rtol=0.0, atol=0.0, what="skipped columns kept")


def test_rounding_on_the_wire_stays_in_the_residual() -> None:
    torch.manual_seed(1)
    residual = torch.zeros(2, 64)
    packed = torch.randn(2, 64)
    idx, values = select_top_k(residual, packed, 1.0, k=8, skip=[], wire_dtype=torch.bfloat16)
    assert values.dtype == torch.bfloat16
    sent = torch.zeros(2, 64).scatter_(1, idx.long(), values.float())
    assert_close(sent + residual, packed, rtol=0.0, atol=0.0, what="bf16 sent + residual")
    assert residual.abs().sum() > 0  # bf16 rounded the sent values; the difference carries forward


def test_nan_and_inf_are_sent_first() -> None:
    """A NaN or inf must reach the receiver (its overflow check), never stay hidden in a residual."""
    residual = torch.zeros(1, 6)
    packed = torch.tensor([[1.0, float("nan"), float("inf"), 2.0, 0.5, 3.0]])
    idx, values = select_top_k(residual, packed, 1.0, k=2, skip=[], wire_dtype=torch.float32)
    assert sorted(idx[0].tolist()) == [1, 2], idx
    assert torch.isnan(values).any() and torch.isinf(values).any(), values
    assert torch.equal(residual[0, [0, 3, 4, 5]], packed[0, [0, 3, 4, 5]])


def test_a_scaled_16bit_wire_keeps_small_values() -> None:
    """fp16 on the wire at the loss-scaled magnitude: values far below fp16's normal range
    (unscaled) arrive, and sent / scale + residual is still the compensated gradient."""
    residual = torch.zeros(1, 8)
    packed = torch.full((1, 8), 1e-9) * torch.arange(1, 9)
    idx, wire = select_top_k(residual, packed, 1.0, k=3, skip=[], wire_dtype=torch.float16, wire_scale=2.0**16)
    assert (wire != 0).all(), wire  # unscaled, 1e-9 would be 0 in fp16
    sent = torch.zeros(1, 8).scatter_(1, idx.long(), wire.float() / 2.0**16)
    assert_close(sent + residual, packed, rtol=0.0, atol=0.0, what="scaled fp16 sent + residual")


def test_indices_widen_past_int32() -> None:
    """A row's column indices travel as int32 while its last index fits, as int64 past that (a
    bucket row of more than 2**31 elements would wrap)."""
    assert index_dtype(1) == index_dtype(2**31) == torch.int32
    assert index_dtype(2**31 + 1) == index_dtype(2**40) == torch.int64
    residual = torch.zeros(2, 16)
    idx, _ = select_top_k(residual, torch.randn(2, 16), 1.0, k=3, skip=[], wire_dtype=torch.float32,
                          index=torch.int64)  # fmt: skip
    assert idx.dtype == torch.int64


def test_a_16bit_wire_saturates_instead_of_overflowing() -> None:
    """A finite value beyond fp16's range (a residual held back for long) is sent as fp16's
    largest value, its excess kept in the residual; an inf is still sent as inf."""
    residual = torch.tensor([[1e6, 1.0, 0.0, 0.0], [float("inf"), 0.0, 0.0, 0.0]])
    packed = torch.zeros(2, 4)
    idx, wire = select_top_k(residual, packed, 1.0, k=1, skip=[], wire_dtype=torch.float16)
    top = float(torch.finfo(torch.float16).max)
    assert float(wire[0, 0]) == top and torch.isinf(wire[1, 0]), wire
    assert_close(residual[0], torch.tensor([1e6 - top, 1.0, 0.0, 0.0]), rtol=0.0, atol=0.0, what="excess kept")


def test_all_skipped_sends_zeros_and_keeps_everything() -> None:
    residual = torch.ones(2, 6)
    packed = torch.ones(2, 6)
    idx, values = select_top_k(residual, packed, 1.0, k=3, skip=[(0, 6)], wire_dtype=torch.float32)
    assert values.abs().sum() == 0 and bool((residual == 2).all()), (values, residual)


def test_config_reads_deepspeed_block_and_names_bad_values() -> None:
    cfg = zs.ZeroConfig.from_dict(
        {"zero_optimization": {"stage": 2}, "zero_strategy": {"compression": {"type": "topk", "ratio": "1e-3"}}}
    )
    assert cfg.compression == CompressionConfig(type="topk", ratio=0.001, warmup_steps=0)
    assert zs.ZeroConfig(compression="topk").compression.enabled
    assert zs.ZeroConfig.from_dict(cfg.to_dict()).compression == cfg.compression
    with pytest.raises(ValueError, match="compression.ratio"):
        zs.ZeroConfig(compression={"type": "topk", "ratio": 0})
    with pytest.raises(ValueError, match="compression.type"):
        zs.ZeroConfig(compression={"type": "randk"})
    with pytest.raises(ValueError, match="warmup_steps"):
        zs.ZeroConfig(compression={"type": "topk", "warmup_steps": -1})


def test_stage3_refuses_topk_before_changing_the_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="stages 1 and 2"):
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={
            "zero_optimization": {"stage": 3}, "zero_strategy": {"compression": {"type": "topk"}}})  # fmt: skip
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # still real, full tensors: nothing was sharded
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 2})
    assert model.zero_engine.reducer.compression is None  # and the model can still be initialized


def test_world_size_one_runs_compressed() -> None:
    """A smoke test: with one rank the exchange is local; half the gradient goes each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               config={"stage": 2, "compression": {"type": "topk", "ratio": 0.5}})  # fmt: skip
    zs.reset_comm_stats()
    losses = []
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    stats = zs.comm_stats()
    assert stats["all_to_all"]["calls"] >= 5 and "reduce_scatter" not in stats, stats
    residual = model.zero_engine.memory_stats()["residuals"]
    assert residual >= 4 * sum(p.numel() for p in model.parameters()), residual
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    model.zero_engine.close()


def test_exponential_warmup_follows_dgc_schedule() -> None:
    """DGC's sparsity warm-up at ratio 0.001 over 40 steps: 25%, 6.25%, 1.5625%, 0.39% (10 steps
    each), then 0.1%; ``warmup: dense`` keeps the old switch (dense steps, then the ratio)."""
    cfg = CompressionConfig(type="topk", ratio=0.001, warmup_steps=40)
    got = [cfg.ratio_at(s) for s in range(45)]
    want = [0.25] * 10 + [0.0625] * 10 + [0.015625] * 10 + [0.00390625] * 10 + [0.001] * 5
    assert got == want, got
    assert not any(cfg.dense_at(s) for s in range(45))
    assert [CompressionConfig(type="topk", ratio=0.01, warmup_steps=6).ratio_at(s) for s in range(7)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01]  # fmt: skip
    assert CompressionConfig(type="topk", ratio=1.0, warmup_steps=5).ratio_at(0) == 1.0  # DDP's numbers
    assert CompressionConfig(type="topk", ratio=0.3, warmup_steps=5).ratio_at(0) == 0.3  # nothing above to ramp
    dense = CompressionConfig(type="topk", ratio=0.001, warmup_steps=3, warmup="dense")
    assert [dense.dense_at(s) for s in range(5)] == [True, True, True, False, False]
    assert dense.ratio_at(0) == 0.001


def test_momentum_correction_accumulates_velocity_and_masks_what_was_sent() -> None:
    """DGC: u = m u + f g outside skipped columns, the residual gains u (not g), sent + residual
    = residual before + u; masking zeroes the velocity of every sent entry, and only those."""
    torch.manual_seed(2)
    for masking in (False, True):
        residual, velocity, packed = torch.randn(2, 40) * 0.1, torch.randn(2, 40), torch.randn(2, 40)
        r0, v0 = residual.clone(), velocity.clone()
        u = 0.9 * v0 + 0.5 * packed
        u[:, 5:9] = v0[:, 5:9]  # a parameter without a gradient keeps its velocity
        idx, values = select_top_k(residual, packed, 0.5, k=3, skip=[(5, 9)], wire_dtype=torch.float32,
                                   velocity=velocity, momentum=0.9, masking=masking)  # fmt: skip
        sent = torch.zeros(2, 40).scatter_(1, idx.long(), values)
        compensated = r0 + u
        compensated[:, 5:9] = r0[:, 5:9]
        assert_close(sent + residual, compensated, rtol=1e-6, atol=1e-7, what=f"sent + residual (masking {masking})")
        was_sent = torch.zeros(2, 40, dtype=torch.bool).scatter_(1, idx.long(), True)
        want_velocity = torch.where(was_sent, torch.zeros(()), u) if masking else u
        assert_close(velocity, want_velocity, rtol=1e-6, atol=1e-7, what=f"velocity (masking {masking})")


def test_momentum_config_refusals() -> None:
    with pytest.raises(ValueError, match="warmup: exponential"):
        CompressionConfig(type="topk", momentum=0.9, warmup_steps=5, warmup="dense")
    with pytest.raises(ValueError, match="compression.momentum"):
        zs.ZeroConfig(compression={"type": "topk", "momentum": 1.5})
    with pytest.raises(ValueError, match="compression.local_clip"):
        zs.ZeroConfig(compression={"type": "topk", "local_clip": 0})
    with pytest.raises(ValueError, match="compression.warmup"):
        zs.ZeroConfig(compression={"type": "topk", "warmup": "linear"})
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="momentum=0"):
        zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      config={"stage": 2, "compression": {"type": "topk", "momentum": 0.9}})  # fmt: skip


def test_adam_mode_refusals() -> None:
    """The frozen-variance Adam mode learns the variance in dense steps and owns the moments."""
    with pytest.raises(ValueError, match="warmup: dense and warmup_steps >= 1"):
        CompressionConfig(type="topk", optimizer="adam", warmup_steps=10)  # the exponential ramp
    with pytest.raises(ValueError, match="momentum: 0"):
        CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=10, momentum=0.9)
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        CompressionConfig(type="topk", optimizer="adam", warmup="dense")
    with pytest.raises(ValueError, match="compression.optimizer"):
        zs.ZeroConfig(compression={"type": "topk", "optimizer": "lamb"})
    cfg = {"zero_optimization": {"stage": 2}, "zero_strategy": {"compression": {
        "type": "topk", "optimizer": "adam", "warmup": "dense", "warmup_steps": 2}}}  # fmt: skip
    with pytest.raises(ValueError, match="build torch.optim.SGD"):
        zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.AdamW(p, lr=1e-3), config=cfg)
    with pytest.raises(ValueError, match="momentum=0"):
        zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), config=cfg)
    nvme = {**cfg, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(ValueError, match="offload the optimizer to 'cpu'"):
        zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=1e-3), config=nvme)


def test_region_indices_choose_per_region_and_send_int16_offsets() -> None:
    """``region_indices``: the k largest of each region (the last one shorter), int16 offsets
    that :func:`region_offsets` turns back into columns; sent + residual = compensated."""
    from zero_strategy.reduction.compression import region_counts, region_offsets

    torch.manual_seed(0)
    residual = torch.randn(2, 230) * 0.1
    packed = torch.randn(2, 230)
    compensated = residual + packed
    idx, values = select_top_k(residual, packed, 1.0, k=5, skip=[(0, 3)], wire_dtype=torch.float32,
                               index=torch.int16, region=100)  # fmt: skip
    assert region_counts(230, 100, 5) == [(100, 5), (100, 5), (30, 2)]  # the last region: its share
    assert idx.dtype == torch.int16 and idx.shape == values.shape == (2, 12)
    assert int(idx.min()) >= 0 and int(idx.max()) < 100
    cols = idx.long() + region_offsets(230, 100, 5, idx.device)
    sent = torch.zeros(2, 230).scatter_(1, cols, values)
    assert_close(sent + residual, compensated, rtol=0.0, atol=0.0, what="sent + residual")
    for row in range(2):
        for lo, hi, first, count in [(0, 100, 0, 5), (100, 200, 5, 5), (200, 230, 10, 2)]:
            mine = cols[row, first : first + count]
            assert bool(((mine >= lo) & (mine < hi)).all()), f"region {lo}-{hi}: columns {mine.tolist()}"
            free = [j for j in range(max(lo, 3), hi) if j not in set(mine.tolist())]
            chosen = [j for j in mine.tolist() if j >= 3]
            assert compensated[row, chosen].abs().min() >= compensated[row, free].abs().max()
    assert region_counts(60, 100, 80) == [(60, 48)]  # one short region: its share
    assert region_counts(260, 100, 100) == [(100, 100), (100, 100), (60, 60)]  # ratio 1.0: everything


def test_adam_variance_refresh_schedule() -> None:
    """``variance_refresh: N``: after the dense warm-up, N compressed steps, one dense refresh step,
    2N compressed steps, one refresh, 4N, ... (0/1 Adam's doubling intervals)."""
    cfg = CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=3, variance_refresh=2)
    dense = [s for s in range(40) if cfg.dense_at(s)]
    assert dense == [0, 1, 2, 5, 10, 19, 36]
    assert [cfg.refresh_at(s) for s in (0, 2, 5, 10, 11, 19)] == [False, False, True, True, False, True]
    off = CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=3)
    assert [s for s in range(40) if off.dense_at(s)] == [0, 1, 2]
    with pytest.raises(ValueError, match="variance_refresh"):
        CompressionConfig(type="topk", ratio=0.01, variance_refresh=4)  # the SGD mode has no variance


def test_adam_precondition_floor_caps_the_normalised_update() -> None:
    """``precondition_floor: f``: the frozen ``sqrt(v_hat)`` is floored at ``f`` times the median of
    its nonzero entries, so an element whose variance was tiny at the freeze gets at most
    ``1 / (f * median)``; a zero variance still gets 0; ``f = 0`` is the unfloored mode."""
    from zero_strategy.runtime.compressed_adam import _scale

    root = torch.tensor([0.0, 1e-6, 1.0, 2.0, 4.0])  # sqrt(v_hat); median of the nonzero: 1.0
    state = {"exp_avg_sq": root**2 * (1 - 0.999), "variance_step": torch.tensor(1.0)}
    assert_close(_scale(state, 0.999, 1e-8), torch.where(root > 0, 1 / (root + 1e-8), torch.tensor(0.0)),
                 rtol=1e-5, what="unfloored")  # fmt: skip
    floored = _scale(state, 0.999, 1e-8, 0.5)
    assert_close(floored, torch.tensor([0.0, 1 / (0.5 + 1e-8), 1 / (1 + 1e-8), 1 / (2 + 1e-8), 1 / (4 + 1e-8)]),
                 rtol=1e-5, what="floored")  # fmt: skip
    cfg = CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=3, precondition_floor=0.1)
    assert cfg.precondition_floor == 0.1
    with pytest.raises(ValueError, match="precondition_floor"):
        CompressionConfig(type="topk", ratio=0.01, precondition_floor=0.1)  # the SGD mode has no variance


def test_global_threshold_chooses_over_the_whole_bucket() -> None:
    """``global_threshold``: the bucket seen as one row, its ``world * k`` largest entries chosen
    wherever they fall, then grouped by destination (uneven counts); the per-row choice takes
    ``k`` from each row. The config reads it, and refuses it without top-k or with regions."""
    from zero_strategy.reduction.compression import by_destination

    packed = torch.zeros(2, 10)
    packed[0] = torch.arange(10.0) + 100.0  # every large entry is in destination 0's row
    packed[1] = torch.arange(10.0)
    skip = [(8, 10)]  # columns without a gradient, in every row
    flat_skip = [(j * 10 + lo, j * 10 + hi) for j in range(2) for lo, hi in skip]
    residual = torch.zeros(1, 20)
    idx, values = select_top_k(residual, packed.view(1, -1), 1.0, 6, flat_skip, torch.float32, index=torch.int64)
    columns, sent, counts = by_destination(idx[0], values[0], 10, 2, torch.int32)
    assert counts.tolist() == [6, 0] and columns.dtype == torch.int32
    assert columns.tolist() == [2, 3, 4, 5, 6, 7] and sent.tolist() == [102.0, 103.0, 104.0, 105.0, 106.0, 107.0]
    assert_close(residual.view(2, 10)[0, :2], packed[0, :2], rtol=0.0, atol=0.0, what="unsent stays")
    per_row, _ = select_top_k(torch.zeros(2, 10), packed, 1.0, 3, skip, torch.float32)
    assert per_row.shape == (2, 3)  # k from each row, the small ones of row 1 too
    mixed = torch.tensor([3, 15, 1, 12])
    columns, sent, counts = by_destination(mixed, torch.tensor([1.0, 2.0, 3.0, 4.0]), 10, 2, torch.int32)
    assert counts.tolist() == [2, 2] and columns.tolist() == [1, 3, 2, 5] and sent.tolist() == [3.0, 1.0, 4.0, 2.0]

    cfg = zs.ZeroConfig.from_dict(
        {
            "zero_optimization": {"stage": 2},
            "zero_strategy": {"compression": {"type": "topk", "global_threshold": True}},
        }
    )
    assert cfg.compression.global_threshold
    with pytest.raises(ValueError, match="global_threshold.*type: topk"):
        CompressionConfig(global_threshold=True)
    with pytest.raises(ValueError, match="global_threshold.*region_indices"):
        CompressionConfig(type="topk", global_threshold=True, region_indices=True)


def test_owner_momentum_keeps_adams_momentum_of_what_was_received() -> None:
    """``owner_momentum``: after the dense warm-up the owner's ``update_avg = beta1 * update_avg +
    received`` and the direction is ``(exp_avg * P + update_avg) / (1 - beta1**t)``; the ranks
    keep no velocity (decay 0). Refused outside the Adam mode and with ``variance_refresh``."""
    from types import SimpleNamespace

    from zero_strategy.runtime.compressed_adam import _scale, adam_direction

    cfg = CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=1, owner_momentum=True)
    assert cfg.decay == 0.0 and CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=1).decay
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    fb = SimpleNamespace(config=cfg, preconditioners={})
    b1 = cfg.beta1
    p.grad = torch.tensor([1.0, -2.0, 0.5, 3.0])
    adam_direction(fb, opt, 0)  # dense: AdamW's step
    state = opt.state[p]
    m0, scale = state["exp_avg"].clone(), _scale(state, cfg.beta2, cfg.eps)
    r1, r2 = torch.tensor([0.1, 0.0, -0.2, 0.0]), torch.tensor([0.0, 0.3, 0.1, 0.0])
    p.grad = r1.clone()
    adam_direction(fb, opt, 1)
    assert_close(p.grad, (b1 * m0 * scale + r1) / (1 - b1**2), rtol=1e-6, what="first compressed step")
    p.grad = r2.clone()
    adam_direction(fb, opt, 2)
    assert_close(state["update_avg"], b1 * r1 + r2, rtol=1e-6, what="the owner's momentum")
    assert_close(p.grad, (b1**2 * m0 * scale + b1 * r1 + r2) / (1 - b1**3), rtol=1e-5, what="second step")
    with pytest.raises(ValueError, match="owner_momentum.*optimizer: adam"):
        CompressionConfig(type="topk", owner_momentum=True)
    with pytest.raises(ValueError, match="owner_momentum.*variance_refresh"):
        CompressionConfig(type="topk", optimizer="adam", warmup="dense", warmup_steps=1, owner_momentum=True,
                          variance_refresh=4)  # fmt: skip


def test_adam_precondition_floor_median_once_per_freeze(monkeypatch) -> None:
    """The floor's median is taken once while the variance is frozen (not on every compressed
    step), and again after the variance changes in place (a dense step, a load) or its step."""
    from zero_strategy.runtime.compressed_adam import _scale

    calls = []
    median = torch.Tensor.median

    def counted(self, *args, **kwargs):
        calls.append(1)
        return median(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "median", counted)
    root = torch.tensor([0.0, 1e-6, 1.0, 2.0, 4.0])
    state = {"exp_avg_sq": root**2 * (1 - 0.999), "variance_step": torch.tensor(1.0)}
    first = _scale(state, 0.999, 1e-8, 0.5)
    for _ in range(3):  # compressed steps: the same frozen variance
        assert torch.equal(_scale(state, 0.999, 1e-8, 0.5), first)
    assert len(calls) == 1
    state["exp_avg_sq"].mul_(4.0)  # in place, as a dense step: sqrt(v_hat) doubles, so does the median
    assert_close(_scale(state, 0.999, 1e-8, 0.5)[1], torch.tensor(1 / (1.0 + 1e-8)), rtol=1e-5, what="new median")
    assert len(calls) == 2
    state["variance_step"] = torch.tensor(2.0)  # another correction: taken again
    _scale(state, 0.999, 1e-8, 0.5)
    assert len(calls) == 3
