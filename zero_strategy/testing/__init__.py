"""Test utilities: the multi-rank gloo launcher and worker-side subtest helpers.

Importable without pytest; only the stdlib is needed in the parent process.
"""

from zero_strategy.testing.compare import assert_close, assert_state_close, rel_error
from zero_strategy.testing.launcher import (
    LaunchTimeout,
    RankFailure,
    TeardownAbort,
    TeardownAbortWarning,
    launch,
    teardown_aborts,
    torchrun_teardown_abort,
)
from zero_strategy.testing.subtests import SubtestFailure, run_subtests, subtest_grid

__all__ = [
    "assert_close",
    "assert_state_close",
    "rel_error",
    "LaunchTimeout",
    "RankFailure",
    "SubtestFailure",
    "TeardownAbort",
    "TeardownAbortWarning",
    "launch",
    "run_subtests",
    "subtest_grid",
    "teardown_aborts",
    "torchrun_teardown_abort",
]
