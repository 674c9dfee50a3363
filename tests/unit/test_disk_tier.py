"""The disk tier's files in one process: where they are, that they are removed (destroy, an
exception, a killed run found at the next start), checked (size, owner, free space) and that
``O_DIRECT`` is used where the filesystem allows it and tmpfs is named."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.storage.disk import (
    OWNER,
    DiskFile,
    SwapDir,
    _is_tmpfs,
    _machine,
    _proc_start,
    clean_stale_runs,
    swap_root_name,
)
from zero_strategy.testing import assert_close


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, foreach=False)  # the per-tensor loop in both runs: bit-equal


def _setup(tmp_path, stage: int = 2, opt=_adamw, **extra):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), **extra}
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "offload_optimizer": nvme}}
    return zs.initialize(_model(), opt, config=cfg)


def _train(model, opt, steps: int = 3) -> list[float]:
    losses = []
    for s in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_swap_files_hold_the_state_and_go_away_with_the_engine(tmp_path) -> None:
    ref_model, ref_opt = zs.initialize(
        _model(), _adamw, config={"zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}
    )
    model, opt = _setup(tmp_path)
    assert _train(model, opt) == _train(ref_model, ref_opt)  # bit-equal: the same kernel on the same numbers
    swapped = model.zero_engine.swapped
    files = [f.path for f in swapped.files.values()]
    assert len(files) >= 2 and all(os.path.getsize(f) > 0 for f in files)
    assert swapped.dir.path.startswith(str(tmp_path / swap_root_name()))
    if not _is_tmpfs(str(tmp_path)):
        assert swapped.dir.direct  # O_DIRECT where the filesystem allows it
    # between steps the optimizer holds only the small entries; the moments are in the files
    assert all(set(st) == {"step"} for st in opt.state.values()), [set(st) for st in opt.state.values()]
    stats = model.zero_engine.memory_stats()
    assert stats["tier_disk"] == sum(os.path.getsize(f) for f in files) > 0 and stats["swap_buffers"] > 0
    zs.destroy(model)
    assert not os.path.exists(swapped.dir.path)


def test_files_are_checked_before_they_are_read(tmp_path) -> None:
    model, opt = _setup(tmp_path)
    _train(model, opt, 1)
    f = next(iter(model.zero_engine.swapped.files.values()))
    os.truncate(f.path, 4096)
    with pytest.raises(RuntimeError, match=r"swap file .* has 4096 bytes, expected \d+; it was changed or truncated"):
        _train(model, opt, 1)
    model2, opt2 = _setup(tmp_path)
    _train(model2, opt2, 1)
    marker = os.path.join(model2.zero_engine.swapped.dir.path, OWNER)
    with open(marker) as fh:
        owner = json.load(fh)
    with open(marker, "w") as fh:
        json.dump({**owner, "run": "someone-else"}, fh)
    with pytest.raises(RuntimeError, match="belongs to run 'someone-else'.*Use a separate nvme_path per job"):
        _train(model2, opt2, 1)


def test_too_small_a_disk_fails_before_the_first_step(tmp_path, monkeypatch) -> None:
    import shutil

    model, opt = _setup(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    with pytest.raises(
        RuntimeError, match=r"swap files need .* GiB in .* but only .* GiB are free \(\d+ bytes needed, 100 free\)"
    ):
        _train(model, opt, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was stepped


def test_space_is_reserved_where_fallocate_is_unsupported(tmp_path, monkeypatch) -> None:
    """NFS and some FUSE filesystems cannot allocate ahead: glibc's fallback then writes through
    the ``O_DIRECT`` descriptor and fails with EINVAL. The file must still take its space (not
    stay sparse, for a full disk to fail mid-step), or the reservation fails naming the file."""
    d = SwapDir(str(tmp_path), rank=0)

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    f = DiskFile(os.path.join(d.path, "group0.swap"), 3 * 2**20 + 100, d.direct)
    d.reserve(f)
    st = os.stat(f.path)
    assert st.st_size == f.nbytes and st.st_blocks * 512 >= f.nbytes, (st.st_size, st.st_blocks * 512, f.nbytes)

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    g = DiskFile(os.path.join(d.path, "group1.swap"), 2**20, d.direct)
    with pytest.raises(RuntimeError, match=f"no space for the swap file {re.escape(g.path)} \\(1048576 bytes"):
        d.reserve(g)
    f.close()
    g.close()
    d.remove()


def test_a_killed_runs_files_are_removed_at_the_next_start_and_an_exception_removes_ours(tmp_path) -> None:
    # a run killed by SIGKILL: its directory stays, with an owner marker naming a dead process
    script = textwrap.dedent(f"""
        import os, signal, torch, zero_strategy as zs
        from torch import nn
        m, o = zs.initialize(nn.Linear(4, 4), lambda p: torch.optim.Adam(p),
                             config={{"zero_optimization": {{"stage": 1, "offload_optimizer": {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}}}}})
        m(torch.randn(2, 4)).sum().backward(); o.step()
        print(m.zero_engine.swapped.dir.path, flush=True)
        if os.environ["HOW"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the training loop failed")
    """)
    killed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "HOW": "kill"}
    )
    left = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(left), (killed.returncode, killed.stderr[-2000:])
    alive = tmp_path / swap_root_name() / "alive-run"
    alive.mkdir()
    (alive / OWNER).write_text(json.dumps({**_machine(), "pid": os.getpid(), "start": _proc_start(os.getpid())}))
    elsewhere = tmp_path / swap_root_name() / "other-namespace"  # a dead pid, but in another pid namespace
    elsewhere.mkdir()
    (elsewhere / OWNER).write_text(json.dumps({**_machine(), "pidns": "pid:[1]", "pid": 999999999, "start": "0"}))
    assert clean_stale_runs(str(tmp_path)) == [left]  # the dead owner's directory goes, the live one stays
    assert not os.path.exists(left) and alive.exists() and elsewhere.exists()
    raised = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "HOW": "raise"}
    )
    assert raised.returncode == 1 and "the training loop failed" in raised.stderr
    assert not os.path.exists(raised.stdout.strip())  # removed at exit after the exception


def test_tmpfs_is_named_and_the_default_path_is_logged(tmp_path) -> None:
    from zero_strategy.storage import disk

    disk._LOGGED.clear()  # logged once per process and root
    if os.path.isdir("/dev/shm") and _is_tmpfs("/dev/shm"):
        with pytest.warns(UserWarning, match="is on tmpfs: the 'disk' is RAM and O_DIRECT fails there"):
            d = SwapDir("/dev/shm", rank=0)
        d.remove()
        assert not os.path.exists(d.path)
    with pytest.warns(UserWarning, match="nvme_path is not set: swap files go to"):
        d = SwapDir(None, rank=0)
    d.remove()


def test_one_step_per_step_for_user_hooks_and_gradients_kept_until_zero_grad(tmp_path) -> None:
    """The groups are stepped through torch's unhooked step: a user's step hook (an EMA, a
    logger) runs once per step; and the disk groups' gradients are still there after step()."""
    model, opt = _setup(tmp_path)
    ref_model, ref_opt = zs.initialize(
        _model(), _adamw, config={"zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}
    )
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(1))
    opt.register_step_pre_hook(lambda o, a, k: calls.append(0))
    for m, o in ((model, opt), (ref_model, ref_opt)):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        m(x).pow(2).mean().backward()
        o.step()
    assert calls == [0, 1]
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        got, want = zs.full_grad(model, p), zs.full_grad(ref_model, q)
        assert got is not None and torch.equal(got, want), n


class _CountingSGD(torch.optim.SGD):
    """A subclass that keeps a counter in its param groups before ``super().step()``: its own
    code runs once per step (torch's SGD is what the disk tier steps group by group)."""

    def step(self, closure=None):
        for g in self.param_groups:
            g["k"] = g.get("k", 0) + 1
        return super().step(closure)


class _GroupCountingSGD(torch.optim.Optimizer):
    """Its own update (no torch base class to step instead) keeps a counter in its param group,
    as schedule-free AdamW keeps ``k``: stepped in pieces, it would advance once per piece."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["k"] = g.get("k", 0) + 1
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


class _MomentumSGD(torch.optim.Optimizer):
    """A user's own element-wise optimizer with per-element state, derived from
    ``torch.optim.Optimizer`` directly: its step is the update, stepped group by group."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-g["lr"])


class _ReplacingSGD(torch.optim.SGD):
    """Overrides ``step`` without calling ``super().step()``: its own update, not SGD's."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-g["lr"])


def test_optimizer_subclasses_and_own_optimizers_step_as_without_offload(tmp_path) -> None:
    for make, state in ((lambda p: _CountingSGD(p, lr=0.1, momentum=0.9), "momentum_buffer"),
                        (lambda p: _MomentumSGD(p, lr=0.1), "buf")):  # fmt: skip
        model, opt = _setup(tmp_path, opt=make)
        ref_model, ref_opt = zs.initialize(_model(), make, config={"zero_optimization": {"stage": 2}})
        assert_close(_train(model, opt), _train(ref_model, ref_opt), rtol=1e-6, what=type(opt).__name__)
        assert all(set(st) == set() for st in opt.state.values())  # the per-element state is on disk
        assert {state} == {k for st in ref_opt.state.values() for k in st}
        assert len(model.zero_engine.swapped.files) > 1
        if isinstance(opt, _CountingSGD):
            assert [g["k"] for g in opt.param_groups] == [g["k"] for g in ref_opt.param_groups] == [3]
        zs.destroy(model)


def test_an_optimizer_with_per_group_state_or_a_replaced_step_is_refused(tmp_path) -> None:
    model, opt = _setup(tmp_path, opt=lambda p: _GroupCountingSGD(p, lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"changes its param group's \['k'\].*use offload_optimizer device 'cpu'"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "k" not in opt.param_groups[0]  # refused before the optimizer's own step; the probe left no trace
    model = _model()  # a subclass step that replaces the update: refused in initialize, before any change
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with pytest.raises(TypeError, match=r"_ReplacingSGD.step does not call super\(\).step\(\), so it replaces "
                       r"SGD.step.*Call super\(\).step\(\) in it, or use offload_optimizer device 'cpu'"):  # fmt: skip
        zs.initialize(model, lambda p: _ReplacingSGD(p, lr=0.1), config=cfg)
    assert type(model) is nn.Sequential and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_unusable_nvme_path_is_named_before_anything_changes(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(blocker)}}}
    with pytest.raises(RuntimeError, match=r"offload_optimizer.nvme_path=.*a-file.*cannot create the swap directory"):
        zs.initialize(model, _adamw, config=cfg)
    assert type(model) is nn.Sequential and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / swap_root_name())  # someone else's link where our directory goes
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    with pytest.raises(RuntimeError, match="is not a directory of this user"):
        zs.initialize(_model(), _adamw, config=cfg)


def test_the_io_clock_counts_bytes_and_the_time_the_training_thread_waited(tmp_path) -> None:
    """``io_clock()``: every swap-file read and write counts its bytes; the seconds counted as
    waited are those the calling (training) thread blocked: a synchronous read or write, or a
    wait on the pool's future, never a background write nobody waited for."""
    import time

    from zero_strategy.storage.disk import SwapPool, io_at, io_clock, wait_io

    d = SwapDir(str(tmp_path), rank=0)
    f = DiskFile(os.path.join(d.path, "clock.swap"), 2**20, d.direct)
    d.reserve(f)
    pool = SwapPool(2, f.nbytes, pinned=False)
    buf = pool.get()
    buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).to(torch.uint8))
    before = io_clock()
    t0 = time.perf_counter()
    io_at(os.pwritev, f.fd, buf, 0, "test write")  # synchronous: the caller waits
    sync_s = time.perf_counter() - t0
    mid = io_clock()
    assert mid["bytes_written"] - before["bytes_written"] == f.nbytes
    assert 0 < mid["waited_s"] - before["waited_s"] <= sync_s
    f.written = True
    other = pool.get()
    t0 = time.perf_counter()
    wait_io(pool.read(f, other))  # in the pool's thread; the wait counts
    read_s = time.perf_counter() - t0
    after = io_clock()
    assert after["bytes_read"] - mid["bytes_read"] == f.nbytes and torch.equal(other, buf)
    assert 0 < after["waited_s"] - mid["waited_s"] <= read_s
    assert after["busy_s"] - before["busy_s"] > 0
    pool.write(f, buf).result()  # nobody waits through wait_io: busy, not waited
    last = io_clock()
    assert last["waited_s"] == after["waited_s"] and last["bytes_written"] - after["bytes_written"] == f.nbytes
    pool.shutdown()
    f.close()
    d.remove()
