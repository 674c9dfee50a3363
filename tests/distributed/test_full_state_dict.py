"""``full_state_dict`` at ZeRO-3 gathers each unit once (issue 31, Low): it gathered a unit once
per parameter, moving a block of ten parameters ten times. ``gathered_weights`` streams the same
tensors with one unit gathered at a time (issue 33 item 4)."""

from __future__ import annotations


def _gathers_worker(rank: int, world: int) -> list[dict]:
    import torch

    import zero_strategy as zs
    from zero_strategy.runtime.module import get_engine
    from zero_strategy.testing import run_subtests
    from zero_strategy.testing.parity import Cell, Net, batch

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

    def stream(stage: int, tied: bool, rank0_only: bool, inside: bool) -> None:
        import contextlib

        torch.manual_seed(0)
        model = Net(Cell(stage=stage, tied=tied)).double()
        cfg = zs.ZeroConfig(stage=stage, stage3_param_persistence_threshold=0)
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        x, _ = batch(0, 0, rank)
        model(x).double().sum().backward()  # one step: the values differ from the start
        opt.step()
        opt.zero_grad()
        want = zs.full_state_dict(model, rank0_only=False)
        engine = get_engine(model)
        units = [u for u in getattr(engine.params, "units", []) if u.params]
        largest = max((u.full_bytes for u in units), default=0)
        live, got = [], {}
        outer = zs.gathered_parameters(model) if inside else contextlib.nullcontext()
        with outer:
            for name, t in zs.gathered_weights(model, rank0_only=rank0_only):
                got[name] = t
                if stage == 3:
                    live.append(zs.memory_stats(model)["gathered"])
        after = zs.memory_stats(model).get("gathered", 0)
        if rank == 0 or not rank0_only:
            assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))  # a unit's tensors come together
            for k, v in want.items():
                assert torch.equal(got[k], v), k
                assert got[k].device.type == "cpu" and got[k].data_ptr() != 0, k
            if tied:
                assert got["head.weight"] is got["tok.weight"], "tied: one tensor under both names"
        else:
            assert got == {}, sorted(got)
        out.append({"stream": True, "stage": stage, "inside": inside, "units": len(units), "largest": largest,
                    "live_max": max(live, default=0), "all_units": sum(u.full_bytes for u in units),
                    "after": after, "yields": len(live), "receives": rank == 0 or not rank0_only})  # fmt: skip
        engine.close()

    grid = [{"tied": t, "rank0_only": r} for t in (False, True) for r in (True, False)]
    run_subtests(one, grid, label="full_state_dict gathers")
    grid = [{"stage": st, "tied": t, "rank0_only": r, "inside": i}
            for st, t, r, i in ((3, False, False, False), (3, True, True, False), (3, False, False, True),
                                (2, True, False, False))]  # fmt: skip
    run_subtests(stream, grid, label="gathered_weights")
    return out


def test_full_state_dict_gathers_each_unit_once(launch) -> None:
    for cells in launch(_gathers_worker, 2, timeout=300):
        streamed = [c for c in cells if c.get("stream")]
        assert len(streamed) == 4, cells
        for c in streamed:
            if c["stage"] != 3 or not c["receives"]:  # rank0_only: rank 1 yields nothing (checked in the worker)
                continue
            assert c["units"] > 1 and c["yields"] > 0, c  # several units: the bound means something
            if c["inside"]:  # everything gathered by the caller's block, nothing more on top
                assert c["live_max"] == c["all_units"], c
            else:  # one unit at a time, freed afterwards
                assert 0 < c["live_max"] <= c["largest"] < c["all_units"], c
            assert c["after"] == 0, c
        for c in cells:
            if c.get("stream"):
                continue
            assert c["params"] > c["units"], c  # the check means something: units hold several parameters
            assert c["calls"] == c["units"], c
            # each unit's bytes once (plus its padding to equal shards and its tag)
            assert c["unit_bytes"] <= c["bytes"] < 1.1 * c["unit_bytes"], c
