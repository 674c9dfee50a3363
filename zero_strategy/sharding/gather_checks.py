"""The checks every ZeRO-3 gather makes, and the tag that lets it make them.

Each rank appends a tag naming its unit to the row it sends, so every rank can see that all
ranks gathered the same unit. Rows travel in the unit's compute dtype, which may be bf16 or
fp16, and those count integers exactly only up to 256 (bf16) and 2048 (fp16). A tag is
therefore written as ``TAG`` base-256 digits, each exact in every float dtype, and read back
by converting the digits to int64 *before* combining them (a sum in bf16 would round again).
``TAG`` digits name up to 256**TAG units; a model with more is refused when it is built.

A tag is written by copying from a small device tensor of its digits (made once per tag, dtype
and device with ``fill_``, which passes each digit to the kernel): writing a Python number into
a device tensor by indexing is a blocking host-to-device copy on CUDA, two per gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from zero_strategy.sharding.pieces import check_placeholder, is_placeholder, reset_placeholder, written_while_sharded
from zero_strategy.storage.uploads import to_device

__all__ = [
    "MAX_TAG", "TAG", "GatherChecks", "UnitDivergence", "check_unit_count", "read_tags", "tag_digits", "write_tag",
]  # fmt: skip

TAG = 2  # tag elements appended to every rank's row
_BASE = 256  # every digit 0..255 is exact in bf16, fp16 and wider
MAX_TAG = _BASE**TAG - 1


class GatheredUnit(Protocol):
    """What the checks read of a unit (``unit.UnitStorage``)."""

    @property
    def name(self) -> str: ...
    @property
    def tag(self) -> int: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def fqns(self) -> Sequence[str]: ...


class UnitDivergence(RuntimeError):
    """Ranks gathered different ZeRO-3 units: a unit ran on some ranks and not on others."""


def check_unit_count(n: int) -> None:
    """Refuse a model with more ZeRO-3 units than a tag names (tags are 1..n)."""
    if n > MAX_TAG:
        raise ValueError(
            f"initialize(): the model has {n} ZeRO-3 units, more than the {MAX_TAG} a gather can name. "
            "Fix: group blocks into fewer units (@zero_auto_partition on the block class, or "
            "initialize(policy={BlockClass}))"
        )


_DIGITS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # at most MAX_TAG per dtype and device


def tag_digits(tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tag`` (1..``MAX_TAG``) as ``TAG`` base-256 digits on ``device``, least significant first (cached)."""
    key = (tag, dtype, device)
    got = _DIGITS.get(key)
    if got is None:
        with torch.inference_mode(False):  # cached: read by gathers in and out of inference mode
            got = torch.empty(TAG, dtype=dtype, device=device)
            for k in range(TAG):
                got[k : k + 1].fill_((tag // _BASE**k) % _BASE)  # the digit is a kernel argument: no copy
        _DIGITS[key] = got
    return got


def write_tag(out: torch.Tensor, pos: int, tag: int) -> None:
    """Write ``tag`` (1..``MAX_TAG``) as ``TAG`` base-256 digits into ``out[pos : pos + TAG]``: one
    device copy, no host wait."""
    out[pos : pos + TAG].copy_(tag_digits(tag, out.dtype, out.device))


def read_tags(digits: torch.Tensor) -> torch.Tensor:
    """The int64 tags of ``digits`` (``[ranks, TAG]``, as :func:`write_tag` wrote them), on the device."""
    d = digits.round().long()
    return sum((d[:, k] * _BASE**k for k in range(1, TAG)), d[:, 0])


class GatherChecks:
    """The checks every ZeRO-3 gather makes (all ranks gathered this unit; no parameter was
    written while it was sharded), shared by the units of one engine.

    With ``deferred`` False each gather is checked as it completes (a host read per gather).
    With ``deferred`` True (the scheduler's steady state) a gather costs one device copy: its
    tag digits go into a buffer of the window's gathers, and the placeholders it found are
    remembered (a unit reuses them, so a write into one stays readable until it is reported).
    :meth:`flag` compares them all at once and gives one element that is nonzero if any check
    failed, for the caller's own agreement (the gradient flags' all-reduce); :meth:`report`
    raises the error of the first failure on this rank; :meth:`check_now` reads the flag itself
    (a forward without a backward)."""

    MAX_PENDING = 4096  # deferred gathers kept before they are read (long accumulation)

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.deferred = False
        self._digits: torch.Tensor | None = None  # [capacity, ranks, TAG] fp32: each deferred gather's digits
        self._tags: list[tuple[str, int, str]] = []  # per deferred gather: unit, its tag, the step
        self._held: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}  # placeholders found, by storage

    def gathered(self, unit: GatheredUnit, digits: torch.Tensor, step: str) -> None:
        """``digits``: the tag digits each rank sent (``[ranks, TAG]``, a view of the gather's
        buffer). Before the full parameters replace the placeholders."""
        if not self.deferred:
            found = [int(t) for t in read_tags(digits).tolist()]
            if any(t != unit.tag for t in found):
                raise UnitDivergence(_divergence_message(unit.name, unit.tag, found, self.names, step))
            for p, fqn in zip(unit.params, unit.fqns):
                check_placeholder(p.data, fqn)
            return
        if len(self._tags) >= self.MAX_PENDING:
            self.check_now()
        store = self._digits
        if store is not None and self._tags and (store.shape[1:] != digits.shape or store.device != digits.device):
            self.check_now()  # another shape or device (not seen today): what is pending is read first
        k = len(self._tags)
        with torch.inference_mode(False):  # written by every later gather, inference or not
            if store is None or store.shape[1:] != digits.shape or store.device != digits.device:
                store = self._digits = torch.empty(64, *digits.shape, device=digits.device)
            elif k == store.shape[0]:  # grown on the device, doubling: no host wait
                store = self._digits = torch.cat([store, torch.empty_like(store)])
        store[k].copy_(digits)  # exact: every digit is an integer below 256
        self._tags.append((unit.name, unit.tag, step))
        for p, fqn in zip(unit.params, unit.fqns):
            t = p.data
            if is_placeholder(t):
                self._held.setdefault((t.untyped_storage().data_ptr(), int(t.storage_offset())), (fqn, t))

    def _written(self) -> torch.Tensor | None:
        """Per remembered placeholder, whether it was written (on the device), None: none remembered."""
        held = [t for _, t in self._held.values()]
        if not held:
            return None
        parts = []
        for floating in (True, False):
            ts = [t.as_strided((1,), (1,), t.storage_offset()) for t in held if t.dtype.is_floating_point == floating]
            if ts:
                base = torch.cat(ts)
                parts.append(~torch.isnan(base) if floating else base.ne(0))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def flag(self) -> torch.Tensor | None:
        """One int32 element, nonzero if a deferred check failed (None: nothing pending)."""
        k = len(self._tags)
        if not k or self._digits is None:
            return None
        want = [[(tag // _BASE**j) % _BASE for j in range(TAG)] for _, tag, _ in self._tags]
        expected = to_device(torch.tensor(want, dtype=torch.float32), self._digits.device)
        bad = (self._digits[:k].round() != expected.unsqueeze(1)).any()  # as report() reads them
        written = self._written()
        if written is not None:
            bad = bad | written.any()
        return bad.to(torch.int32).reshape(1)

    def report(self, failed: bool) -> None:
        """Forget what is pending; with ``failed`` (on some rank), raise this rank's error."""
        if not failed:
            self._tags, self._held = [], {}
            return
        written = self._written()
        hits = written.tolist() if written is not None else []
        held, tags, digits = list(self._held.values()), self._tags, self._digits
        self._tags, self._held = [], {}
        for _, t in held:  # reused at the next reshard: the write is reported once
            reset_placeholder(t)
        for (fqn, _), hit in zip(_in_cat_order(held), hits):
            if hit:
                raise RuntimeError(written_while_sharded(fqn))
        for k, (name, tag, step) in enumerate(tags):
            found = [int(v) for v in read_tags(digits[k]).tolist()] if digits is not None else []
            if any(v != tag for v in found):
                raise UnitDivergence(_divergence_message(name, tag, found, self.names, step))
        raise RuntimeError(
            "another rank found a failed ZeRO-3 gather check in this step (diverged units or a parameter written "
            "while sharded); its error names it"
        )

    def check_now(self) -> None:
        bad = self.flag()
        if bad is not None:
            self.report(bool(bad))
        else:
            self._tags, self._held = [], {}


def _in_cat_order(held: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``held`` in :meth:`GatherChecks._written`'s order: floating placeholders first."""
    return [h for h in held if h[1].dtype.is_floating_point] + [h for h in held if not h[1].dtype.is_floating_point]


def _divergence_message(unit: str, tag: int, tags: list[int], names: dict[int, str], step: str) -> str:
    by_unit: dict[int, list[int]] = {}
    for rank, t in enumerate(tags):
        by_unit.setdefault(t, []).append(rank)
    parts = [f"ranks {ranks} gathered {names.get(t, f'unit #{t}')}" for t, ranks in sorted(by_unit.items())]
    return (
        f"ZeRO-3 ranks diverged at {step}: {'; '.join(parts)}. A unit ran on some ranks and not on "
        f"others (data-dependent routing such as MoE, or a branch only some ranks take), while gathering "
        f"{unit} here. Fix: make the module that owns the conditional branch one unit, so all of it is "
        "gathered together on every rank: decorate its class with @zero_auto_partition or pass it in "
        "initialize(policy={...})."
    )
