"""Sharded checkpoints: save with N ranks at stage S, load with M ranks at stage S', continue
exactly as the uninterrupted run (global batch 12, data indexed by global step)."""

from __future__ import annotations

from zero_strategy.testing import assert_close, assert_state_close

GLOBAL_BATCH, K = 12, 3


def _target_stage(s: int, m: int) -> int:
    """The target stage of a saved stage ``s`` loaded at world size ``m`` in the float64 grid."""
    return (s + m) % 3 + 1


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


def _checkpoint_worker(rank: int, world: int, tmp: str, fp32_cells: list | None = None) -> int:
    """float64: every saved (N, S) loaded at every world size M, the stage S' rotating with
    (S, M) so that every pair of the four factors (N, S, M, S') occurs (48 of the 144 cells;
    each (S, S') transition at each N and each M); or, with ``fp32_cells``, fp32 for those cells.
    Returns the number of cells checked on this rank."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    checked = 0
    wanted = None if fp32_cells is None else {tuple(c) for c in fp32_cells}

    def build(stage: int, group):
        torch.manual_seed(0)
        model = Net(Cell()) if fp32_cells else Net(Cell()).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        cfg = zs.ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_param_persistence_threshold=0)
        return zs.initialize(model, opt, config=cfg, process_group=group)

    for n in range(1, world + 1):
        for s in (1, 2, 3):
            if wanted is not None and not any(c[:2] == (n, s) for c in wanted):
                continue
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
                    if wanted is not None and (n, s, m, s2) not in wanted:
                        continue
                    if wanted is None and s2 != _target_stage(s, m):
                        continue
                    if rank < m:
                        model, opt = build(s2, groups[m])
                        extra = zs.load_checkpoint(path, model, opt)
                        assert extra == {"n": n, "s": s}, extra
                        losses = _run(model, opt, groups[m], rank, m, range(K, 2 * K))
                        state = _state(model)
                        where = f"saved n={n} stage {s}, loaded m={m} stage {s2}"
                        if wanted is not None:  # fp32: losses within 1e-6; parameters |a - b| <= 1e-6 |b| + 1e-7
                            # (atol for elements near zero: the reduction order differs by world size)
                            assert_close(losses, ref_losses, rtol=1e-6, what=f"{where} losses")
                            assert_state_close(state, ref_state, rtol=1e-6, atol=1e-7, what=where)
                            model.zero_engine.close()
                            checked += 1
                            dist.barrier()
                            continue
                        assert_close(losses, ref_losses, rtol=1e-9, what=f"{where} losses")
                        assert_state_close(state, ref_state, rtol=1e-6, atol=1e-12, what=where)
                        model.zero_engine.close()
                        checked += 1
                    dist.barrier()
    return checked


def test_reshard_any_world_size_and_stage(launch, tmp_path) -> None:
    counts = launch(_checkpoint_worker, 4, args=(str(tmp_path),), timeout=900)
    assert counts[0] == 4 * 3 * 4  # every (N, S) -> M, with S' rotating (pairwise coverage), on rank 0


# fp32: the cells that cross world size and stage the most (the float64 test covers every pair of factors)
FP32_CELLS = [(1, 1, 4, 3), (2, 3, 3, 1), (2, 3, 1, 2), (3, 2, 2, 3), (4, 3, 1, 1), (4, 1, 3, 2), (2, 2, 2, 2)]


def test_reshard_fp32_within_1e6(launch, tmp_path) -> None:
    checked = launch(_checkpoint_worker, 4, args=(str(tmp_path), FP32_CELLS), timeout=300)[0]
    assert checked == len(FP32_CELLS)


def _crash_worker(rank: int, world: int, root: str, phase: str) -> list[float] | str | None:
    import os
    import signal

    import torch

    import zero_strategy as zs
    import zero_strategy.checkpoint.state as ckpt
    from zero_strategy.testing.parity import Cell, Net

    torch.manual_seed(0)
    model = Net(Cell()).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zs.initialize(model, opt, config=zs.ZeroConfig(stage=2, comm_timeout=10))
    if phase == "reference":  # uninterrupted: 2K steps
        return _run(model, opt, None, rank, world, range(2 * K))
    if phase == "crash":
        _run(model, opt, None, rank, world, range(K))
        zs.save_checkpoint(root, model, opt)  # step-3: complete
        _run(model, opt, None, rank, world, range(K, 2 * K))

        def kill(point: str, r: int) -> None:
            if point == "after_write" and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        ckpt.FAULT_HOOK = kill
        try:
            zs.save_checkpoint(root, model, opt)  # step-6: rank 1 dies in the middle
        except Exception as e:  # rank 0 sees its peer vanish
            return f"{type(e).__name__}"
        return "saved"
    # resume: the pointer still names step-3, which loads and continues exactly
    extra = zs.load_checkpoint(root, model, opt)
    assert model.zero_engine.step_count == K, model.zero_engine.step_count
    losses = _run(model, opt, None, rank, world, range(K, 2 * K))
    return [extra == {}, *losses]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(launch, tmp_path) -> None:
    import os

    root = str(tmp_path / "run")
    reference = launch(_crash_worker, 2, args=(root, "reference"), timeout=120)[0]
    crashed = launch(_crash_worker, 2, args=(root, "crash"), timeout=120, pg_timeout=15, may_die={1})
    assert crashed[1] is None and crashed[0] != "saved", crashed
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == f"step-{K}"
    resumed = launch(_crash_worker, 2, args=(root, "resume"), timeout=120)[0]
    assert resumed[0] is True
    assert_close(resumed[1:], reference[K:], rtol=1e-9, what="losses after the crash")


def _truncated_worker(rank: int, world: int, root: str) -> str:
    import os

    import torch

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    model, opt = zs.initialize(
        Net(Cell()).double(), lambda p: torch.optim.SGD(p, lr=0.1), config=zs.ZeroConfig(stage=3)
    )
    path = zs.save_checkpoint(root, model, opt, tag="t")
    torch.distributed.barrier()
    if rank == 0:
        shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
        with open(os.path.join(path, shard), "r+b") as f:
            f.truncate(10)
    torch.distributed.barrier()
    try:
        zs.load_checkpoint(root, model, opt)
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "loaded"
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    m2, o2 = zs.initialize(other, lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        zs.load_checkpoint(path, m2, o2)
    except ValueError as e:
        msg += " | " + str(e)
    return msg


def test_truncated_shard_and_other_model_are_named(launch, tmp_path) -> None:
    for msg in launch(_truncated_worker, 2, args=(str(tmp_path),), timeout=120):
        assert ".distcp" in msg and "truncated" in msg, msg
        assert "parameter '0.weight' has shape [3, 3] in the model" in msg, msg


def _check_fresh_optimizer_state(rank: int, world: int, tmp: str) -> int:
    """Resuming into a fresh optimizer creates each state tensor the checkpoint has where torch's
    own ``Optimizer.load_state_dict`` puts a loaded value (``_process_value_according_to_param_
    policy``): ``step`` as saved unless the group is fused or capturable (then float32 on the
    parameter's device), the rest in the parameter's dtype and device. Under a float64 default
    dtype a plain Adam saves a float64 ``step``, and ASGD saves scalar ``eta``/``mu``. One AdamW
    with a plain, a fused and a capturable group (capturable cannot step on CPU: the saving run's
    third group is plain). Returns the number of tensors checked."""
    import time

    import torch
    from torch.optim.optimizer import Optimizer

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    def build(cls, flags: list[dict]):
        torch.manual_seed(0)

        def make(params):
            params = list(params)
            cut = [0, len(params) // 3, 2 * len(params) // 3, len(params)]
            return cls([{"params": params[a:b], **f} for a, b, f in zip(cut, cut[1:], flags)], lr=0.1)

        return zs.initialize(Net(Cell()), make, config=zs.ZeroConfig(stage=2))

    start, checked = time.perf_counter(), 0
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cases = [(torch.optim.AdamW, [{}, {"fused": True}, {"capturable": True}]), (torch.optim.ASGD, [{}, {}, {}])]
        for i, (cls, flags) in enumerate(cases):
            model, opt = build(cls, [{} if "capturable" in f else f for f in flags])
            _run(model, opt, None, rank, world, range(1))
            zs.save_checkpoint(f"{tmp}/fresh{i}", model, opt)
            fresh_model, fresh = build(cls, flags)
            zs.load_checkpoint(f"{tmp}/fresh{i}", fresh_model, fresh)
            for flag, group, saved_group in zip(flags, fresh.param_groups, opt.param_groups, strict=True):
                policy = [{"params": [0], "fused": group.get("fused"), "capturable": group.get("capturable")}]
                for m, saved_m in zip(group["params"], saved_group["params"], strict=True):
                    where = f"{cls.__name__}({flag})"
                    assert fresh.state[m].keys() == opt.state[saved_m].keys(), (where, list(fresh.state[m]))
                    for key, value in fresh.state[m].items():
                        want = Optimizer._process_value_according_to_param_policy(
                            m, opt.state[saved_m][key], 0, policy, key=key
                        )
                        got = (value.dtype, value.device)
                        assert got == (want.dtype, want.device), (f"{where} state[{key!r}]", got, want.dtype)
                        assert torch.equal(value, want), f"{where} state[{key!r}]"
                        checked += 1
            model.zero_engine.close()
            fresh_model.zero_engine.close()
    finally:
        torch.set_default_dtype(previous)
    print(f"fresh optimizer state checks: {time.perf_counter() - start:.1f}s", flush=True)
    return checked


def _export_worker(rank: int, world: int, tmp: str) -> dict:
    import torch

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net

    torch.manual_seed(0)
    model = Net(Cell(tied=True)).double()  # tied weights: written under both names
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=zs.ZeroConfig(stage=3))
    _run(model, opt, None, rank, world, range(K))
    zs.save_checkpoint(f"{tmp}/ckpt", model, opt)
    zs.export_full(model, f"{tmp}/live.safetensors")  # collective, rank 0 writes
    zs.export_full(model, f"{tmp}/live.pt")  # torch.save of the whole dict
    state = _state(model)
    full = zs.full_state_dict(model)  # collective; rank 0 keeps the tensors
    if rank == 0:
        assert full.keys() == state.keys() and all(torch.equal(full[k], v) for k, v in state.items())
    else:
        assert full == {}, list(full)
    everywhere = zs.full_state_dict(model, rank0_only=False, dtype=torch.float32)
    assert all(everywhere[k].dtype == torch.float32 and torch.equal(everywhere[k], v.float()) for k, v in state.items())
    fresh = _check_fresh_optimizer_state(rank, world, tmp)
    assert fresh > 0, fresh
    return state


def test_export_offline_and_live_load_into_the_plain_model(launch, tmp_path) -> None:
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    from zero_strategy.testing.parity import Cell, Net

    state = launch(_export_worker, 2, args=(str(tmp_path),), timeout=120)[0]
    out = tmp_path / "offline.safetensors"
    # offline, from the checkpoint directory, through the command line (no ranks started)
    done = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "export", str(tmp_path / "ckpt"), str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    offline_pt = tmp_path / "offline.pt"
    done = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "export", str(tmp_path / "ckpt"), str(offline_pt)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for path in (out, tmp_path / "live.safetensors", offline_pt, tmp_path / "live.pt"):
        plain = Net(Cell(tied=True)).double()
        loaded = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        plain.load_state_dict(loaded, strict=True)
        for k, v in plain.state_dict().items():
            assert torch.equal(v, state[k]), (path.name, k)
