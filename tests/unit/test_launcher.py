"""Self-tests of the multi-rank launcher (zero_strategy.testing). Each launch is 1-2 ranks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_strategy.testing import (
    LaunchTimeout,
    RankFailure,
    SubtestFailure,
    TeardownAbortWarning,
    run_subtests,
    subtest_grid,
    teardown_aborts,
)
from zero_strategy.testing.launcher import EXIT_AFTER_RESULT_ENV

# ---------------------------------------------------------------- rank functions


def _sum_ranks(rank: int, world_size: int, offset: int, *, scale: int) -> dict[str, Any]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "sum": t.item() * scale + offset,
        "omp": os.environ["OMP_NUM_THREADS"],
        "threads": torch.get_num_threads(),
        "marker": os.environ.get("ZERO_TEST_MARKER"),
        "tensor": torch.full((2,), float(rank)),
    }


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    return rank


def _block_forever_in_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(0.05)
    return rank


def _abort_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os.abort()
    return rank


def _identity(rank: int, world_size: int) -> int:
    return rank * 10


def _failing_subtests(rank: int, world_size: int) -> None:
    def check(size: int, dtype: str) -> None:
        if size == 8 and dtype == "bf16":
            raise AssertionError("numerics diverged")

    run_subtests(check, subtest_grid(size=[4, 8], dtype=["fp32", "bf16"]), label="sharding")


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2])
def test_launch_returns_per_rank_results(launch: Callable[..., list[Any]], world_size: int) -> None:
    results = launch(
        _sum_ranks, world_size, args=(100,), kwargs={"scale": 2}, env={"ZERO_TEST_MARKER": "from-parent"}, timeout=60
    )
    expected_sum = sum(range(world_size)) * 2 + 100
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["world_size"] == world_size
        assert r["sum"] == expected_sum
        assert (r["omp"], r["threads"]) == ("1", 1)
        assert r["marker"] == "from-parent"
        assert torch.equal(r["tensor"], torch.full((2,), float(r["rank"])))


def test_rank_exception_raises_rank_failure_with_traceback(launch: Callable[..., list[Any]]) -> None:
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert not isinstance(info.value, LaunchTimeout)
    assert info.value.failed_ranks == [1]
    assert "ValueError: rank one exploded on purpose" in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on_rank_one" in message
    assert "--- rank 1: exit code 1 [no result]" in message


def test_hang_raises_launch_timeout_with_stacks(launch: Callable[..., list[Any]]) -> None:
    timeout = 8.0
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_block_forever_in_rank_one, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < timeout + 6, f"launch overran its timeout: {elapsed:.1f} s"
    assert 1 in info.value.failed_ranks
    assert "timed out after 8 s" in message
    # faulthandler's SIGUSR1 dump of rank 1 names the blocking function.
    assert "most recent call first" in message
    assert "in _block_forever_in_rank_one" in message


def test_teardown_abort_after_the_final_barrier_is_tolerated_with_warning(launch: Callable[..., list[Any]]) -> None:
    before = len(teardown_aborts)
    with pytest.warns(TeardownAbortWarning) as record:
        results = launch(_identity, 2, env={EXIT_AFTER_RESULT_ENV: "1:abort_after_barrier"}, timeout=60, pg_timeout=20)
    assert results == [0, 10]
    messages = [str(w.message) for w in record]
    assert any("rank 1 wrote its result, passed the final barrier" in m and "SIGABRT" in m for m in messages), messages
    new = teardown_aborts[before:]
    assert any(a.rank == 1 and a.returncode == -6 and "SIGABRT" in a.status for a in new), new


@pytest.mark.parametrize("how", ["abort_before_barrier", "exit1_after_barrier", "traceback_abort_after_barrier"])
def test_any_other_crash_after_the_result_is_a_failure(launch: Callable[..., list[Any]], how: str) -> None:
    """A result on disk is not a pass: an abort before the final barrier, a non-zero exit that is
    not SIGABRT, or a SIGABRT with a Python exception in the output all fail the launch."""
    with pytest.raises(RankFailure) as info:
        launch(_identity, 2, env={EXIT_AFTER_RESULT_ENV: f"1:{how}"}, timeout=60, pg_timeout=10)
    assert 1 in info.value.failed_ranks, str(info.value)  # (rank 0's barrier may fail with it)
    assert "exited non-zero after writing their result" in str(info.value)


def test_abort_before_result_is_a_failure(launch: Callable[..., list[Any]]) -> None:
    with pytest.raises(RankFailure) as info:
        launch(_abort_on_rank_one, 2, timeout=60)
    assert not isinstance(info.value, LaunchTimeout)
    assert info.value.failed_ranks == [1]
    assert "--- rank 1: killed by SIGABRT [no result]" in str(info.value)


def test_run_subtests_failure_names_config_in_rank_traceback(launch: Callable[..., list[Any]]) -> None:
    with pytest.raises(RankFailure) as info:
        launch(_failing_subtests, 1, timeout=60)
    message = str(info.value)
    assert "SubtestFailure: sharding: subtest 4/4 {'size': 8, 'dtype': 'bf16'} failed" in message
    assert "AssertionError: numerics diverged" in message


def test_subtest_grid_order_and_failure_in_process() -> None:
    grid = subtest_grid(a=[1, 2], b=("x", "y"))
    assert grid == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    seen: list[dict[str, Any]] = []

    def check(a: int, b: str) -> None:
        seen.append({"a": a, "b": b})
        if (a, b) == (2, "x"):
            raise KeyError("boom")

    with pytest.raises(SubtestFailure) as info:
        run_subtests(check, grid)
    assert seen == grid[:3]  # stops at the first failure
    assert info.value.config == {"a": 2, "b": "x"} and info.value.index == 2
    assert str(info.value) == "subtest 3/4 {'a': 2, 'b': 'x'} failed: KeyError: 'boom'"
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(TypeError, match="axis 'a'"):
        subtest_grid(a={1, 2})  # type: ignore[arg-type]


def test_launch_rejects_nested_functions(launch: Callable[..., list[Any]]) -> None:
    def nested(rank: int, world_size: int) -> None:
        return None

    with pytest.raises(ValueError, match="module-level function"):
        launch(nested, 1)
