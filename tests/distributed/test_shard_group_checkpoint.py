"""Checkpoints with shard groups keep the one sharded layout: saved by 4 ranks as 2 shard groups
of 2, loaded flat by 2 ranks at another stage, saved again, loaded back as shard groups by 4
ranks, each segment continuing exactly as an uninterrupted DDP run over 4 ranks (fp32: within
float rounding; data indexed by global step, global batch 12).

The chains run in one launch (``run_subtests``). Every checkpoint written with shard groups holds
each piece once (its files are no larger than a flat save's); the first exports offline to DDP's
weights.
"""

from __future__ import annotations

GLOBAL_BATCH, K = 12, 2

# one segment per entry, (ranks, stage, shard_size); a checkpoint between consecutive segments
CHAINS: list[dict] = [
    {"chain": [(4, 3, 2), (2, 2, None), (4, 1, 2)]},
    {"chain": [(4, 2, 2), (2, 3, None), (4, 3, 2), (4, 1, 1)]},  # then hybrid -> hybrid at another shard size
]
STEPS = K * max(len(c["chain"]) for c in CHAINS)


def _steps(model, opt, group, rank: int, world: int, steps: range) -> list[float]:
    import torch
    import torch.nn.functional as F

    from zero_strategy.testing.parity import SEQ, VOCAB

    losses = []
    for step in steps:
        data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = data.chunk(world)[rank]
        loss = F.cross_entropy(model(mine[:, :-1]).reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


def _build():
    import torch

    from zero_strategy.testing.parity import Cell, Net

    torch.manual_seed(0)
    model = Net(Cell())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _close(got: dict, ref: dict, what: str) -> None:
    from zero_strategy.testing import assert_close

    if got.keys() != ref.keys():
        raise AssertionError(f"{what}: keys {sorted(got)} against {sorted(ref)}")
    for k, r in ref.items():  # fp32: relative to the tensor's largest element, as the parity grid
        assert_close(got[k], r, rtol=0.0, atol=1e-5 * float(r.abs().max()), what=f"{what}: {k}")


def _distcp_bytes(path: str) -> int:
    import os

    from zero_strategy.checkpoint.versions import resolve_checkpoint

    path = resolve_checkpoint(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))


def _worker(rank: int, world: int, root: str) -> int:
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs
    from zero_strategy.checkpoint.versions import META, resolve_checkpoint
    from zero_strategy.testing import assert_close, run_subtests

    # a group of ranks 0 and 1 only (the 2-rank segments): ranks 2 and 3 know one group fewer, which
    # hung split_groups (local synchronisation names groups by that count); it makes them all now
    groups = {2: dist.new_group([0, 1]), 4: None}
    # the oracle: DDP over all 4 ranks, uninterrupted; its weights after every segment
    model, opt = _build()
    ddp = DDP(model)
    ref_losses: list[float] = []
    ref_states = []
    for seg in range(STEPS // K):
        ref_losses += _steps(ddp, opt, None, rank, world, range(seg * K, (seg + 1) * K))
        ref_states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def one(chain: list) -> None:
        name = "-".join(f"{m}s{stage}g{s}" for m, stage, s in chain)
        flat_bytes, hybrid_bytes = [], []
        for i, (m, stage, s) in enumerate(chain):
            path = f"{root}/{name}/seg{i}"
            if rank < m:
                model, opt = _build()
                cfg = zs.ZeroConfig(stage=stage, shard_size=s, stage3_param_persistence_threshold=0,
                                    reduce_bucket_size=700)  # fmt: skip
                model, opt = zs.initialize(model, opt, config=cfg, process_group=groups[m])
                engine = model.zero_engine
                want = (s or m, m // (s or m))
                if (engine.ctx.world_size, engine.replica.world_size) != want:
                    raise AssertionError(f"{name} segment {i}: shard x replica group sizes "
                                         f"{engine.ctx.world_size} x {engine.replica.world_size}, want {want}")  # fmt: skip
                if i:
                    extra = zs.load_checkpoint(f"{root}/{name}/seg{i - 1}", model, opt)
                    if extra != {"segment": i - 1}:
                        raise AssertionError(f"{name} segment {i}: extra {extra}")
                steps = range(i * K, (i + 1) * K)
                losses = _steps(model, opt, groups[m], rank, m, steps)
                where = f"{name} segment {i} ({m} ranks, stage {stage}, shard_size {s})"
                assert_close(losses, ref_losses[steps.start : steps.stop], rtol=1e-5, what=f"{where}: losses")
                zs.save_checkpoint(path, model, opt, extra={"segment": i})
                with zs.gathered_parameters(model):
                    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                _close(state, ref_states[i], f"{where}: parameters")
                engine.close()
            dist.barrier()
            if rank == 0:
                meta = json.load(open(os.path.join(resolve_checkpoint(path), META)))
                if (meta["world_size"], meta["shard_size"]) != (m, s or m):
                    raise AssertionError(f"{path}: metadata records {meta['world_size']} ranks, shard size "
                                         f"{meta['shard_size']}; want {m}, {s or m}")  # fmt: skip
                (hybrid_bytes if s not in (None, m) else flat_bytes).append(_distcp_bytes(path))
                if chain is CHAINS[0]["chain"] and i == 0:  # offline export (one process) of a hybrid save
                    _close(zs.full_state_dict(path), ref_states[i], f"{path}: exported")
        # each piece written once: shard groups that all wrote would double the files
        if rank == 0 and not max(hybrid_bytes) < 1.25 * min(flat_bytes):
            raise AssertionError(f"{name}: checkpoints with shard groups hold {hybrid_bytes} bytes, flat "
                                 f"ones {flat_bytes}: a piece was written by more than one shard group")  # fmt: skip
        dist.barrier()

    torch.set_num_threads(1)
    run_subtests(one, CHAINS, label="checkpoints with shard groups, 4 -> 2 -> 4 ranks")
    return len(CHAINS)


def test_checkpoint_round_trip_flat_and_shard_groups(launch, tmp_path) -> None:
    assert launch(_worker, 4, args=(str(tmp_path),), timeout=300) == [len(CHAINS)] * 4
