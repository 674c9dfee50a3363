"""A dropped model's engine is freed by reference counting, on 2 ranks: every cell of
``zero_strategy.testing.refcount`` (stages 1-3, CPU and NVMe offload, the memory budget, MoE,
two optimizers, ZeRO-3 with CPU offload and two optimizers, Muon with AdamW), each dropped with and without
``destroy()`` first, with Python's cyclic collector off; then ten builds and drops keep host
memory flat. One launch runs them all."""

from __future__ import annotations

from pathlib import Path

from zero_strategy.testing import run_subtests


def _worker(rank: int, world: int, root: str) -> int:
    from zero_strategy.testing.refcount import CELLS, check_freed, flat_memory

    where = Path(root)  # the same path on every rank (the config must agree); each rank swaps to its own files
    grid = [{"cell": c, "destroy": d} for c in CELLS for d in (False, True)]
    run_subtests(lambda cell, destroy: check_freed(cell, where, destroy=destroy, rank=rank), grid,
                 label=f"freed by reference counting, world {world}")  # fmt: skip
    flat_memory(where, cycles=10)
    return len(grid)


def test_a_dropped_engine_is_freed_on_two_ranks(launch, tmp_path: Path) -> None:
    from zero_strategy.testing.refcount import CELLS

    assert launch(_worker, 2, args=(str(tmp_path),), timeout=300) == [2 * len(CELLS)] * 2
