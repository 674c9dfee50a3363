"""The NaN-strict comparison helpers every parity test goes through."""

from __future__ import annotations

import math

import pytest
import torch

from zero_strategy.testing import assert_close, assert_state_close, rel_error


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_fail_on_either_side(bad: float) -> None:
    for got, ref in (([1.0, bad], [1.0, 1.0]), ([1.0, 1.0], [1.0, bad]), ([bad, 1.0], [1.0, 1.0])):
        with pytest.raises(AssertionError, match="non-finite"):
            rel_error(got, ref)
        with pytest.raises(AssertionError, match="non-finite"):
            assert_close(got, ref, rtol=1e9, atol=1e9)
        with pytest.raises(AssertionError, match="non-finite"):
            assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e9, atol=1e9)
    # the trap this guards against: max() skips a NaN that follows a finite value
    assert max([0.0, math.nan]) == 0.0 and not (math.nan > 1e-6)


def test_empty_and_mismatched_inputs_fail() -> None:
    for fn in (lambda a, b: rel_error(a, b), lambda a, b: assert_close(a, b, rtol=1.0)):
        with pytest.raises(AssertionError, match="nothing to compare"):
            fn([], [])
        with pytest.raises(AssertionError, match="3 values against 2"):
            fn([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(AssertionError, match="nothing to compare"):
        assert_close(torch.empty(0), torch.empty(0), rtol=1.0)
    with pytest.raises(AssertionError, match="nothing to compare"):
        assert_state_close({}, {}, rtol=1.0)
    with pytest.raises(AssertionError, match="keys differ"):
        assert_state_close({"a": torch.ones(1)}, {"b": torch.ones(1)}, rtol=1.0)


def test_tolerances_are_inclusive_and_named() -> None:
    assert rel_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert rel_error([1.1], [1.0]) == pytest.approx(0.1)
    assert rel_error([0.0], [0.0]) == 0.0 and rel_error([1e-9], [0.0]) == math.inf
    assert rel_error([1e-9], [0.0], floor=1e-6) == pytest.approx(1e-3)
    assert_close([1.0 + 1e-7], [1.0], rtol=1e-7 + 1e-15)
    with pytest.raises(AssertionError, match=r"losses: element 1 is 2.5, the reference 2.0"):
        assert_close([1.0, 2.5], [1.0, 2.0], rtol=1e-3, what="losses")
    with pytest.raises(AssertionError, match=r"state\['w'\]: element 2"):
        assert_state_close({"w": torch.tensor([1.0, 2.0, 4.0])}, {"w": torch.tensor([1.0, 2.0, 3.0])}, rtol=1e-3)
    with pytest.raises(AssertionError, match=r"state\['w'\]: dtype torch.bfloat16 but the reference has torch.float32"):
        assert_state_close({"w": torch.ones(3, dtype=torch.bfloat16)}, {"w": torch.ones(3)}, rtol=0.0)
    assert_state_close({"w": torch.ones(3, dtype=torch.bfloat16)}, {"w": torch.ones(3)}, rtol=0.0, check_dtype=False)
