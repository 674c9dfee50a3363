"""Shared pytest configuration for zero-strategy.

* ``launch`` fixture: :func:`zero_strategy.testing.launch`, the multi-rank gloo launcher.
* Skip policy: only ``@pytest.mark.gpu`` tests may skip (they skip with "needs CUDA"
  when no CUDA device is present); any other skip is reported as a failure, so a
  missing dependency or a stray ``pytest.skip`` cannot silently hide a test in CI.
  ``xfail`` outcomes are left alone. Module-level skips (``pytest.importorskip`` at
  import time) happen at collection and are not covered by this hook.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

SKIP_POLICY_MESSAGE = (
    "unexpected skip: only @pytest.mark.gpu tests may skip "
    "(install the missing dependency or mark the test gpu). Original skip reason: {reason}"
)


@pytest.fixture
def launch() -> Callable[..., list[Any]]:
    """The multi-rank launcher: ``launch(fn, world_size, args=..., timeout=...)``."""
    from zero_strategy.testing import launch as launch_fn

    return launch_fn


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_marker = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip_marker)


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_skipped_report(report: pytest.TestReport) -> None:
    report.longrepr = SKIP_POLICY_MESSAGE.format(reason=_skip_reason(report.longrepr))
    report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("gpu") is not None:
        return
    _fail_skipped_report(report)


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Generator[None, None, None]:
    """A test that leaves a default process group in the pytest process errors at teardown, and
    the group is destroyed there, so the tests after it (which initialise their own) are not
    failed by it with 'trying to initialize the default process group twice'."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "this test left a default process group in the pytest process: destroy it in the "
            "test (or run the engine through the launcher) so later tests can initialise theirs",
            pytrace=False,
        )
