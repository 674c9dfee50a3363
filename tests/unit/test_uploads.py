"""The upload policies of the overlapped host step (``storage/uploads.py``): on CPU nothing is
overlapped (no policy); the tests' stand-in writes the destination only when waited for, with
the source's values at the time the copy was issued."""

from __future__ import annotations

import os

import pytest
import torch

from zero_strategy.storage import uploads


def test_cpu_has_no_upload_policy_unless_the_tests_ask(monkeypatch) -> None:
    monkeypatch.delenv("ZERO_STRATEGY_TEST_HOST_COPIES", raising=False)
    assert uploads.choose(torch.device("cpu")) is None
    monkeypatch.setenv("ZERO_STRATEGY_TEST_HOST_COPIES", "deferred")
    assert isinstance(uploads.choose(torch.device("cpu")), uploads.DeferredUpload)


def test_the_stand_in_writes_at_the_wait_what_the_source_held_at_the_start() -> None:
    dst, src = torch.zeros(4, dtype=torch.bfloat16), torch.arange(4.0)
    pending = uploads.DeferredUpload().start([dst], [src])
    src.add_(100.0)  # the host writes the masters again: the copy already read them
    assert dst.eq(0).all()
    pending.device_wait()
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]
    dst.zero_()
    pending.host_wait()  # once only: a second wait does not write again
    assert dst.eq(0).all()


def test_cpu_has_no_feed_unless_the_tests_ask(monkeypatch) -> None:
    monkeypatch.delenv("ZERO_STRATEGY_TEST_HOST_COPIES", raising=False)
    assert uploads.choose_feed(torch.device("cpu")) is None
    monkeypatch.setenv("ZERO_STRATEGY_TEST_HOST_COPIES", "deferred")
    assert isinstance(uploads.choose_feed(torch.device("cpu")), uploads.DeferredFeed)


class _Issued:
    """A collective's handle as the feed sees it: ``local`` (a group of one rank: nothing in
    flight) and the steps its ``wait`` runs at the end."""

    def __init__(self, n: int, local: bool = False) -> None:
        self.n, self.local, self.after = n, local, []

    def then(self, step) -> None:  # type: ignore[no-untyped-def]
        self.after.append(step)

    def wait(self) -> None:
        for step in self.after:
            step()


def _feed(feed: uploads.DeferredFeed, buf: torch.Tensor, row: torch.Tensor, log: list[str], local: bool = False):  # type: ignore[no-untyped-def]
    return feed.run(buf, [row], lambda: buf.copy_(row), lambda: log.append("issued") or _Issued(len(log), local))


def test_the_feed_stand_in_fills_then_issues_and_refuses_a_host_write_before_the_fence() -> None:
    feed, log = uploads.DeferredFeed(), []
    row, buf = torch.arange(4.0), torch.zeros(4)
    out, fence = _feed(feed, buf, row, log)
    assert out.n == 1 and log == ["issued"] and buf.tolist() == row.tolist()  # filled before the issue
    row.add_(1.0)  # the host writes the row while its copy is pending: the next gather says so
    with pytest.raises(RuntimeError, match="still pending"):
        _feed(feed, torch.zeros(4), torch.ones(4), log)
    row.sub_(1.0)
    fence()  # after the fence the host may write the row
    row.mul_(2.0)
    _feed(feed, torch.zeros(4), torch.ones(4), log)
    _, fence = _feed(feed, buf, row, log)
    _, fence2 = _feed(feed, buf, row, log)  # a later copy from the same memory supersedes the first
    fence()  # the superseded fence checks nothing
    assert feed.pending == 2
    row.zero_()
    with pytest.raises(RuntimeError, match="still pending"):
        fence2()
    fence2()  # once only


def test_a_one_rank_gather_shows_its_rows_only_after_the_wait() -> None:
    """A group of one rank issues no collective, so nothing but the handle's wait orders its
    reader after the side stream's copy: the stand-in hides the rows until that wait."""
    feed, row, buf = uploads.DeferredFeed(), torch.arange(4.0), torch.zeros(4)
    handle, fence = _feed(feed, buf, row, [], local=True)
    assert buf.isnan().all()  # all-ones bytes: what a reader that skipped the wait could see
    handle.wait()
    assert buf.tolist() == row.tolist()
    fence()
    handle, _ = _feed(feed, buf.zero_(), row, [])  # a collective in flight reads the buffer: filled at once
    assert buf.tolist() == row.tolist()


def test_the_overlap_switch_turns_every_host_copy_back_into_a_blocking_one(monkeypatch) -> None:
    """``ZERO_STRATEGY_OFFLOAD_OVERLAP=0``: no side-stream policy on CUDA (the uploads of the
    host step, the feeds of the gathers, the gradients' copies to the host)."""
    from zero_strategy.reduction import host_copies

    cuda = torch.device("cuda", 0)  # only named: no policy touches the device when it is chosen
    monkeypatch.delenv("ZERO_STRATEGY_TEST_HOST_COPIES", raising=False)
    monkeypatch.delenv("ZERO_STRATEGY_OFFLOAD_OVERLAP", raising=False)
    assert isinstance(uploads.choose(cuda), uploads.StreamUpload)
    assert isinstance(uploads.choose_feed(cuda), uploads.StreamFeed)
    assert isinstance(host_copies.choose(cuda), host_copies.StreamCopy)
    monkeypatch.setenv("ZERO_STRATEGY_OFFLOAD_OVERLAP", "0")
    assert uploads.choose(cuda) is None and uploads.choose_feed(cuda) is None and host_copies.choose(cuda) is None


def test_the_overlap_bench_runs_as_documented() -> None:
    """``bench/bench_offload_overlap.py --tiny``: its smoke run (on CPU both rows take one path)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "bench/bench_offload_overlap.py", "--tiny", "--steps", "1", "--warmup", "1",
           "--repeats", "1", "--seq", "16", "--batch", "2"]  # fmt: skip
    out = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(root)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| zero")]
    assert len(rows) == 3, out.stdout
