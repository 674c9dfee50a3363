"""The host-sync counter (``zero_strategy.testing.syncs``) sees the calls that wait for the
device without reading a value (issue 31, item 7): boolean-mask indexing, value-sized outputs,
``repeat_interleave`` without ``output_size`` and ``torch.tensor(list, device=...)``. It counts
only the engine's own code, so the calls are compiled as if in a module of ``zero_strategy/``."""

from __future__ import annotations

import os

import torch

from zero_strategy.testing import syncs
from zero_strategy.testing.syncs import HostSyncCounter

ENGINE_FILE = os.path.join(syncs._PKG, "sharding", "_as_if_engine.py")


def _engine_code(source: str) -> dict:
    """Run ``source`` as code of a module of zero_strategy/ (the counter's test of 'ours')."""
    scope: dict = {"torch": torch}
    exec(compile(source, ENGINE_FILE, "exec"), scope)
    return scope


WAITING = {
    "t[t > 2]": "__getitem__",
    "m = t.clone(); m[t > 2] = 0": "__setitem__",
    "t.nonzero()": "nonzero",
    "torch.masked_select(t, t > 1)": "masked_select",
    "torch.where(t > 1)": "where",
    "t.repeat_interleave(torch.ones(5, dtype=torch.long))": "repeat_interleave",
    "torch.tensor([1, 2], device=t.device)": "torch.tensor(device=)",
    "torch.as_tensor([1, 2], device=t.device)": "torch.as_tensor(device=)",
    "t.tolist()": "tolist",
    # on CUDA a copy from the host that waits for the device (issue 45)
    "m = t.clone(); m[1] = 3": "__setitem__",
    "m = t.clone(); m[torch.arange(2)] = 0": "__setitem__",  # index_put_ copies the 0 to the device
    "t.to('cpu')": "to",
    "t.to(device=t.device, dtype=torch.float32)": "to",
    "t.to(t)": "to",
}
NOT_WAITING = [
    "t[torch.tensor([0, 2])]",  # integer indices: gathered on the device
    "t.repeat_interleave(torch.ones(5, dtype=torch.long), output_size=5)",
    "torch.where(t > 1, t, 0)",
    "torch.tensor([1, 2])",  # a host tensor stays on the host
    "t[1:3]",
    "t.to(torch.float32)",  # a cast: no copy between devices
    "t.to('cpu', non_blocking=True)",
    "m = t.clone(); m[1:3].fill_(2)",  # the number is a kernel argument
    "m = t.clone(); m.index_fill_(0, torch.tensor([1]), 2)",
    "m = t.clone(); m[torch.arange(2)] = torch.zeros(2, dtype=m.dtype)",  # a tensor already on the device
]


def test_the_counter_sees_device_waits_that_read_no_value() -> None:
    factory = torch.tensor
    for source, name in WAITING.items():
        with HostSyncCounter() as c:
            _engine_code(f"t = torch.arange(5)\n{source}\n")
        assert list(c.calls) == [f"{name} sharding/_as_if_engine.py:2"], (source, dict(c.calls))
    for source in NOT_WAITING:
        with HostSyncCounter() as c:
            _engine_code(f"t = torch.arange(5)\n{source}\n")
        assert c.total == 0, (source, dict(c.calls))
    assert torch.tensor is factory  # restored on exit


def test_calls_outside_the_engine_are_not_counted() -> None:
    with HostSyncCounter() as c:
        t = torch.arange(5)
        _ = t[t > 2], torch.tensor([1], device="cpu"), t.tolist()
    assert c.total == 0, dict(c.calls)


def test_compression_region_offsets_wait_for_nothing() -> None:
    """Top-k by regions: the offsets of the chosen pairs come from host integers on the device
    (no ``repeat_interleave`` of a host-built repeats tensor), and equal the regions' columns."""
    from zero_strategy.reduction.compression import region_counts, region_offsets

    for row, region, k in ((10, 4, 2), (12, 4, 3), (3, 4, 2), (9, 3, 5)):
        with HostSyncCounter() as c:
            got = region_offsets(row, region, k, torch.device("cpu"))
        want = [r * region for r, (_, n) in enumerate(region_counts(row, region, k)) for _ in range(n)]
        assert got.tolist() == want and got.dtype == torch.int64, (row, region, k, got)
        assert c.total == 0, (row, region, k, dict(c.calls))
