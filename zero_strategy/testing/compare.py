"""NaN-strict numeric comparison for the DDP-parity tests: the one place tests compare numbers.

Python's ``max()`` skips a NaN that follows a finite value, and ``abs(a - b) > tol`` is False
when either side is NaN, so hand-written checks pass when a run produced NaN. These helpers
first require both sides to be finite and of the same length (an empty comparison is an
error too: it would check nothing), then compare every element with ``<=``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["assert_close", "assert_state_close", "rel_error"]


def _flat(values: Any, side: str, what: str) -> list[float]:
    try:
        import torch

        if isinstance(values, torch.Tensor):
            return [float(v) for v in values.detach().double().reshape(-1).tolist()]
    except ImportError:  # pragma: no cover - torch is always there in practice
        pass
    if isinstance(values, (int, float)):
        return [float(values)]
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        out: list[float] = []
        for v in values:
            out.extend(_flat(v, side, what))
        return out
    raise TypeError(f"{what}: cannot compare {side} of type {type(values).__name__}")


def _pairs(got: Any, ref: Any, what: str) -> tuple[list[float], list[float]]:
    a, b = _flat(got, "got", what), _flat(ref, "ref", what)
    if len(a) != len(b):
        raise AssertionError(f"{what}: {len(a)} values against {len(b)} in the reference")
    if not a:
        raise AssertionError(f"{what}: nothing to compare (both sides are empty)")
    for side, values in (("got", a), ("reference", b)):
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise AssertionError(f"{what}: the {side} has non-finite values at {bad[:5]} ({values[bad[0]]!r})")
    return a, b


def rel_error(got: Any, ref: Any, *, what: str = "values", floor: float = 0.0) -> float:
    """The largest ``|g - r| / max(|r|, floor)`` over the pairs; raises AssertionError if
    either side is not finite, the lengths differ or there is nothing to compare. With
    ``floor`` 0, a pair whose reference is 0 counts as an infinite error unless it is equal."""
    a, b = _pairs(got, ref, what)
    worst = 0.0
    for x, y in zip(a, b):
        d = abs(x - y)
        den = max(abs(y), floor)
        err = 0.0 if d == 0 else (d / den if den > 0 else math.inf)
        worst = max(worst, err)
    return worst


def _assert_close_tensors(got: Any, ref: Any, rtol: float, atol: float, what: str) -> None:
    import torch

    a, b = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    if a.numel() != b.numel():
        raise AssertionError(f"{what}: {a.numel()} values against {b.numel()} in the reference")
    if a.numel() == 0:
        raise AssertionError(f"{what}: nothing to compare (both sides are empty)")
    for side, t in (("got", a), ("reference", b)):
        bad = (~torch.isfinite(t)).nonzero().reshape(-1)
        if bad.numel():
            raise AssertionError(
                f"{what}: the {side} has non-finite values at {bad[:5].tolist()} ({t[bad[0]].item()!r})"
            )
    ok = (a - b).abs() <= atol + rtol * b.abs()
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        x, y = a[i].item(), b[i].item()
        raise AssertionError(
            f"{what}: element {i} is {x!r}, the reference {y!r} (|diff| {abs(x - y):.3e} > "
            f"atol {atol:g} + rtol {rtol:g} x |ref|)"
        )


def assert_close(got: Any, ref: Any, *, rtol: float, atol: float = 0.0, what: str = "values") -> None:
    """Every pair satisfies ``|g - r| <= atol + rtol * |r|``; both sides finite, same length,
    not empty. The message names the first pair that does not."""
    import torch

    if isinstance(got, torch.Tensor) and isinstance(ref, torch.Tensor):
        return _assert_close_tensors(got, ref, rtol, atol, what)
    a, b = _pairs(got, ref, what)
    for i, (x, y) in enumerate(zip(a, b)):
        if not abs(x - y) <= atol + rtol * abs(y):
            raise AssertionError(
                f"{what}: element {i} is {x!r}, the reference {y!r} (|diff| {abs(x - y):.3e} > "
                f"atol {atol:g} + rtol {rtol:g} x |ref|)"
            )


def assert_state_close(
    got: Mapping[str, Any],
    ref: Mapping[str, Any],
    *,
    rtol: float,
    atol: float = 0.0,
    what: str = "state",
    check_dtype: bool = True,
) -> None:
    """:func:`assert_close` for every tensor of two state dicts with the same keys (and, unless
    ``check_dtype=False``, the same dtypes: a bf16 copy of fp32 weights is not the same state)."""
    if set(got) != set(ref):
        raise AssertionError(f"{what}: keys differ: {sorted(set(got) ^ set(ref))[:5]}")
    if not ref:
        raise AssertionError(f"{what}: nothing to compare (both state dicts are empty)")
    for key in ref:
        a, b = got[key], ref[key]
        if check_dtype and getattr(a, "dtype", None) != getattr(b, "dtype", None):
            raise AssertionError(
                f"{what}[{key!r}]: dtype {getattr(a, 'dtype', type(a))} but the reference has {getattr(b, 'dtype', type(b))}"
            )
        assert_close(a, b, rtol=rtol, atol=atol, what=f"{what}[{key!r}]")
