"""The memory budget at ZeRO-3 (docs/memory_budget.md): its cache tier against the DDP oracle,
the cap on gathered bytes (memory_stats' peak and an independent probe of the units' storage,
``parity.GatheredProbe``), fewer all-gathered bytes as the cache grows, and a budget too
small for the model refused before training with each tier's bytes."""

from __future__ import annotations

# stage 3, every unit freed without a cache (persistence threshold 0, the Cell default), four blocks
_BASE = {"stage": 3, "n_blocks": 4, "dtype": "float32"}
_BRANCH = {"unused": "some_steps", "policy": "blocks"}  # `extra`, its own unit, runs on some steps: the order changes
_CELLS = [
    {"cache": "zero"},
    {"cache": "unit", "accum": "plain"},
    {"cache": "unit", "evals": True, **_BRANCH},
    {"cache": "half", "accum": "no_sync", "evals": True},
    {"cache": "half", "accum": "plain", **_BRANCH},
    {"cache": "half", "ckpt": "nonreentrant"},
    {"cache": "whole", "accum": "no_sync"},
    {"cache": "whole", "evals": True, **_BRANCH},
    {"cache": "whole", "reuse": True, "prefetch": 2},
    {"cache": "unit", "dtype": "float64", "accum": "no_sync", "prefetch": 2},
]
_SWEEP = ["none", "zero", "unit", "half", "whole"]  # the same training under growing caches


def _worker(rank: int, world: int) -> dict:
    import torch

    import zero_strategy as zs
    from zero_strategy.comm import collectives as C
    from zero_strategy.testing import parity as P
    from zero_strategy.testing import run_subtests

    cells = [{**_BASE, **c} for c in _CELLS]
    run_subtests(lambda **kw: P.compare(P.Cell(**kw), rank, world), cells, label="cache parity")

    sweep: dict[str, tuple[int, int, int]] = {}  # cache -> (gathered bytes, all_gather bytes, gathers)
    for cache in _SWEEP:
        C.reset_comm_stats()
        P.LAST_STATS.clear()
        P.compare(P.Cell(**{**_BASE, "accum": "plain", "evals": True, "steps": 4, "cache": cache}), rank, world)
        moved = int(C.comm_stats()["all_gather"]["bytes"])
        stats = P.LAST_STATS
        sweep[cache] = (stats.get("gathered_bytes", -1), moved, stats.get("gathers", -1))

    # a budget too small for the model: refused at initialize, naming each tier's bytes
    torch.manual_seed(0)
    model = P.Net(P.Cell(**_BASE))
    opt = torch.optim.AdamW(model.parameters())
    cfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, memory={"budget": "20KB", "cache": 0})
    try:
        zs.initialize(model, opt, config=cfg)
        too_small = "no error"
    except RuntimeError as exc:
        too_small = str(exc)
    return {"sweep": sweep, "too_small": too_small}


def test_cache_tier_matches_ddp_caps_gathers_and_refuses_a_budget_too_small(launch) -> None:
    out = launch(_worker, 2, timeout=600)
    for rank, got in enumerate(out):
        sweep = got["sweep"]
        gathered = [sweep[c][0] for c in _SWEEP[1:]]  # "none" has no budget, so no LAST_STATS
        moved = [sweep[c][1] for c in _SWEEP]
        # cache 0 is today's behaviour: the same all-gathered bytes as without a budget
        assert moved[0] == moved[1] > 0, (rank, sweep)
        # each larger cache moves no more, and the whole model moves strictly less than no cache
        assert all(a >= b for a, b in zip(moved[1:], moved[2:])), (rank, sweep)
        assert all(a >= b for a, b in zip(gathered, gathered[1:])), (rank, sweep)
        assert gathered[-1] < gathered[0] and moved[-1] < moved[0], (rank, sweep)
        # whole model: each of the 5 units (4 blocks and the root) once per step: in the first
        # step's forward, then in the evaluation after each of the 4 steps (the next step reuses it)
        assert sweep["whole"][2] == 5 * (1 + 4), (rank, sweep)
        msg = got["too_small"]
        assert "does not fit" in msg and "persistent" in msg and "working" in msg and "gathered" in msg, msg
        assert "Nearest settings that fit" in msg and "memory.budget of at least" in msg, msg
