"""Top-k policies: one threshold over the whole bucket (``compression.global_threshold``), and
the Adam mode's momentum kept by the owner (``compression.owner_momentum``), world size 2.

- ratio 1.0 sends every element through the uneven exchange: DDP's numbers with the same
  optimizer (the error-feedback identity), for plain top-k (AdamW), DGC's momentum correction
  (SGD with momentum) and the frozen-variance Adam mode (the oracle ``FrozenAdamW``);
- ratio < 1: each rank sends the ``world * k`` largest entries of its whole compensated bucket
  (not ``k`` per row), sent + residual = compensated, every rank's shard is the sum of what all
  ranks sent to it, and the bytes are the pairs plus ``8 * world`` bytes of counts per bucket;
- ``owner_momentum`` at ratio 1.0: DDP with the oracle ``FrozenAdamW`` (its ``w`` is the owner's
  momentum), alone and with ``global_threshold``; the ranks keep no velocity.
"""

from __future__ import annotations

from zero_strategy.testing import run_subtests

PARITY = [
    {"stage": 2, "topk_global": True},
    {"stage": 1, "optim": "sgd", "topk_momentum": 0.9, "topk_global": True, "accum": "no_sync"},
    {"stage": 2, "topk_adam": 3, "topk_global": True, "accum": "no_sync", "unused": "some_ranks", "steps": 6},
]
OWNER = [
    {"stage": 2, "topk_adam": 3, "topk_owner": True},
    {"stage": 1, "topk_adam": 3, "topk_owner": True, "topk_global": True, "accum": "no_sync", "steps": 6},
]
DIMS = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4}


def _feedback(rank: int, world: int, stage: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch
    from zero_strategy.testing.compare import assert_close

    torch.manual_seed(0)
    block = {"type": "topk", "ratio": 0.05, "global_threshold": True}
    config = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "zero_strategy": {"compression": block},
    }
    model, opt = zs.initialize(GPT(GPTConfig(**DIMS)), lambda p: torch.optim.AdamW(p, lr=1e-3), config=config)
    engine = model.zero_engine
    fb = engine.reducer.compression
    for step in range(3):
        x, y = synthetic_batch(GPTConfig(**DIMS), 4, step, seed=rank)
        with model.no_sync() if step == 2 else torch.enable_grad():  # step 2's gradients read before reducing
            F.cross_entropy(model(x).view(-1, 64), y.reshape(-1)).backward()
        if step == 2:
            break
        opt.step()
        opt.zero_grad()
    dense = {id(p): p.grad.detach().clone() for g in engine.groups for p in g.params if p.grad is not None}
    before = {i: r.clone() for i, r in fb.residuals.items()}
    zs.reset_comm_stats()
    engine.finalize_grads()
    moved_bytes = zs.comm_stats()["all_to_all"]["bytes"]
    expected_bytes, uneven = 0, False
    for g in engine.groups:
        lay, k = g.layout, fb.k(g)
        expected_bytes += world * k * (4 + 4) + world * 8  # int32 column + fp32 value, and the counts
        packed = torch.zeros(world * lay.shard_numel, dtype=g.master_dtype)
        lay.pack_full([dense.get(id(p)) for p in g.params], packed)
        compensated = before[g.index] + packed.view(world, -1) / world
        after = fb.residuals[g.index]
        changed = (after - compensated).abs() > 1e-5 * float(compensated.abs().max())
        sent = torch.where(changed, compensated, torch.zeros_like(after))
        per_row = changed.sum(dim=1)
        uneven = uneven or int(per_row.max()) > k
        if int(per_row.sum()) != world * k:
            raise AssertionError(f"bucket {g.index}: {per_row.tolist()} entries sent per row, want {world * k} in all")
        assert_close(after + sent, compensated, rtol=1e-5, atol=1e-6 * float(compensated.abs().max()),
                     what=f"rank {rank}: sent + residual = compensated")  # fmt: skip
        threshold = compensated.abs().flatten().sort(descending=True).values[world * k - 1]
        if not bool((sent.abs()[changed] >= 0.999 * threshold).all()):
            raise AssertionError(f"bucket {g.index}: a sent entry is not among the bucket's top {world * k}")
        dist.all_reduce(sent)
        assert_close(g.grad_shard, sent[rank], rtol=1e-5, atol=1e-6 * float(sent.abs().max()),
                     what=f"rank {rank}: shard of bucket {g.index} = the sum of what every rank sent to it")  # fmt: skip
    if moved_bytes != expected_bytes:
        raise AssertionError(f"rank {rank}: {moved_bytes} bytes moved, expected {expected_bytes}")
    flags = torch.tensor([float(uneven)])
    dist.all_reduce(flags)
    if not float(flags):  # the point of the mode: some row got more than its per-row share
        raise AssertionError("every row sent at most k pairs on every rank: the threshold was not global")
    opt.step()
    engine.close()


def _owner_state(rank: int, world: int) -> None:
    """``owner_momentum`` below ratio 1.0: no velocities, and the owner's ``update_avg`` moves."""
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    block = {"type": "topk", "ratio": 0.05, "optimizer": "adam", "warmup": "dense", "warmup_steps": 2,
             "owner_momentum": True, "precondition_floor": 0.1}  # fmt: skip
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 3000}, "zero_strategy": {"compression": block}}
    model, opt = zs.initialize(GPT(GPTConfig(**DIMS)), lambda p: torch.optim.SGD(p, lr=1e-2), config=config)
    for step in range(4):
        x, y = synthetic_batch(GPTConfig(**DIMS), 4, step, seed=rank)
        F.cross_entropy(model(x).view(-1, 64), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    fb = model.zero_engine.reducer.compression
    if fb.velocities or not fb.residuals:
        raise AssertionError(f"velocities {sorted(fb.velocities)}, residuals {sorted(fb.residuals)}")
    moved = [s["update_avg"] for s in opt.state.values() if "update_avg" in s]
    if not moved or not any(bool(t.abs().sum() > 0) for t in moved):
        raise AssertionError("the owner's update_avg is missing or zero after two compressed steps")
    model.zero_engine.close()


def _worker(rank: int, world: int) -> int:
    from zero_strategy.testing.parity import Cell, compare

    run_subtests(lambda **kw: compare(Cell(topk=1.0, **kw), rank, world), PARITY, label="global threshold parity")
    run_subtests(lambda **kw: _feedback(rank, world, **kw), [{"stage": 2}], label="global threshold feedback")
    run_subtests(lambda **kw: compare(Cell(topk=1.0, **kw), rank, world), OWNER, label="owner momentum parity")
    run_subtests(lambda: _owner_state(rank, world), [{}], label="owner momentum state")
    return len(PARITY) + len(OWNER) + 2


def test_topk_policies(launch) -> None:
    assert launch(_worker, 2, timeout=300) == [len(PARITY) + len(OWNER) + 2] * 2
