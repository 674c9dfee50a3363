"""Load balancing with uneven shards (``balance.py``), world size 2.

- parity with DDP when rank 0 owns three quarters of every group (scores [3, 1]) at stages 1,
  2 and 3, with accumulation, clipping, tied and frozen parameters, CPU and NVMe offload (ZeRO-3:
  CPU) and compression;
- each rank's optimizer state in proportion to its score, and ``full_grad`` still DDP's;
- checkpoints: uneven -> even -> the other uneven way at ZeRO-3 -> back, each load continuing
  exactly, and the offline export of an uneven checkpoint exact; top-k residuals (ratio 0.05)
  saved under [3, 1] follow their elements into [1, 3], even shards and [2, 1];
- measured scores (``preset: compute``): positive, and the same fractions on every rank.
"""

from __future__ import annotations

from zero_strategy.testing import run_subtests

PARITY = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 1, "accum": "no_sync", "clip": 0.05},
    {"stage": 2, "accum": "plain", "tied": True, "frozen": True, "groups": True},
    {"stage": 2, "unused": "some_ranks", "dtype": "float32", "clip": 0.05},
    {"stage": 2, "offload": "cpu"},
    {"stage": 2, "topk": 1.0},
    {"stage": 1, "impl": "native", "overlap": False},
    {"stage": 2, "offload": "nvme"},
    {"stage": 1, "offload": "nvme", "accum": "no_sync", "clip": 0.05},
    {"stage": 3},
    {"stage": 3, "accum": "no_sync", "clip": 0.05, "tied": True, "frozen": True},
    {"stage": 3, "policy": "blocks", "offload": "param", "dtype": "float32"},
]


def _gpt():
    import torch

    from zero_strategy.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)).double()


def _steps(model, opt, start: int, stop: int, rank: int) -> list[float]:
    from zero_strategy.models import GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    losses = []
    for step in range(start, stop):
        x, y = synthetic_batch(cfg, 4, step, seed=rank)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _config(stage: int, scores: list[float] | None) -> dict:
    cfg: dict = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    if scores:
        cfg["zero_strategy"] = {"load_balance": {"scores": scores}}
    return cfg


def _shares(rank: int, world: int, stage: int) -> None:
    """Optimizer state in proportion to the scores; full_grad equal to the averaged gradient."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close

    model, opt = zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p), config=_config(stage, [3, 1]))
    _steps(model, opt, 0, 2, rank)
    state = torch.tensor([float(model.zero_engine.memory_stats()["optimizer_state"])], dtype=torch.float64)
    every = [torch.zeros_like(state) for _ in range(world)]
    dist.all_gather(every, state)
    ratio = float(every[0] / every[1])
    if not 2.9 <= ratio <= 3.1:
        raise AssertionError(f"optimizer state per rank {[float(e) for e in every]}: ratio {ratio}, scores 3:1")
    for g in model.zero_engine.groups:  # three quarters of every parameter on rank 0
        for i in range(len(g.params)):
            lo, hi = g.layout.local_range(i)
            share = (hi - lo) / g.layout.numels[i]
            want = 0.75 if rank == 0 else 0.25
            if g.layout.numels[i] >= 100 and abs(share - want) > 0.02:
                raise AssertionError(f"rank {rank}: {g.fqns[i]} share {share}, want {want}")
    from zero_strategy.models import GPTConfig, synthetic_batch

    x, y = synthetic_batch(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4), 4, 9, seed=rank)
    ref = _gpt()  # a plain replica of the current weights: this rank's own gradient, for the check
    ref.load_state_dict(zs.full_state_dict(model, rank0_only=False))
    ref.loss(x, y).backward()
    local = ref.blocks[1].mlp.fc.weight.grad.clone()
    dist.all_reduce(local)
    model.loss(x, y).backward()
    weight = model.blocks[1].mlp.fc.weight
    got = zs.full_grad(model, weight)
    assert_close(got, local / world, rtol=1e-12, atol=0.0, what="full_grad with uneven pieces")
    opt.zero_grad()
    model.zero_engine.close()


def _reshard(rank: int, world: int, root: str) -> None:
    """Uneven [3, 1] -> even -> ZeRO-3 uneven [1, 3] -> back to [3, 1], each load continuing as
    the uninterrupted run (at the last hop: the loss, then every weight after a step that uses
    the loaded optimizer state)."""
    import torch

    import zero_strategy as zs
    from zero_strategy.testing.compare import assert_close, assert_state_close

    def run(stage: int, scores: list[float] | None):
        return zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-2), config=_config(stage, scores))

    model, opt = run(2, [3, 1])
    _steps(model, opt, 0, 3, rank)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}  # full at ZeRO-2
    first = zs.save_checkpoint(root, model, opt, tag="uneven")
    if rank == 0:  # offline, one process: the recorded offsets put every piece back in place
        exported = torch.load(zs.export_full(first, f"{root}/uneven.pt"))
        for k, v in weights.items():
            assert_close(exported[k], v, rtol=0.0, atol=0.0, what=f"exported {k}")
    reference = _steps(model, opt, 3, 7, rank)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.zero_engine.close()

    model, opt = run(1, None)  # even, and another stage
    zs.load_checkpoint(first, model, opt)
    even = _steps(model, opt, 3, 5, rank)
    assert_close(even, reference[:2], rtol=1e-12, atol=0.0, what=f"rank {rank}: uneven -> even")
    second = zs.save_checkpoint(root, model, opt, tag="even")
    model.zero_engine.close()

    model, opt = run(3, [1, 3])  # uneven the other way, at ZeRO-3
    zs.load_checkpoint(second, model, opt)
    back = _steps(model, opt, 5, 6, rank)
    assert_close(back, reference[2:3], rtol=1e-12, atol=0.0, what=f"rank {rank}: even -> ZeRO-3 uneven [1, 3]")
    third = zs.save_checkpoint(root, model, opt, tag="zero3-uneven")
    model.zero_engine.close()

    model, opt = run(2, [3, 1])  # and from ZeRO-3's uneven pieces back to the first split
    zs.load_checkpoint(third, model, opt)
    with zs.gathered_parameters(model):
        pass
    last = _steps(model, opt, 6, 7, rank)
    assert_close(last, reference[3:], rtol=1e-12, atol=0.0, what=f"rank {rank}: ZeRO-3 uneven [1, 3] -> ZeRO-2 [3, 1]")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_state_close(state, final, rtol=1e-10, atol=1e-14, what=f"rank {rank}: weights after the last hop's step")
    model.zero_engine.close()


def _frozen_zero3(rank: int, world: int, root: str) -> None:
    """A frozen parameter's uneven ZeRO-3 piece is saved at its real offset: it loads into even
    and into the other uneven split unchanged."""
    import torch

    import zero_strategy as zs

    def build(scores: list[float] | None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Linear(33, 5), torch.nn.Linear(5, 3)).double()
        m[0].weight.requires_grad_(False)
        cfg = _config(3, scores)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return zs.initialize(m, lambda p: torch.optim.AdamW([q for q in p if q.requires_grad], lr=1e-2), config=cfg)

    model, opt = build([3, 1])
    x = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    want = zs.full_state_dict(model, rank0_only=False)
    path = zs.save_checkpoint(root, model, opt, tag="frozen-zero3")
    model.zero_engine.close()
    for scores in (None, [1, 3]):
        model, opt = build(scores)
        zs.load_checkpoint(path, model, opt)
        got = zs.full_state_dict(model, rank0_only=False)
        for k, v in want.items():
            if not torch.equal(got[k], v):
                raise AssertionError(f"rank {rank}: {k} after loading into scores {scores}")
        model.zero_engine.close()


def _topk_resplit(rank: int, world: int, root: str) -> None:
    """Top-k residuals saved under scores [3, 1] load under [1, 3] (the same padded rows), even
    shards and [2, 1] onto the same parameter elements, with no warning, and training goes on."""
    import math

    import torch

    import zero_strategy as zs
    from zero_strategy.testing.parity import load_residuals_in_place, residuals_by_parameter

    def run(scores: list[float] | None):
        cfg = _config(2, scores)
        cfg.setdefault("zero_strategy", {})["compression"] = {"type": "topk", "ratio": 0.05, "warmup_steps": 0}
        return zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p, lr=1e-2), config=cfg)

    model, opt = run([3, 1])
    _steps(model, opt, 0, 3, rank)
    want, padding = residuals_by_parameter(model)
    if padding != 0.0 or sum(int(torch.count_nonzero(v)) for v in want.values()) < 1000:
        raise AssertionError(f"rank {rank}: residuals to save: padding mass {padding}, too few nonzero")
    path = zs.save_checkpoint(root, model, opt, tag="topk-uneven")
    model.zero_engine.close()
    for scores in ([1, 3], None, [2, 1]):
        model, opt = run(scores)
        load_residuals_in_place(path, model, opt, want, f"rank {rank}, scores {scores}")
        losses = _steps(model, opt, 3, 4, rank)
        if not all(math.isfinite(v) for v in losses):
            raise AssertionError(f"rank {rank}, scores {scores}: loss after loading {losses}")
        model.zero_engine.close()


def _measured(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    config = {"zero_optimization": {"stage": 1}, "zero_strategy": {"load_balance": "compute"}}
    model, opt = zs.initialize(_gpt(), lambda p: torch.optim.AdamW(p), config=config)
    fractions = model.zero_engine.groups[0].layout.fractions
    if fractions is None or len(fractions) != world or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-9:
        raise AssertionError(f"rank {rank}: measured fractions {fractions}")
    every: list = [None] * world
    dist.all_gather_object(every, fractions)
    if any(f != fractions for f in every):
        raise AssertionError(f"the ranks computed different fractions: {every}")
    losses = _steps(model, opt, 0, 2, rank)
    if not all(torch.isfinite(torch.tensor(losses))):
        raise AssertionError(f"losses {losses}")
    model.zero_engine.close()


def _worker(rank: int, world: int, root: str) -> int:
    from zero_strategy.testing.parity import Cell, compare

    run_subtests(lambda **kw: compare(Cell(scores=(3.0, 1.0), **kw), rank, world), PARITY, label="uneven parity")
    run_subtests(lambda stage: _shares(rank, world, stage), [{"stage": 2}, {"stage": 3}], label="shares")
    run_subtests(lambda: _reshard(rank, world, root), [{}], label="reshard")
    run_subtests(lambda: _frozen_zero3(rank, world, root), [{}], label="frozen ZeRO-3 pieces")
    run_subtests(lambda: _topk_resplit(rank, world, root), [{}], label="top-k residuals under another split")
    run_subtests(lambda: _measured(rank, world), [{}], label="measured scores")
    return len(PARITY) + 6


def test_load_balance(launch, tmp_path) -> None:
    assert launch(_worker, 2, args=(str(tmp_path),), timeout=600) == [len(PARITY) + 6] * 2
