"""Offload against the DDP oracle: the optimizer side on the host at ZeRO-1/2/3 (all of it or
half), ZeRO-3's parameter rows on the host, the optimizer state on disk, and ZeRO-3's rows on disk (with the
optimizer on the host, or on disk too), with accumulation and clipping, at world sizes
1 and 2. Every cell also checks where ``memory_stats()`` says the bytes are (``check_tiers``):
on a machine without a GPU the host and the device are the same memory, so parity alone would
pass even if nothing moved."""

from __future__ import annotations

import pytest

from zero_strategy.testing import run_subtests


def _cells(world: int) -> list[dict]:
    cells = []
    for stage in (1, 2, 3):
        for off in ("cpu", "param") if stage == 3 else ("cpu",):
            cells += [
                {"stage": stage, "offload": off},
                {"stage": stage, "offload": off, "accum": "no_sync", "clip": 0.05, "optim": "adam"},
                {"stage": stage, "offload": off, "accum": "plain", "frozen": True, "optim": "sgd"},
                {"stage": stage, "offload": off, "dtype": "float32", "clip": 0.05, "tied": True},
            ]
        cells.append({"stage": stage, "offload": "cpu_half", "accum": "no_sync", "clip": 0.05})
        cells += [  # the disk tier: optimizer state in swap files
            {"stage": stage, "offload": "nvme", "accum": "no_sync", "clip": 0.05},
            {"stage": stage, "offload": "nvme", "dtype": "float32", "optim": "adam", "frozen": True},
        ]
    cells += [  # other state than Adam's: SGD's momentum buffer, Adagrad's sum (filled at construction)
        {"stage": 2, "offload": "nvme", "optim": "sgd", "accum": "no_sync", "steps": 6},
        {"stage": 3, "offload": "nvme", "optim": "adagrad", "groups": True, "steps": 6},
    ]
    cells += [  # ZeRO-3's rows on disk: with the optimizer on the host (the design notes' template), and both on disk
        {"stage": 3, "offload": "param_nvme", "accum": "no_sync", "clip": 0.05},
        {"stage": 3, "offload": "param_nvme", "dtype": "float32", "optim": "adam", "frozen": True, "tied": True},
        {"stage": 3, "offload": "all_nvme", "accum": "plain", "clip": 0.05, "frozen": True},
        {"stage": 3, "offload": "all_nvme", "dtype": "float32", "optim": "adam", "tied": True},
    ]
    if world == 2:  # the native (NCCL) collective path and no overlap
        cells += [{"stage": 2, "offload": "cpu", "impl": "native"}, {"stage": 3, "offload": "param", "overlap": False}]
    return cells


def _offload_worker(rank: int, world: int) -> int:
    from zero_strategy.testing.parity import Cell, compare

    cells = _cells(world)
    run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label=f"offload parity, world {world}")
    if world == 2:
        run_subtests(lambda stage: _subclass_runs_once_per_step(stage, rank), [{"stage": s} for s in (1, 2, 3)],
                     label="an optimizer subclass with the optimizer on NVMe")  # fmt: skip
    return len(cells)


def _ema_adamw() -> type:
    import torch

    class EmaAdamW(torch.optim.AdamW):
        """A subclass with code after ``super().step()``: a step counter and an EMA of every
        parameter it steps (a common pattern). Both must run once per ``step()`` call."""

        def __init__(self, params, **kw) -> None:
            super().__init__(params, **kw)
            self.count = 0
            self.ema: dict[int, torch.Tensor] = {}

        def step(self, closure=None):
            loss = super().step(closure)
            self.count += 1
            for group in self.param_groups:
                for p in group["params"]:
                    k = id(p)
                    self.ema[k] = p.detach().clone() if k not in self.ema else self.ema[k].lerp(p.detach(), 0.5)
            return loss

    return EmaAdamW


def _subclass_runs_once_per_step(stage: int, rank: int) -> None:
    """The counter and the EMA of :func:`_ema_adamw` with the optimizer state on disk equal
    their values without offload (the disk tier steps torch's AdamW group by group, and the
    subclass's own code runs once, around the whole step)."""
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.testing import assert_close
    from zero_strategy.testing.parity import OFFLOADS, VOCAB, Cell, Net, batch

    got = {}
    for off in ("none", "nvme"):
        torch.manual_seed(0)
        model = Net(Cell()).double()
        opt = _ema_adamw()(model.parameters(), lr=1e-2, weight_decay=0.1)
        cfg = zs.ZeroConfig(stage=stage, reduce_bucket_size=700, stage3_param_persistence_threshold=0, **OFFLOADS[off])
        model, opt = zs.initialize(model, opt, config=cfg)
        for step in range(3):
            x, y = batch(step, 0, rank)
            F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        if off == "nvme":
            assert len(model.zero_engine.swapped.files) > 1, "want several groups on disk"
        got[off] = (opt.count, [opt.ema[id(p)] for g in opt.param_groups for p in g["params"]])
        zs.destroy(model)
    assert got["nvme"][0] == got["none"][0] == 3, f"post-step code ran {got['nvme'][0]} times in 3 steps"
    assert_close(got["nvme"][1], got["none"][1], rtol=1e-12, what=f"rank {rank}: the EMA with the state on disk")


@pytest.mark.parametrize("world", [1, 2])
def test_offload_matches_ddp(launch, world: int) -> None:
    counts = launch(_offload_worker, world, timeout=600)
    assert counts == [len(_cells(world))] * world


# (saved world, stage, offload) -> (loaded world, stage, offload): offloaded state reshards to and
# from runs without offload, across world sizes and stages
CKPT_CELLS = [
    ((2, 2, "cpu"), (1, 3, "none")),
    ((2, 3, "param"), (2, 1, "cpu")),
    ((1, 3, "none"), (2, 3, "param")),
    ((2, 1, "cpu_half"), (2, 2, "cpu")),
    ((2, 3, "cpu"), (2, 3, "none")),
    ((2, 2, "nvme"), (1, 3, "none")),  # the disk tier saves from and loads into its swap files
    ((1, 1, "none"), (2, 3, "nvme")),
    ((2, 3, "nvme"), (2, 1, "nvme")),
    ((2, 3, "all_nvme"), (1, 3, "none")),  # rows on disk: saved from and loaded into memory maps of their files
    ((1, 2, "none"), (2, 3, "param_nvme")),
    ((2, 3, "param_nvme"), (2, 3, "all_nvme")),
]


def _offload_checkpoint_worker(rank: int, world: int, tmp: str) -> int:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from tests.distributed.test_checkpoint import K, _run, _state
    from zero_strategy.testing import assert_close, assert_state_close
    from zero_strategy.testing.parity import OFFLOADS, Cell, Net, check_tiers

    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}

    def build(n: int, stage: int, offload: str):
        torch.manual_seed(0)
        model = Net(Cell()).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        cfg = zs.ZeroConfig(
            stage=stage, reduce_bucket_size=700, stage3_param_persistence_threshold=0, **OFFLOADS[offload]
        )
        return zs.initialize(model, opt, config=cfg, process_group=groups[n])

    checked = 0
    for k, ((n, s, off), (m, s2, off2)) in enumerate(CKPT_CELLS):
        path = f"{tmp}/cell{k}"
        ref: list = [None]
        if rank < n:
            model, opt = build(n, s, off)
            _run(model, opt, groups[n], rank, n, range(K))
            zs.save_checkpoint(path, model, opt)
            ref = [(_run(model, opt, groups[n], rank, n, range(K, 2 * K)), _state(model))]
            model.zero_engine.close()
        dist.barrier()
        dist.broadcast_object_list(ref, src=0)
        ref_losses, ref_state = ref[0]
        if rank < m:
            model, opt = build(m, s2, off2)
            zs.load_checkpoint(path, model, opt)
            engine = model.zero_engine
            files = engine.disk.file_paths()
            check_tiers(Cell(stage=s2, offload=off2), engine.memory_stats(), files)  # loaded where the policy says
            losses = _run(model, opt, groups[m], rank, m, range(K, 2 * K))
            where = f"saved n={n} stage {s} offload {off}, loaded m={m} stage {s2} offload {off2}"
            assert_close(losses, ref_losses, rtol=1e-9, what=f"{where} losses")
            assert_state_close(_state(model), ref_state, rtol=1e-6, atol=1e-12, what=where)
            model.zero_engine.close()
            checked += 1
        dist.barrier()
    return checked


def test_offloaded_checkpoints_reshard_to_and_from_plain_runs(launch, tmp_path) -> None:
    counts = launch(_offload_checkpoint_worker, 2, args=(str(tmp_path),), timeout=600)
    assert counts == [len(CKPT_CELLS), sum(m == 2 for _, (m, _, _) in CKPT_CELLS)]


def _disk_failure_worker(rank: int, world: int, tmp: str) -> dict:
    """Rank 1's swap file is damaged between steps: every rank raises at the next step, at once,
    instead of rank 0 waiting in the next collective until the timeout."""
    import os
    import time

    import torch

    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, Net, batch

    torch.manual_seed(0)
    model = Net(Cell())
    cfg = zs.ZeroConfig(stage=2, reduce_bucket_size=700, comm_timeout=120,
                        offload_optimizer={"device": "nvme", "nvme_path": tmp})  # fmt: skip
    model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config=cfg)
    x, _ = batch(0, 0, rank)
    for step in range(2):
        model(x).sum().backward()
        if step == 1 and rank == 1:
            f = next(iter(model.zero_engine.swapped.files.values()))
            os.truncate(f.path, 0)
        t0 = time.perf_counter()
        try:
            opt.step()
        except RuntimeError as e:
            return {"step": step, "error": str(e), "seconds": time.perf_counter() - t0}
        opt.zero_grad()
    return {"step": None}


def test_a_damaged_swap_file_on_one_rank_stops_every_rank_at_once(launch, tmp_path) -> None:
    r0, r1 = launch(_disk_failure_worker, 2, args=(str(tmp_path),), timeout=120)
    assert r1["step"] == 1 and "swap file" in r1["error"] and "truncated" in r1["error"], r1
    assert r0["step"] == 1 and r0["error"].startswith("optimizer.step(): rank 1 failed (disk tier step"), r0
    assert "swap file" in r0["error"] and r0["seconds"] < 30, r0


def _deferred_copies_worker(rank: int, world: int) -> dict:
    """The non-blocking host copies of offloaded gradient shards (``host_copies.py``) with the
    CPU stand-in that writes each copy only when it is waited for: a host reader that does not
    wait gets stale bytes, and parity fails."""
    import os

    from zero_strategy.reduction import host_copies
    from zero_strategy.testing.parity import Cell, compare

    os.environ["ZERO_STRATEGY_TEST_HOST_COPIES"] = "deferred"
    counts = {"direct": 0, "staged": 0}
    start = host_copies.HostCopies.start

    def counted(self, g, reduced) -> None:
        counts["staged" if g.grad_valid else "direct"] += 1
        start(self, g, reduced)

    host_copies.HostCopies.start = counted  # type: ignore[method-assign]
    cells = [
        {"stage": 2, "offload": "cpu", "accum": "plain", "clip": 0.05, "optim": "adam"},
        {"stage": 2, "offload": "cpu", "accum": "no_sync", "frozen": True, "optim": "sgd"},
        {"stage": 2, "offload": "cpu", "late": True, "ckpt": "reentrant"},  # reduced again in finalize
        {"stage": 2, "offload": "cpu_half", "reduce": "bf16", "dtype": "float32"},
        {"stage": 2, "offload": "cpu", "overlap": False, "unused": "some_ranks"},
        {"stage": 3, "offload": "param", "accum": "plain", "tied": True},
        {"stage": 3, "offload": "cpu", "accum": "no_sync", "clip": 0.05, "dtype": "float32", "optim": "adam"},
    ]
    run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label="deferred host copies")
    return counts


def test_offloaded_gradients_reach_the_host_without_a_blocking_copy(launch) -> None:
    for counts in launch(_deferred_copies_worker, 2, timeout=300):
        assert counts["direct"] > 0 and counts["staged"] > 0, counts


def _overlapped_host_step_worker(rank: int, world: int) -> dict:
    """ZeRO-3 with the optimizer on the host steps group by group, each group's upload into its
    row issued before the next group steps (``offload/host_step.py``), with the CPU stand-in
    that writes each upload only when it is waited for: a reader of a row that does not wait
    (the next gather, a checkpoint read) gathers the previous step's values, and parity fails.
    ZeRO-1/2: each host group's copy and all-gather are issued as soon as it is stepped, through
    the feed's stand-in, which raises if the host writes masters whose copy is still pending."""
    import os

    from zero_strategy.sharding.replicated import ReplicatedParams
    from zero_strategy.storage import uploads
    from zero_strategy.testing.parity import Cell, compare

    os.environ["ZERO_STRATEGY_TEST_HOST_COPIES"] = "deferred"
    counts = {"uploads": 0, "early gathers": 0}
    start, early = uploads.DeferredUpload.start, ReplicatedParams.issue_early

    def counted(self, dsts, srcs):  # type: ignore[no-untyped-def]
        counts["uploads"] += 1
        return start(self, dsts, srcs)

    def counted_early(self, g):  # type: ignore[no-untyped-def]
        counts["early gathers"] += 1
        return early(self, g)

    uploads.DeferredUpload.start = counted  # type: ignore[method-assign]
    ReplicatedParams.issue_early = counted_early  # type: ignore[method-assign]
    cells = [
        {"stage": 3, "offload": "cpu", "steps": 4},
        {"stage": 3, "offload": "cpu", "accum": "plain", "clip": 0.05, "optim": "adam", "tied": True, "steps": 4},
        {"stage": 3, "offload": "cpu", "frozen": True, "groups": True, "persist": 10_000, "optim": "sgd", "steps": 4},
        # ZeRO-1/2: each host group's copy and all-gather issued as soon as it is stepped (replicated.py)
        {"stage": 2, "offload": "cpu", "accum": "plain", "clip": 0.05, "optim": "adam", "steps": 4},
        {"stage": 1, "offload": "cpu_half", "groups": True, "frozen": True, "steps": 4},
        {"stage": 2, "offload": "cpu", "overlap": False, "dtype": "float32", "tied": True, "steps": 4},
        # optimizer state on disk: the disk tier steps those groups, the host step the others
        {"stage": 2, "offload": "nvme", "clip": 0.05, "steps": 3},
        {"stage": 3, "offload": "nvme", "accum": "plain", "steps": 3},
        {"stage": 3, "offload": "all_nvme", "steps": 3},
    ]
    run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label="overlapped host step")
    run_subtests(
        lambda **kw: _disk_groups_after_a_host_step(rank, **kw), [{"stage": 2}, {"stage": 3}], label="disk groups"
    )
    return counts


def _disk_groups_after_a_host_step(rank: int, stage: int) -> None:
    """The optimizer state on disk: the disk tier steps its groups before the host step runs
    the others. After the step every gradient is still readable, and a second ``step()``
    without ``zero_grad`` steps every group again, as without the overlapped host step."""
    import copy
    import os

    import torch

    import zero_strategy as zs
    from zero_strategy.testing import assert_close

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    got = {}
    for copies in ("", "deferred"):  # the plain step, then the overlapped one
        os.environ["ZERO_STRATEGY_TEST_HOST_COPIES"] = copies
        model = copy.deepcopy(base)
        cfg = zs.ZeroConfig(stage=stage, offload_optimizer={"device": "nvme"}, stage3_param_persistence_threshold=0)
        net, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
        net(x).sum().backward()
        opt.step()
        grads = [zs.full_grad(model, p) for p in model.parameters()]
        opt.step()  # the same gradients again
        with zs.gathered_parameters(model):
            weights = [p.detach().clone() for p in model.parameters()]
        got[copies] = grads, weights
        zs.destroy(net)
    for i, (want, have) in enumerate(zip(*[got[""][0], got["deferred"][0]])):
        if want is None or have is None:
            raise AssertionError(f"rank {rank}: gradient {i} after the step: {have} (plain step: {want})")
        assert_close(have, want, rtol=1e-6, atol=1e-7, what=f"rank {rank}: gradient {i} after the step")
    for i, (want, have) in enumerate(zip(got[""][1], got["deferred"][1])):
        assert_close(have, want, rtol=1e-6, atol=1e-7, what=f"rank {rank}: weight {i} after two steps")


def test_host_step_overlaps_the_upload_of_each_group(launch) -> None:
    for counts in launch(_overlapped_host_step_worker, 2, timeout=300):
        assert counts["uploads"] > 0 and counts["early gathers"] > 0, counts


def _fed_gathers_worker(rank: int, world: int) -> dict:
    """ZeRO-3 gathers of rows on the host or read from disk go through a feed
    (``storage/uploads.py``): on CUDA the rows' copy and the all-gather run on a side stream,
    beside the current unit's compute. The CPU stand-in keeps each copy pending until its fence
    and raises if the host writes the rows before (the optimizer step, a load, a reused disk
    slab), as that write would race the copy engine on a GPU."""
    import os

    from zero_strategy.storage import uploads
    from zero_strategy.testing.parity import Cell, compare

    os.environ["ZERO_STRATEGY_TEST_HOST_COPIES"] = "deferred"
    counts = {"fed": 0}
    run = uploads.DeferredFeed.run

    def counted(self, buf, srcs, fill, issue):  # type: ignore[no-untyped-def]
        counts["fed"] += 1
        return run(self, buf, srcs, fill, issue)

    uploads.DeferredFeed.run = counted  # type: ignore[method-assign]
    if world == 1:  # no collective orders the reader after the copy: only the handle's wait does
        cells = [
            {"stage": 3, "offload": "param", "accum": "plain", "optim": "adam", "steps": 3},
            {"stage": 2, "offload": "cpu", "clip": 0.05, "steps": 3},
        ]
        run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label="fed gathers, one rank")
        return counts
    cells = [
        {"stage": 3, "offload": "param", "accum": "plain", "prefetch": 2, "optim": "adam", "steps": 4},
        {
            "stage": 3,
            "offload": "param",
            "persist": 10_000,
            "frozen": True,
            "ckpt": "reentrant",
            "evals": True,
            "steps": 4,
        },
        {"stage": 3, "offload": "param_nvme", "tied": True, "clip": 0.05, "steps": 4},
    ]
    run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label="fed gathers")
    return counts


def test_offloaded_rows_reach_their_gathers_through_a_fenced_feed(launch) -> None:
    for counts in launch(_fed_gathers_worker, 2, timeout=300):
        assert counts["fed"] > 0, counts
    (alone,) = launch(_fed_gathers_worker, 1, timeout=120)  # a group of one rank: the reader waits on the copy
    assert alone["fed"] > 0, alone
