"""The secondary partition (ZeRO++ hpZ, ``zero_hpz_partition_size``) against the DDP oracle:
4 ranks, ZeRO-3 with every unit freed after use, secondary shards within groups of 2 ranks, in
one launch.

Every cell also checks (``parity.check_hpz``) the 2-rank groups and the secondary bytes held
(1/k of each freed unit), and here, by wrapping the all-gather, that every parameter gather in
the backward ran in the 2-rank group and every one in the forward in the shard group: a run
that still gathered over 4 ranks in the backward cannot pass. The same launch refuses a
partition size that does not divide the shard group's size, naming the valid sizes.
"""

from __future__ import annotations

CELLS: list[dict] = [
    {},
    {"accum": "plain", "clip": 0.05},
    {"accum": "no_sync", "clip": 0.05, "prefetch": 0, "optim": "sgd"},
    {"ckpt": "reentrant"},  # the recomputation in the backward gathers from the secondary shards
    {"ckpt": "nonreentrant", "evals": True},  # no-grad forwards after each step keep no secondary shard
    {"reuse": True, "impl": "native"},  # a unit that runs twice per forward
    {"shard_size": 4, "offload": "param"},  # MiCS's one group of all ranks: the flat layout
    {"shard_size": 2, "optim": "sgd"},  # k == the shard group's size: a no-op, gathers stay in the group
]


def _worker(rank: int, world: int) -> int:
    import torch

    import zero_strategy as zs
    from zero_strategy.comm import collectives as C
    from zero_strategy.testing import run_subtests
    from zero_strategy.testing.parity import Cell, Net, compare

    seen: list[tuple[int, bool]] = []  # (group size, in a backward) of each parameter all-gather
    plain = C.all_gather

    def counted(ctx, out, inp, *, what):
        if what.startswith("parameters of unit"):
            seen.append((ctx.world_size, torch._C._current_graph_task_id() != -1))
        return plain(ctx, out, inp, what=what)

    C.all_gather = counted

    def one(**kw) -> None:
        c = Cell(dtype="float32", stage=3, persist=0, steps=3, hpz=2, **kw)
        seen.clear()
        compare(c, rank, world)
        s = c.shard_size or world
        back, fwd = {n for n, b in seen if b}, {n for n, b in seen if not b}
        want_back = {s} if s == c.hpz else {c.hpz}
        # a unit that runs twice in a forward is freed in between in the first step (its reuse is
        # not known yet), and its second gather finds the secondary shard of the first
        want_fwd = {s} | (want_back if c.reuse else set())
        if back != want_back or fwd != want_fwd:
            raise AssertionError(
                f"parameter all-gathers over {sorted(back)} ranks in the backward (want "
                f"{sorted(want_back)}), over {sorted(fwd)} in the forward (want {sorted(want_fwd)})"
            )

    run_subtests(one, CELLS, label="hpZ, 4 ranks, k = 2")
    C.all_gather = plain
    # a partition size that does not divide the shard group's size is refused at initialize,
    # before the model is touched, naming the valid sizes
    for shard_size, k, valid in ((None, 3, "1, 2, 4"), (2, 4, "1, 2")):
        model = Net(Cell())
        cfg = zs.ZeroConfig(stage=3, shard_size=shard_size, zero_hpz_partition_size=k)
        try:
            zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        except ValueError as e:
            if f"zero_hpz_partition_size={k}" not in str(e) or f"valid sizes: {valid}" not in str(e):
                raise AssertionError(f"the refusal does not name the valid sizes {valid}: {e}") from e
        else:
            raise AssertionError(f"zero_hpz_partition_size={k} at shard size {shard_size or world} was accepted")
        if not all(p.numel() == 0 or not torch.isnan(p).any() for p in model.parameters()):
            raise AssertionError("a refused initialize left placeholders in the model")
    return len(CELLS)


def test_hpz_matches_ddp(launch) -> None:
    assert launch(_worker, 4, timeout=300) == [len(CELLS)] * 4
