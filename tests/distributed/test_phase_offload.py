"""``offload_states`` / ``reload_states`` (issue 33 item 5): this rank's model state leaves its
storages for the host and comes back bit for bit, so training after a round trip equals
training without one, at every stage. Between the two, a forward or a step raises, naming
``reload_states``."""

from __future__ import annotations


def _worker(rank: int, world: int) -> list[dict]:
    import pytest
    import torch

    import zero_strategy as zs
    from zero_strategy.testing import run_subtests
    from zero_strategy.testing.parity import Cell, Net, batch

    out: list[dict] = []
    kinds = ("optimizer_state", "masters", "param_shards", "grad_shards", "full_grads", "params")

    def train(stage: int, round_trip: bool, include: tuple[str, ...] | None, accum: bool) -> tuple[list, dict]:
        torch.manual_seed(0)
        model = Net(Cell(stage=stage))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        cfg = zs.ZeroConfig(stage=stage, stage3_param_persistence_threshold=0)
        model, opt = zs.initialize(model, opt, config=cfg)
        losses = []
        for step in range(4):
            x, y = batch(step, 0, rank)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if accum and step == 1:  # gradients held across the round trip
                pass
            else:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            if round_trip and step in (0, 1):
                before = zs.memory_stats(model)
                moved = zs.offload_states(model, include=include)
                after = zs.memory_stats(model)
                with pytest.raises(RuntimeError, match="reload_states"):
                    model(x)
                if not (accum and step == 1):
                    with pytest.raises(RuntimeError, match="reload_states"):
                        opt.step()
                assert zs.reload_states(model) == moved
                assert zs.reload_states(model) == 0  # nothing left to reload
                out.append({"stage": stage, "include": include, "moved": moved,
                            "before": {k: before[k] for k in kinds}, "after": {k: after[k] for k in kinds}})  # fmt: skip
        full = zs.full_state_dict(model, rank0_only=False)
        state = {f"{i}.{k}": v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()
                 if isinstance(v, torch.Tensor)}  # fmt: skip
        from zero_strategy.runtime.module import get_engine

        get_engine(model).close()
        return losses, full | state

    def one(stage: int, include: tuple[str, ...] | None, accum: bool) -> None:
        want_losses, want = train(stage, False, None, accum)
        got_losses, got = train(stage, True, include, accum)
        assert got_losses == want_losses, (got_losses, want_losses)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k  # bit for bit (NaN would fail torch.equal)

    grid = [{"stage": s, "include": None, "accum": a} for s in (1, 2, 3) for a in (False, True)]
    grid.append({"stage": 3, "include": ("optim_states",), "accum": False})
    run_subtests(one, grid, label="offload_states round trip")
    return out


def test_offload_and_reload_states_round_trip_exactly(launch) -> None:
    for cells in launch(_worker, 2, timeout=300):
        assert len(cells) == 14, len(cells)
        for c in cells:
            before, after = c["before"], c["after"]
            assert c["moved"] > 0, c
            if c["include"] is None:  # everything: no model state left in memory
                assert sum(after.values()) == 0 and sum(before.values()) > 0, c
                assert c["moved"] >= before["optimizer_state"] + before["masters"], c
            else:  # only the optimizer state
                assert after["optimizer_state"] == 0 < before["optimizer_state"], c
                assert after["param_shards"] == before["param_shards"] > 0, c
