"""``zero-strategy bench`` starts its ranks with torchrun where torch has it, else with its own
launcher: both run the same rank program, meet in one gloo group, and report a failing rank."""

from __future__ import annotations

import os

import pytest

from zero_strategy.bench.ranks import choose_launcher, has_torchrun, start_ranks
from zero_strategy.testing.launcher import RankFailure


def _whoami(rank: int, world: int, fail_rank: int) -> dict:
    import torch
    import torch.distributed as dist

    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "group": dist.get_world_size(), "sum": float(t), "pid": os.getpid(),
            "torchrun": "TORCHELASTIC_RUN_ID" in os.environ}  # fmt: skip


@pytest.mark.parametrize("launcher", ["torchrun", "own"])
def test_bench_ranks_start_with_torchrun_or_the_own_launcher(launcher: str) -> None:
    got = start_ranks(_whoami, 2, args=(-1,), launcher=launcher, timeout=120)
    assert [g["rank"] for g in got] == [0, 1] and {g["world"] for g in got} == {g["group"] for g in got} == {2}
    assert [g["sum"] for g in got] == [3.0, 3.0]  # 1 + 2 through the group
    assert len({g["pid"] for g in got} | {os.getpid()}) == 3
    assert [g["torchrun"] for g in got] == [launcher == "torchrun"] * 2  # torch's elastic agent started them


def test_auto_picks_torchrun_here_and_a_failing_rank_fails_the_torchrun_launch() -> None:
    assert has_torchrun() and choose_launcher("auto") == "torchrun"
    with pytest.raises(ValueError, match="--launcher"):
        choose_launcher("mpirun")
    with pytest.raises(RankFailure, match="fails on purpose"):
        start_ranks(_whoami, 2, args=(1,), launcher="torchrun", timeout=120)
