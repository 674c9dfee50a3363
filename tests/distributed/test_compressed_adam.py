"""The frozen-variance Adam mode of top-k compression (``compression: {optimizer: adam}``,
``runtime/compressed_adam.py``), world size 2.

- ratio 1.0 without masking: DDP with the oracle ``FrozenAdamW`` (dense AdamW for the warm-up,
  then the variance frozen), stages 1 and 2, accumulation, fp32; with ``variance_refresh`` the
  oracle refreshes the variance on the same dense steps;
- error feedback: sent + residual = residual before + the new normalised velocity, each rank's
  gradient shard is the sum of what every rank sent to it;
- ``region_indices``: ratio 1.0 gives DDP's numbers, and a pair costs 6 bytes (int16 offset);
- checkpoints: Adam's moments, residuals and velocities survive at the same world size (the
  resumed run continues exactly); at another world size the moments are resharded and the
  residuals and velocities start from zero with a warning.
"""

from __future__ import annotations

import math
import warnings

from zero_strategy.testing import run_subtests

PARITY = [
    {"stage": 2, "topk_adam": 3},
    {"stage": 1, "topk_adam": 3, "accum": "no_sync", "unused": "some_ranks", "steps": 6},
    {"stage": 2, "topk_adam": 3, "accum": "plain", "dtype": "float32", "groups": True},
    # variance_refresh 1: dense 0-1, compressed 2, refresh 3, compressed 4-5, refresh 6, compressed 7-9
    {"stage": 2, "topk_adam": 2, "topk_refresh": 1, "accum": "no_sync"},
]
# region_indices (with REGION = 100 columns): ratio 1.0 still sends every element, DDP's numbers
REGIONS = [{"stage": 2, "steps": 6}, {"stage": 1, "topk_adam": 3, "accum": "no_sync", "steps": 6}]
DIMS = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4}


def _gpt():
    import torch

    from zero_strategy.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**DIMS))


def _config(stage: int, ratio: float, warmup: int = 3, **extra) -> dict:
    block = {"type": "topk", "ratio": ratio, "optimizer": "adam", "warmup": "dense", "warmup_steps": warmup, **extra}
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}, "zero_strategy": {"compression": block}}


def _step(model, step: int, rank: int, *, quiet: bool = False) -> float:
    import contextlib

    import torch.nn.functional as F

    from zero_strategy.models import GPTConfig, synthetic_batch

    x, y = synthetic_batch(GPTConfig(**DIMS), 4, step, seed=rank)
    with model.no_sync() if quiet else contextlib.nullcontext():
        loss = F.cross_entropy(model(x).view(-1, 64), y.reshape(-1))
        loss.backward()
    return float(loss.detach())


def _init(cfg: dict, group=None):
    import torch

    import zero_strategy as zs

    return zs.initialize(_gpt(), lambda p: torch.optim.SGD(p, lr=1e-2, weight_decay=0.01), config=cfg,
                         process_group=group)  # fmt: skip


def _feedback(rank: int, world: int, stage: int) -> None:
    """One compressed step after the dense ones, checked against the dense gradients."""
    import torch
    import torch.distributed as dist

    from zero_strategy.testing.compare import assert_close

    model, opt = _init(_config(stage, 0.05))
    engine = model.zero_engine
    fb = engine.reducer.compression
    for step in range(4):  # 3 dense, 1 compressed
        _step(model, step, rank)
        opt.step()
        opt.zero_grad()
    if not fb.velocities or not fb.preconditioners:
        raise AssertionError(f"velocities {sorted(fb.velocities)}, preconditioners {sorted(fb.preconditioners)}")
    _step(model, 4, rank, quiet=True)
    dense = {id(p): p.grad.detach().clone() for g in engine.groups for p in g.params if p.grad is not None}
    before = {i: r.clone() for i, r in fb.residuals.items()}
    velocity = {i: v.clone() for i, v in fb.velocities.items()}
    engine.finalize_grads()
    b1 = fb.config.beta1
    for g in engine.groups:
        lay, k = g.layout, fb.k(g)
        packed = torch.zeros(world * lay.shard_numel, dtype=g.master_dtype)
        lay.pack_full([dense.get(id(p)) for p in g.params], packed)
        pre = fb.preconditioners[g.index]
        if not bool((pre > 0).any()) or not bool(torch.isfinite(pre).all()):
            raise AssertionError(f"bucket {g.index}: preconditioner {pre}")
        u = b1 * velocity[g.index] + (1 - b1) * packed.view(world, -1) / world * pre
        compensated = before[g.index] + u
        after = fb.residuals[g.index]
        # sent: the entries whose residual went to zero (the fp32 wire rounds nothing off); elsewhere
        # the residual is the compensated value (up to the order of the float operations)
        changed = (after - compensated).abs() > 1e-5 * float(compensated.abs().max())
        sent = torch.where(changed, compensated, torch.zeros_like(after))
        moved = changed.sum(dim=1)
        if int(moved.max()) > k or int(moved.sum()) == 0:
            raise AssertionError(f"bucket {g.index}: {moved.tolist()} entries sent per row, k = {k}")
        if not bool((after[changed] == 0).all()):
            raise AssertionError("a sent entry left a residual (fp32 wire: nothing is rounded off)")
        assert_close(after + sent, compensated, rtol=1e-5, atol=1e-6 * float(compensated.abs().max()),
                     what=f"rank {rank}: sent + residual = residual before + new velocity")  # fmt: skip
        top = compensated.abs().sort(dim=1, descending=True).values[:, k - 1 : k]
        if not bool((sent.abs()[sent != 0] >= 0.999 * top.expand_as(sent)[sent != 0]).all()):
            raise AssertionError(f"bucket {g.index}: a sent entry is not among its row's top {k}")
        dist.all_reduce(sent)  # every rank's sent values, summed: this rank's row is its shard
        assert_close(g.grad_shard, sent[rank], rtol=1e-5, atol=1e-6 * float(sent.abs().max()),
                     what=f"rank {rank}: shard of bucket {g.index} = the sum of what every rank sent to it")  # fmt: skip
    opt.step()
    model.zero_engine.close()


def _checkpoint(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    cfg = _config(2, 0.05)
    model, opt = _init(cfg)
    for step in range(5):
        _step(model, step, rank)
        opt.step()
        opt.zero_grad()
    path = zs.save_checkpoint(root, model, opt, tag="adam")
    fb = model.zero_engine.reducer.compression
    saved = {i: r.clone() for i, r in (*fb.residuals.items(), *((-1 - i, v) for i, v in fb.velocities.items()))}
    if not all(int(torch.count_nonzero(r)) for r in saved.values()):
        raise AssertionError("a residual or velocity is zero: the test would not see it lost")
    uninterrupted = [_step(model, s, rank) for s in range(5, 8) if opt.step() is None and opt.zero_grad() is None]
    model.zero_engine.close()
    model, opt = _init(cfg)
    zs.load_checkpoint(path, model, opt)
    fb = model.zero_engine.reducer.compression
    for i, r in (*fb.residuals.items(), *((-1 - i, v) for i, v in fb.velocities.items())):
        assert_close(r, saved[i], rtol=0.0, atol=0.0, what=f"rank {rank}: residual/velocity {i} after loading")
    resumed = [_step(model, s, rank) for s in range(5, 8) if opt.step() is None and opt.zero_grad() is None]
    assert_close(resumed, uninterrupted, rtol=0.0, atol=0.0, what=f"rank {rank}: losses after resuming")
    model.zero_engine.close()
    # another world size (each rank alone): Adam's moments reshard, residuals and velocities restart
    alone = [dist.new_group([r]) for r in range(world)][rank]
    model, opt = _init(cfg, alone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.load_checkpoint(path, model, opt)
    if not any("start from zero" in str(w.message) for w in caught):
        raise AssertionError(f"no warning about the residuals: {[str(w.message) for w in caught]}")
    fb = model.zero_engine.reducer.compression
    if any(int(torch.count_nonzero(r)) for r in (*fb.residuals.values(), *fb.velocities.values())):
        raise AssertionError("residuals or velocities of another world size were loaded")
    variances = [s["exp_avg_sq"] for s in opt.state.values()]
    if not variances or not all(int(torch.count_nonzero(v)) for v in variances):
        raise AssertionError("Adam's variance did not come back at world size 1")
    losses = [_step(model, s, rank) for s in range(5, 7) if opt.step() is None and opt.zero_grad() is None]
    if not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"losses after loading at world size 1: {losses}")
    model.zero_engine.close()


def _region_bytes(rank: int, world: int) -> None:
    """``region_indices``: each rank sends ``pairs`` int16 + fp32 pairs per destination and
    bucket (6 bytes each: a quarter less than int32 indices), and training goes on."""
    import torch

    import zero_strategy as zs

    cfg = _config(2, 0.05, warmup=1, region_indices=True)
    model, opt = _init(cfg)
    fb = model.zero_engine.reducer.compression
    _step(model, 0, rank)
    opt.step()
    opt.zero_grad()
    zs.reset_comm_stats()
    loss = _step(model, 1, rank)
    opt.step()
    sent = zs.comm_stats()["all_to_all"]["bytes"]
    expected = sum(world * fb.pairs(g) * 6 for g in model.zero_engine.groups)
    if sent != expected or not math.isfinite(loss):
        raise AssertionError(f"rank {rank}: {sent} bytes sent, expected {expected}; loss {loss}")
    rows = [g.layout.shard_numel for g in model.zero_engine.groups]
    if not any(r > 100 for r in rows) or not any(r % 100 for r in rows):
        raise AssertionError(f"rows {rows}: no bucket has several regions and a shorter last one")
    if any(not 0 < fb.pairs(g) < torch.tensor(r) for g, r in zip(model.zero_engine.groups, rows)):
        raise AssertionError("a bucket sends no pair, or all of them")
    model.zero_engine.close()


def _worker(rank: int, world: int, root: str) -> int:
    from zero_strategy.reduction import compression
    from zero_strategy.testing.parity import Cell, compare

    run_subtests(lambda **kw: compare(Cell(topk=1.0, **kw), rank, world), PARITY, label="frozen-variance Adam parity")
    compression.REGION = 100  # several regions per row in these small buckets; restored below
    try:
        run_subtests(lambda **kw: compare(Cell(topk=1.0, topk_regions=True, **kw), rank, world), REGIONS,
                     label="region_indices parity")  # fmt: skip
        run_subtests(lambda: _region_bytes(rank, world), [{}], label="region_indices bytes")
    finally:
        compression.REGION = 2**15
    run_subtests(lambda **kw: _feedback(rank, world, **kw), [{"stage": 1}, {"stage": 2}], label="error feedback")
    run_subtests(lambda: _checkpoint(rank, world, root), [{}], label="checkpoint")
    return len(PARITY) + len(REGIONS) + 4


def test_compressed_adam(launch, tmp_path) -> None:
    assert launch(_worker, 2, args=(str(tmp_path),), timeout=400) == [len(PARITY) + len(REGIONS) + 4] * 2
