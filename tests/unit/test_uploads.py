"""The upload policies of the overlapped host step (``storage/uploads.py``): on CPU nothing is
overlapped (no policy); the tests' stand-in writes the destination only when waited for, with
the source's values at the time the copy was issued."""

from __future__ import annotations

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
