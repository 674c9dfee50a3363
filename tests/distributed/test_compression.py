"""Top-k gradient compression with error feedback (``compression.py``), world size 2.

- ratio 1.0 sends every element through the sparse exchange: DDP's numbers (parity cells);
- ratio < 1: what each rank sent plus its new residual is its dense compensated gradient, the
  sent entries are each row's largest, every rank's gradient shard is the average of what all
  ranks sent to it, and the bytes are ``world * k * 8`` per bucket (no reduce-scatter);
- ``warmup: dense``: ``warmup_steps`` dense steps first, equal to an uncompressed run;
  ``warmup: exponential`` (default): compressed from step 0 at 25%, 6.25%, ... then the ratio;
- DGC's momentum correction (``momentum``): ratio 1.0 is DDP's SGD with that momentum
  (masking: without it), sent + residual = residual + new velocity, masking zeroes the
  velocity of what was sent, velocities survive a checkpoint;
- checkpoints: a resumed run continues exactly; under other buckets and another load-balance
  split the residuals follow their elements; at another world size they start from zero;
- fp16: an overflow on one rank skips the step and clears every rank's residuals; a 16-bit wire
  carries DDP's magnitude, and values held back for many steps do not overflow it;
- int64 indices for rows longer than int32 reaches.
"""

from __future__ import annotations

import math
import warnings

from zero_strategy.testing import run_subtests

PARITY = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 2, "dtype": "float32", "clip": 0.05},
    {"stage": 1, "accum": "no_sync", "unused": "some_ranks"},
    {"stage": 2, "accum": "plain", "tied": True, "frozen": True},
    {"stage": 2, "unused": "some_steps", "late": True, "ckpt": "reentrant"},
    {"stage": 2, "impl": "native", "overlap": False},
    {"stage": 2, "offload": "cpu", "clip": 0.05},
]


def _gpt():
    import torch

    from zero_strategy.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4))


def _batch(step: int, rank: int):
    from zero_strategy.models import GPTConfig, synthetic_batch

    return synthetic_batch(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4), 4, step, seed=rank)


# DGC's momentum correction at ratio 1.0: DDP's SGD with momentum 0.9 (masking: without momentum)
PARITY_DGC = [
    {"stage": 2, "optim": "sgd", "topk_momentum": 0.9},
    {"stage": 1, "optim": "sgd", "topk_momentum": 0.9, "topk_masking": True},
    {"stage": 2, "optim": "sgd", "topk_momentum": 0.9, "accum": "plain"},
    {"stage": 2, "optim": "sgd", "topk_momentum": 0.9, "accum": "no_sync", "topk_masking": True},
]


def _config(stage: int, ratio: float, warmup: int = 0, bucket: int = 3000, ramp: str = "exponential", **extra) -> dict:
    block = {"type": "topk", "ratio": ratio, "warmup_steps": warmup, "warmup": ramp, **extra}
    return {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
        "zero_strategy": {"compression": block},
    }


def _step(model, opt, step: int, rank: int, *, quiet: bool = False) -> float:
    import contextlib

    import torch.nn.functional as F

    x, y = _batch(step, rank)
    with model.no_sync() if quiet else contextlib.nullcontext():
        loss = F.cross_entropy(model(x).view(-1, 64), y.reshape(-1))
        loss.backward()
    return float(loss.detach())


def _feedback(rank: int, world: int, stage: int, wide: bool = False, ramp: bool = False, momentum: float = 0.0) -> None:
    """One compressed step, checked piece by piece against the dense gradients it came from.
    ``wide``: every row taken as longer than int32 indices reach, so the pairs carry int64 ones.
    ``ramp``: the step is inside the exponential warm-up (25% sent); ``momentum``: DGC's
    momentum correction, the compensated gradient is the residual plus the new velocity."""
    from zero_strategy.reduction import compression

    if wide:
        compression._INT32_MAX = 0  # restored below
    try:
        _feedback_step(rank, world, stage, 8 if wide else 4, ramp, momentum)
    finally:
        compression._INT32_MAX = 2**31 - 1


def _feedback_step(rank: int, world: int, stage: int, index_bytes: int, ramp: bool, momentum: float) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    ratio = 0.05
    config = _config(stage, ratio, warmup=8 if ramp else 0, momentum=momentum)
    optim = (lambda p: torch.optim.SGD(p, lr=0.05)) if momentum else (lambda p: torch.optim.AdamW(p, lr=1e-3))
    model, opt = zs.initialize(_gpt(), optim, config=config)
    engine = model.zero_engine
    fb = engine.reducer.compression
    if fb.ratio() != (0.25 if ramp else ratio):
        raise AssertionError(f"ratio {fb.ratio()} at step 0 (ramp {ramp})")
    for step in range(3):
        _step(model, opt, step, rank)
        opt.step()
        opt.zero_grad()
    # the step under test: gradients kept local (no_sync) so they can be read before the reduction
    _step(model, opt, 3, rank, quiet=True)
    dense = {id(p): p.grad.detach().clone() for g in engine.groups for p in g.params if p.grad is not None}
    before = {i: r.clone() for i, r in fb.residuals.items()}
    velocity = {i: v.clone() for i, v in fb.velocities.items()}
    if bool(velocity) != bool(momentum) or (momentum and not all(v.abs().sum() > 0 for v in velocity.values())):
        raise AssertionError(f"velocities {sorted(velocity)} with momentum {momentum}")
    if ramp and fb.ratio() != 0.25:
        raise AssertionError(f"step 3 of an 8-step ramp at ratio 0.05 sends {fb.ratio()}, not 0.25")
    zs.reset_comm_stats()
    engine.finalize_grads()  # the reduction, as optimizer.step() starts it
    stats = zs.comm_stats()
    n, expected_bytes = world, 0
    for g in engine.groups:
        lay, k = g.layout, fb.k(g)
        expected_bytes += n * k * (index_bytes + 4)
        packed = torch.zeros(n * lay.shard_numel, dtype=g.master_dtype)
        lay.pack_full([dense.get(id(p)) for p in g.params], packed)
        if momentum:  # DGC's momentum correction: the velocity goes into the residual
            u = momentum * velocity[g.index] + packed.view(n, -1) / world
            compensated = before[g.index] + u
        else:
            compensated = before[g.index] + packed.view(n, -1) / world
        after = fb.residuals[g.index]
        # the residual is the compensated gradient except at the (at most k per row) entries sent,
        # which are gone from it; what left is the difference
        where = after != compensated
        if not (where.sum(dim=1) <= k).all():
            raise AssertionError(f"{g.name}: more than k={k} entries left a row: {where.sum(dim=1).tolist()}")
        if not where.any():
            raise AssertionError(f"{g.name}: nothing was sent")
        if torch.count_nonzero(after[where]) != 0:
            raise AssertionError(f"{g.name}: a sent entry stayed in the residual")
        if momentum:  # momentum factor masking: a sent entry's velocity restarts, the others keep theirs
            want_u = torch.where(where, torch.zeros_like(u), u)
            assert_close(fb.velocities[g.index], want_u, rtol=1e-6, atol=1e-9, what=f"{g.name}: velocity")
        sent = torch.where(where, compensated, torch.zeros_like(compensated))
        for row in range(n):  # the row's largest entries were the ones sent
            kept = after[row].abs().max()
            if where[row].any() and not sent[row][where[row]].abs().min() >= kept:
                raise AssertionError(f"{g.name} row {row}: an unsent entry {kept} beats a sent one")
        total = sent.clone()
        dist.all_reduce(total)  # what every rank sent, summed: this rank's row is its shard
        assert_close(g.grad_shard, total[rank], rtol=1e-6, atol=1e-9, what=f"{g.name}: gradient shard")
    if stats.get("reduce_scatter", {}).get("calls", 0):
        raise AssertionError(f"a compressed step reduce-scattered: {stats}")
    got = stats["all_to_all"]["bytes"]
    if got != expected_bytes:
        raise AssertionError(f"all_to_all moved {got} bytes, expected {expected_bytes}")
    dense_bytes = sum(n * g.layout.shard_numel * 4 for g in engine.groups)
    if not got <= ((index_bytes + 4) / 4 * fb.ratio() + 0.01) * dense_bytes:
        raise AssertionError(f"{got} bytes against {dense_bytes} dense at ratio {fb.ratio()}")
    mem = engine.memory_stats()
    psi = sum(p.numel() for p in model.parameters())
    per = 8 if momentum else 4  # the velocities count with the residuals: as much again
    if not psi * per <= mem["residuals"] <= psi * per * 1.1:
        raise AssertionError(f"residuals take {mem['residuals']} bytes; {per} psi = {per * psi}")
    opt.step()
    opt.zero_grad()
    engine.close()


def _warmup(rank: int, world: int, stage: int) -> None:
    import torch

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    runs = {}
    for name, cfg in (("dense", {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}),
                      ("topk", _config(stage, 0.01, warmup=2, ramp="dense"))):  # fmt: skip
        model, opt = zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=cfg)
        losses, kinds = [], []
        for step in range(4):
            zs.reset_comm_stats()
            losses.append(_step(model, opt, step, rank))
            opt.step()
            opt.zero_grad()
            kinds.append(sorted(k for k in zs.comm_stats() if k in ("reduce_scatter", "all_to_all")))
        runs[name] = (losses, kinds)
        model.zero_engine.close()
    (dense, dense_kinds), (topk, topk_kinds) = runs["dense"], runs["topk"]
    # steps 0, 1 dense; the loss of step 2 is computed after two dense updates
    assert_close(topk[:3], dense[:3], rtol=0.0, atol=0.0, what="losses through the warm-up")
    if topk_kinds != [["reduce_scatter"]] * 2 + [["all_to_all"]] * 2 or dense_kinds != [["reduce_scatter"]] * 4:
        raise AssertionError(f"collectives per step: {topk_kinds} (dense {dense_kinds})")
    if not all(math.isfinite(v) for v in topk) or topk[3] == dense[3]:
        raise AssertionError(f"compressed steps: {topk} against dense {dense}")


def _ramp(rank: int, world: int) -> None:
    """``warmup: exponential`` (the default): compressed from the first step, at 25% then 6.25%
    of every row, then the ratio (0.01 over a 2-step warm-up: 3 stretches, the third after it)."""
    import torch

    import zero_strategy as zs

    model, opt = zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-3), config=_config(2, 0.01, warmup=2))
    groups, got, losses = model.zero_engine.groups, [], []
    for step in range(4):
        zs.reset_comm_stats()
        losses.append(_step(model, opt, step, rank))
        opt.step()
        opt.zero_grad()
        stats = zs.comm_stats()
        if "reduce_scatter" in stats:
            raise AssertionError(f"step {step} of the exponential warm-up reduced densely: {stats}")
        got.append(stats["all_to_all"]["bytes"])
    want = [sum(world * math.ceil(r * g.layout.shard_numel) * 8 for g in groups) for r in (0.25, 0.0625, 0.01, 0.01)]
    if got != want:
        raise AssertionError(f"bytes per step {got}, expected {want} (25%, 6.25%, 1%, 1% of every row)")
    if not all(math.isfinite(v) for v in losses):
        raise AssertionError(f"losses {losses}")
    model.zero_engine.close()


def _local_clip(rank: int, world: int, stage: int, accum: bool) -> None:
    """DGC's local clipping at ratio 1.0 against a hand-written oracle: each rank scales its share
    of the averaged gradient (g / world, the whole model) to a norm of at most clip / sqrt(world),
    the shares are all-reduced, SGD steps. ``accum``: two no_sync micro-steps, clipped together."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    clip = 0.05
    model, opt = zs.initialize(
        _gpt(), lambda p: torch.optim.SGD(p, lr=0.5), config=_config(stage, 1.0, local_clip=clip)
    )
    ref = _gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    fb, bit, got, want = model.zero_engine.reducer.compression, 0, [], []
    for step in range(3):
        for micro in range(2 if accum else 1):
            got.append(_step(model, opt, 10 * step + micro, rank, quiet=accum and micro == 0))
            want.append(_step(ref, ref_opt, 10 * step + micro, rank))
        opt.step()
        opt.zero_grad()
        shares = [p.grad / world for p in ref.parameters()]
        norm = float(torch.sqrt(sum(s.pow(2).sum() for s in shares)))
        limit = clip / math.sqrt(world)
        bit += norm > limit
        coef = limit / (norm + 1e-6) if norm > limit else 1.0
        flat = torch.cat([s.reshape(-1) * coef for s in shares])
        dist.all_reduce(flat)
        for p, piece in zip(ref.parameters(), flat.split([p.numel() for p in ref.parameters()])):
            p.grad = piece.view_as(p).clone()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(fb.last_local_norm, norm, rtol=1e-5, atol=0.0, what=f"step {step}: the local norm")
    if not bit:
        raise AssertionError("the local clip never bit: the test would not see it missing")
    assert_close(got, want, rtol=1e-5, atol=0.0, what=f"rank {rank}: losses under local clipping")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, what=f"rank {rank}: {name}")
    model.zero_engine.close()


def _checkpoint_momentum(rank: int, world: int, root: str) -> None:
    """DGC's velocities are saved with the residuals: a resumed run continues exactly; at another
    world size both start from zero with a warning."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    cfg = _config(2, 0.02, warmup=2, momentum=0.9)

    def run(**kw):
        return zs.initialize(_gpt(), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg, **kw)

    model, opt = run()
    for step in range(3):
        _step(model, opt, step, rank)
        opt.step()
        opt.zero_grad()
    path = zs.save_checkpoint(root, model, opt, tag="momentum")
    fb = model.zero_engine.reducer.compression
    saved = {i: v.clone() for i, v in fb.velocities.items()}
    if not saved or not all(int(torch.count_nonzero(v)) > 0 for v in saved.values()):
        raise AssertionError("no velocity to save: the test would not see it lost")
    uninterrupted = []
    for step in range(3, 6):
        uninterrupted.append(_step(model, opt, step, rank))
        opt.step()
        opt.zero_grad()
    model.zero_engine.close()
    model, opt = run()
    zs.load_checkpoint(path, model, opt)
    loaded = model.zero_engine.reducer.compression.velocities
    if loaded.keys() != saved.keys():
        raise AssertionError(f"velocities of buckets {sorted(loaded)} loaded, {sorted(saved)} saved")
    for i, v in loaded.items():
        assert_close(v, saved[i], rtol=0.0, atol=0.0, what=f"rank {rank}: velocity of bucket {i}")
    resumed = []
    for step in range(3, 6):
        resumed.append(_step(model, opt, step, rank))
        opt.step()
        opt.zero_grad()
    assert_close(resumed, uninterrupted, rtol=0.0, atol=0.0, what=f"rank {rank}: losses after resuming")
    model.zero_engine.close()
    alone = [dist.new_group([r]) for r in range(world)][rank]
    model, opt = run(process_group=alone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.load_checkpoint(path, model, opt)
    if not any("start from zero" in str(w.message) for w in caught):
        raise AssertionError(f"no warning about the residuals: {[str(w.message) for w in caught]}")
    if any(int(torch.count_nonzero(t)) for t in model.zero_engine.reducer.compression.tensors()):
        raise AssertionError("residuals or velocities of another world size were loaded")
    model.zero_engine.close()


def _checkpoint(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close
    from zero_strategy.testing.parity import load_residuals_in_place, residuals_by_parameter

    def run(cfg: dict):
        return zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-2), config=cfg)

    model, opt = run(_config(2, 0.02))
    for step in range(3):
        _step(model, opt, step, rank)
        opt.step()
        opt.zero_grad()
    path = zs.save_checkpoint(root, model, opt, tag="resume")
    saved = {i: r.clone() for i, r in model.zero_engine.reducer.compression.residuals.items()}
    want, _ = residuals_by_parameter(model)
    if not saved or not all(int(torch.count_nonzero(r)) > 0 for r in saved.values()):
        raise AssertionError("no residual to save: the test would not see it lost")
    uninterrupted = []
    for step in range(3, 6):
        uninterrupted.append(_step(model, opt, step, rank))
        opt.step()
        opt.zero_grad()
    model.zero_engine.close()
    # the same layout at stage 1: every residual comes back, and training continues exactly
    model, opt = run(_config(1, 0.02))
    zs.load_checkpoint(path, model, opt)
    loaded = model.zero_engine.reducer.compression.residuals
    if loaded.keys() != saved.keys():
        raise AssertionError(f"residuals of buckets {sorted(loaded)} loaded, {sorted(saved)} saved")
    for i, r in loaded.items():
        assert_close(r, saved[i], rtol=0.0, atol=0.0, what=f"rank {rank}: residual of bucket {i}")
    resumed = []
    for step in range(3, 6):
        resumed.append(_step(model, opt, step, rank))
        opt.step()
        opt.zero_grad()
    assert_close(resumed, uninterrupted, rtol=0.0, atol=0.0, what=f"rank {rank}: losses after resuming")
    model.zero_engine.close()
    # other buckets and another split: every residual follows its parameter's elements
    split = _config(2, 0.02, bucket=500)
    split["zero_strategy"]["load_balance"] = {"scores": [3, 1]}
    model, opt = run(split)
    load_residuals_in_place(path, model, opt, want, f"rank {rank}, other buckets, split 3:1")
    losses = [_step(model, opt, 3, rank)]
    opt.step()
    if not math.isfinite(losses[0]):
        raise AssertionError(f"loss after loading into other buckets: {losses}")
    model.zero_engine.close()
    # another world size (each rank alone): the residuals cannot be placed and start from zero
    alone = [dist.new_group([r]) for r in range(world)][rank]
    model, opt = zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-2), config=_config(2, 0.02),
                               process_group=alone)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.load_checkpoint(path, model, opt)
    if not any("start from zero" in str(w.message) for w in caught):
        raise AssertionError(f"no warning about the residuals: {[str(w.message) for w in caught]}")
    if any(int(torch.count_nonzero(r)) for r in model.zero_engine.reducer.compression.residuals.values()):
        raise AssertionError("residuals of another world size were loaded")
    model.zero_engine.close()


def _overflow(rank: int, world: int) -> None:
    """fp16: an inf on one rank skips the step everywhere, and every rank's residuals (which hold
    it, or its neighbours' scaled values) start again from zero; the next step trains."""
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs

    cfg = _config(2, 0.05)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    model, opt = zs.initialize(_gpt(), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
    fb = model.zero_engine.reducer.compression
    inject = [False]
    if rank == 1:
        model.blocks[0].mlp.fc.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if inject[0] else g
        )
    skipped, finite = [], []
    for step in range(4):
        inject[0] = step == 2
        x, y = _batch(step, rank)
        zs.backward(F.cross_entropy(model(x).float().view(-1, 64), y.reshape(-1)), model=model)
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
        finite.append(all(bool(torch.isfinite(r).all()) for r in fb.residuals.values()))
        if step == 2 and any(int(torch.count_nonzero(r)) for r in fb.residuals.values()):
            raise AssertionError("the overflowing step left residuals")
    if skipped != [False, False, True, False] or not all(finite):
        raise AssertionError(f"rank {rank}: skipped {skipped}, residuals finite {finite}")
    model.zero_engine.close()


def _wire_16bit(rank: int, world: int) -> None:
    """fp16 wire: values travel at DDP's magnitude (the loss-scaled gradient / world), and values
    held back for 50 steps (k = 1 of 100 per row, every element's gradient the same) reach the
    receiver finite: no step is skipped, and what was sent plus the residual is what came in."""
    import torch

    import zero_strategy as zs
    from zero_strategy.reduction import compression
    from zero_strategy.testing.compare import assert_close

    cfg = _config(2, 0.01)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    cfg["communication_data_type"] = "fp16"
    model, opt = zs.initialize(torch.nn.Linear(200, 1, bias=False), lambda p: torch.optim.SGD(p, lr=0.0), config=cfg)
    scale = model.zero_engine.scaler.scale
    wires: list[torch.Tensor] = []
    select = compression.select_top_k

    def spy(*args, **kwargs):
        idx, wire = select(*args, **kwargs)
        wires.append(wire.float())
        return idx, wire

    compression.select_top_k = spy  # restored below
    try:
        for _ in range(50):
            x = torch.ones(1, 200, dtype=torch.float16)
            zs.backward(model(x).sum(), model=model)  # each weight's gradient: 1, loss-scaled
            opt.step()
            opt.zero_grad()
            if opt.step_was_skipped:
                raise AssertionError(
                    f"rank {rank}: step {len(wires)} skipped; wire maxima {[float(w.abs().max()) for w in wires]}"
                )
    finally:
        compression.select_top_k = select
    if len(wires) != 50 or model.zero_engine.scaler.scale != scale:
        raise AssertionError(f"{len(wires)} exchanges, loss scale {model.zero_engine.scaler.scale} (was {scale})")
    assert_close(
        wires[0],
        torch.full_like(wires[0], scale / world),
        rtol=0.0,
        atol=0.0,
        what="first step's wire (DDP's g / world)",
    )
    sent = sum(float(w.sum()) for w in wires) / scale
    residual = sum(float(r.sum()) for r in model.zero_engine.reducer.compression.residuals.values())
    assert_close(sent + residual, 50 * 200 / world, rtol=1e-6, atol=0.0, what=f"rank {rank}: sent + residual")
    if max(float(w.abs().max()) for w in wires) < 0.99 * torch.finfo(torch.float16).max:
        raise AssertionError("no value was held back long enough to reach fp16's range: the test checks nothing")
    model.zero_engine.close()


def _worker(rank: int, world: int, root: str) -> int:
    from zero_strategy.testing.parity import Cell, compare

    run_subtests(lambda **kw: compare(Cell(topk=1.0, **kw), rank, world), PARITY, label="top-k ratio 1.0 parity")
    run_subtests(lambda **kw: compare(Cell(topk=1.0, **kw), rank, world), PARITY_DGC,
                 label="top-k ratio 1.0 parity, momentum correction")  # fmt: skip
    feedback = [{"stage": 1}, {"stage": 2}, {"stage": 2, "wide": True}, {"stage": 2, "ramp": True},
                {"stage": 1, "momentum": 0.9}, {"stage": 2, "ramp": True, "momentum": 0.9}]  # fmt: skip
    run_subtests(lambda **kw: _feedback(rank, world, **kw), feedback, label="error feedback")
    run_subtests(lambda stage: _warmup(rank, world, stage), [{"stage": 2}], label="dense warm-up")
    run_subtests(lambda: _ramp(rank, world), [{}], label="exponential warm-up")
    run_subtests(lambda **kw: _local_clip(rank, world, **kw), [{"stage": 2, "accum": False}, {"stage": 1, "accum": True}],
                 label="local clipping")  # fmt: skip
    run_subtests(lambda: _checkpoint(rank, world, root), [{}], label="checkpoint")
    run_subtests(lambda: _checkpoint_momentum(rank, world, root), [{}], label="checkpoint, momentum")
    run_subtests(lambda: _overflow(rank, world), [{}], label="fp16 overflow")
    run_subtests(lambda: _wire_16bit(rank, world), [{}], label="16-bit wire")
    return len(PARITY) + len(PARITY_DGC) + len(feedback) + 8


def test_topk_compression(launch, tmp_path) -> None:
    assert launch(_worker, 2, args=(str(tmp_path),), timeout=600) == [len(PARITY) + len(PARITY_DGC) + 6 + 8] * 2
