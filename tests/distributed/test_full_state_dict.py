"""``full_state_dict`` at ZeRO-3 gathers each unit once (issue 31, Low): it gathered a unit once
per parameter, moving a block of ten parameters ten times."""

from __future__ import annotations


def _gathers_worker(rank: int, world: int) -> list[dict]:
    import torch

    import zero_strategy as zs
    from zero_strategy.runtime.module import get_engine
    from zero_strategy.testing import run_subtests
    from zero_strategy.testing.parity import Cell, Net

    out: list[dict] = []

    def one(tied: bool, rank0_only: bool) -> None:
        torch.manual_seed(0)
        model = Net(Cell(stage=3, tied=tied)).double()
        cfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
        model, _ = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        with zs.gathered_parameters(model):
            want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        units = [u for u in get_engine(model).params.units if u.params]
        zs.reset_comm_stats()
        got = zs.full_state_dict(model, rank0_only=rank0_only)
        stats = zs.comm_stats()["all_gather"]
        if rank == 0 or not rank0_only:
            assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
            for k, v in want.items():
                assert torch.equal(got[k], v), k
        out.append({"calls": stats["calls"], "bytes": stats["bytes"], "units": len(units),
                    "unit_bytes": sum(u.full_bytes for u in units), "params": len(list(model.parameters()))})  # fmt: skip
        get_engine(model).close()

    grid = [{"tied": t, "rank0_only": r} for t in (False, True) for r in (True, False)]
    run_subtests(one, grid, label="full_state_dict gathers")
    return out


def test_full_state_dict_gathers_each_unit_once(launch) -> None:
    for cells in launch(_gathers_worker, 2, timeout=300):
        for c in cells:
            assert c["params"] > c["units"], c  # the check means something: units hold several parameters
            assert c["calls"] == c["units"], c
            # each unit's bytes once (plus its padding to equal shards and its tag)
            assert c["unit_bytes"] <= c["bytes"] < 1.1 * c["unit_bytes"], c
