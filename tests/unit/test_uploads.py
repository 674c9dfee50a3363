"""The upload policies of the overlapped host step (``storage/uploads.py``): on CPU nothing is
overlapped (no policy); the tests' stand-in writes the destination only when waited for, with
the source's values at the time the copy was issued."""

from __future__ import annotations

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


def _feed(feed: uploads.DeferredFeed, buf: torch.Tensor, row: torch.Tensor, log: list[str]):  # type: ignore[no-untyped-def]
    return feed.run(buf, [row], lambda: buf.copy_(row), lambda: log.append("issued") or len(log))


def test_the_feed_stand_in_fills_then_issues_and_refuses_a_host_write_before_the_fence() -> None:
    feed, log = uploads.DeferredFeed(), []
    row, buf = torch.arange(4.0), torch.zeros(4)
    out, fence = _feed(feed, buf, row, log)
    assert out == 1 and log == ["issued"] and buf.tolist() == row.tolist()  # filled before the issue
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
