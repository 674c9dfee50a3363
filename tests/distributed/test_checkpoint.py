"""Sharded checkpoints: save with N ranks at stage S, load with M ranks at stage S', continue
exactly as the uninterrupted run (global batch 12, data indexed by global step)."""

from __future__ import annotations

GLOBAL_BATCH, K = 12, 3


def _run(model, opt, group, rank: int, world: int, steps: range):
    import torch
    import torch.nn.functional as F

    from zero_strategy.testing.parity import SEQ, VOCAB

    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        mine = data.chunk(world)[rank]
        out = model(mine[:, :-1])
        loss = F.cross_entropy(out.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


def _state(model):
    import zero_strategy as zs

    with zs.gathered_parameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _checkpoint_worker(rank: int, world: int, tmp: str) -> int:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    checked = 0

    def build(stage: int, group):
        torch.manual_seed(0)
        model = Net(Cell()).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        cfg = zs.ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_param_persistence_threshold=0)
        return zs.initialize(model, opt, config=cfg, process_group=group)

    for n in range(1, world + 1):
        for s in (1, 2, 3):
            path = f"{tmp}/n{n}s{s}"
            if rank < n:
                model, opt = build(s, groups[n])
                _run(model, opt, groups[n], rank, n, range(K))
                zs.save_checkpoint(path, model, opt, extra={"n": n, "s": s})
                ref_losses = _run(model, opt, groups[n], rank, n, range(K, 2 * K))
                ref_state = _state(model)
                model.zero_engine.close()
            dist.barrier()
            ref = [None]
            if rank == 0:
                ref = [(ref_losses, ref_state)]
            dist.broadcast_object_list(ref, src=0)
            ref_losses, ref_state = ref[0]
            for m in range(1, world + 1):
                for s2 in (1, 2, 3):
                    if rank < m:
                        model, opt = build(s2, groups[m])
                        extra = zs.load_checkpoint(path, model, opt)
                        assert extra == {"n": n, "s": s}, extra
                        losses = _run(model, opt, groups[m], rank, m, range(K, 2 * K))
                        state = _state(model)
                        where = f"saved n={n} stage {s}, loaded m={m} stage {s2}"
                        for a, b in zip(losses, ref_losses):
                            assert abs(a - b) <= 1e-9 * abs(b), (where, losses, ref_losses)
                        for key, v in ref_state.items():
                            assert torch.allclose(state[key], v, rtol=1e-6, atol=1e-12), (where, key)
                        model.zero_engine.close()
                        checked += 1
                    dist.barrier()
    return checked


def test_reshard_any_world_size_and_stage(launch, tmp_path) -> None:
    counts = launch(_checkpoint_worker, 4, args=(str(tmp_path),), timeout=900)
    assert counts[0] == 4 * 3 * 4 * 3  # every (N, S) -> (M, S') combination on rank 0
