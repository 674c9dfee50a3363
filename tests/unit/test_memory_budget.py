"""The memory budget's config (``zero_strategy.memory``) and the cache's eviction policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_strategy.comm import collectives as C
from zero_strategy.config import ZeroConfig, not_applied_settings
from zero_strategy.config.memory import MemoryConfig, TierBytes
from zero_strategy.config.report import check_file
from zero_strategy.sharding.cache import EvictionPolicy


def test_budget_and_tiers_read_as_fractions_or_bytes() -> None:
    m = MemoryConfig(budget="60GB", persistent=0.3, cache="20GiB", working="1.5GB")
    assert m.budget == 60 * 10**9 and m.cache == 20 * 2**30 and m.working == 1_500_000_000
    assert m.persistent == 0.3 and isinstance(m.persistent, float)
    t = m.resolve(None)  # bytes: no device needed
    assert t == TierBytes(budget=60 * 10**9, persistent=18 * 10**9, cache=20 * 2**30, working=1_500_000_000)
    assert MemoryConfig(budget=1).budget == 1.0 and isinstance(MemoryConfig(budget=1).budget, float)  # a fraction
    assert MemoryConfig(budget=4096).budget == 4096  # an integer above 1: bytes
    frac = MemoryConfig(budget=0.5).resolve(80 * 10**9)
    assert (frac.budget, frac.persistent, frac.cache, frac.working) == (40 * 10**9, 12 * 10**9, 20 * 10**9, 8 * 10**9)
    assert not MemoryConfig().enabled and MemoryConfig(budget=0.9).enabled


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"budget": 0.9, "persistent": 0.5, "cache": 0.5}, r"more than the whole budget \(1\)"),
        ({"budget": "1GB", "cache": "2GB"}, r"add up to more than the budget"),
        ({"budget": "sixty GB"}, r"could not read 'sixty GB' as a size"),
        ({"budget": "60XB"}, r"could not read '60XB' as a size"),
        ({"budget": 0}, r"must be > 0"),
        ({"budget": 1.5}, r"above 1, so it is read as bytes, which must be whole"),
        ({"budget": "1GB", "cache": -0.1}, r"must be >= 0"),
    ],
)
def test_bad_budgets_name_the_field_and_the_fix(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        MemoryConfig(**kwargs)


def test_a_fraction_of_a_cpu_device_asks_for_bytes() -> None:
    with pytest.raises(
        ValueError, match=r"budget=0.9 is a fraction of the device's memory, but the device is the CPU.*'8GB'"
    ):
        MemoryConfig(budget=0.9).resolve(None)


def test_deepspeed_block_shorthand_and_the_knobs_the_budget_replaces() -> None:
    cfg = ZeroConfig.from_dict(
        {
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10**6},
            "zero_strategy": {"memory": {"budget": "8GB", "cache": 0.25}},
        }
    )
    assert cfg.memory == MemoryConfig(budget=8 * 10**9, cache=0.25)
    said = not_applied_settings(cfg)
    assert any(m.startswith("stage3_max_live_parameters=1000000 is not applied: zero_strategy.memory") for m in said)
    assert not any("stage3_max_reuse_distance" in m for m in said)  # not set: nothing to say
    both = ZeroConfig(stage=3, stage3_param_persistence_threshold=10, memory={"budget": "8GB"})
    assert any(m.startswith("stage3_param_persistence_threshold=10 is not applied") for m in not_applied_settings(both))
    assert not not_applied_settings(ZeroConfig(stage=3, stage3_param_persistence_threshold=10))  # no budget: governs
    assert ZeroConfig.from_dict({"zero_strategy": {"memory": "8GB"}}).memory.budget == 8 * 10**9
    assert not_applied_settings(ZeroConfig(stage=3, stage3_max_live_parameters=10**6)) == []  # no budget: it governs
    with pytest.raises(ValueError, match=r"zero_strategy.memory needs stage 3 \(got stage 1\)"):
        ZeroConfig(stage=1, memory={"budget": "8GB"})
    # the default stage (2), which a front-end may still set: a conflict of the resolved config
    assert any("memory needs stage 3" in m for m in ZeroConfig(memory={"budget": "8GB"}).conflicts())


def test_check_prints_the_bytes_per_tier(tmp_path: Path) -> None:
    path = tmp_path / "z.yaml"
    path.write_text("zero_optimization: {stage: 3}\nzero_strategy:\n  memory: {budget: 2GiB, cache: 0.5}\n")
    text = check_file(path).format()
    assert "memory budget (bytes per tier):" in text, text
    assert "budget: 2.00 GiB (2147483648 B)" in text and "cache: 1.00 GiB (1073741824 B)" in text, text
    # the cache holds only units that are not persistent: check says so, and how to measure the cache
    assert "the cache holds only units that are not persistent" in text and "persistent: 0" in text, text
    path.write_text("zero_optimization: {stage: 3}\nzero_strategy:\n  memory: 0.9\n")
    assert "budget: 0.9 of the device's memory" in check_file(path).format()


def test_eviction_is_farthest_next_use_in_the_cyclic_order_else_lru() -> None:
    p: EvictionPolicy[str] = EvictionPolicy()
    for key in "abcd":
        p.used(key)
    assert p.victim("abcd", None) == "a"  # no order: least recently used
    p.used("a")
    assert p.victim("abcd", None) == "b"
    p.set_order(list("abcddcba"))  # forward a b c d, backward d c b a
    # at position 3 (d's forward): next uses d@4, c@5, b@6, a@7 -> a is farthest
    assert p.victim("abc", 3) == "a"
    # at position 6 (b's backward): a@7, then (next step) b@9, c@10, d@11: d is farthest
    assert p.victim("abcd", 6) == "d"
    assert p.distance("a", 7) == 1 and p.distance("d", 4) == 7  # the next step: a@8, d@11
    p.set_order(list("abab"))
    assert p.victim("abz", 0) == "z"  # never used in the order: first to go


def test_persistent_units_are_a_greedy_knapsack_by_gathers_avoided_per_byte() -> None:
    from zero_strategy.runtime.budget import choose_persistent

    # (tag, full bytes, gathers avoided per step): tag 4 is used 4 times per step (a shared block)
    units = [(1, 100, 2), (2, 100, 2), (3, 30, 1), (4, 120, 4), (5, 10, 0)]
    assert choose_persistent(units, 0) == []
    assert choose_persistent(units, 119) == [1]  # 4 does not fit; then the smaller tag among equals
    assert choose_persistent(units, 120) == [4]  # most gathers avoided per byte first
    assert choose_persistent(units, 250) == [1, 3, 4]  # 2 does not fit after 4 and 1; 3 fits what is left
    assert choose_persistent(units, 10**9) == [1, 2, 3, 4]  # never a unit that no step uses
    same = [(1, 50, 2), (2, 20, 2), (3, 30, 2)]
    assert choose_persistent(same, 50) == [2, 3]  # equal benefit per byte: the smaller units first


def test_uses_per_step_come_from_the_recorded_order() -> None:
    from types import SimpleNamespace

    from zero_strategy.runtime.budget import uses_per_step

    units = [SimpleNamespace(tag=t, label=label) for t, label in ((1, "a"), (2, "b"), (3, "<root>"))]
    assert uses_per_step(units, None) == {1: 2, 2: 2, 3: 1}  # no order yet: a forward and a backward each
    assert uses_per_step(units, [1, 1, 2]) == {1: 4, 2: 2, 3: 1}  # `a` runs twice per forward
    assert uses_per_step(units, [2]) == {1: 0, 2: 2, 3: 1}  # `a` is not on the recorded path


class _FakeAllocator:
    """torch.cuda's allocator counters of one device, driven by the test (no GPU here):
    ``allocated`` now and the process-wide ``peak``; ``resets`` counts reset_peak_memory_stats."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allocated: int, peak: int) -> None:
        self.allocated, self.peak, self.resets = allocated, peak, 0
        props = type("Props", (), {"total_memory": 80 << 30})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self._reset())

    def _reset(self) -> None:
        self.resets += 1
        self.peak = self.allocated

    def use(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


def _cuda_budget(others: int = 0):
    from zero_strategy.comm.collectives import CommContext
    from zero_strategy.config.memory import MemoryConfig
    from zero_strategy.runtime.budget import Budget
    from zero_strategy.sharding.gather_meter import GatherMeter

    ctx = CommContext(None, 0, 1, C.DEFAULT_TIMEOUT, "native", torch.device("cuda", 0))
    storage = type("Storage", (), {"units": [], "meter": GatherMeter()})()
    budget = Budget(MemoryConfig(budget=1 << 30), ctx, storage)
    budget.others = lambda: others
    budget.check = lambda *a, **k: None  # type: ignore[method-assign]  # (its all-reduce needs the device)
    return budget, storage


def _first_step(budget, stats: dict[str, int]) -> None:
    cache = type("Cache", (), {"peak": 0})()
    budget.after_new_state(lambda: stats, cache, None, "step 1", can_change=False)


STATE = {"tier_device": 100 << 20, "params": 0, "full_grads": 0, "comm_scratch_peak": 0}


def test_working_memory_is_this_engines_and_leaves_the_peaks_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31, item 10: a reference model's engine (DPO) holds 300 MiB on the same GPU, this
    engine 100 MiB; its step peaks at 1000 MiB. Its working memory is 600 MiB, not 900 MiB (the
    other engine's state is not this engine's), and the user's peak is never reset."""
    gpu = _FakeAllocator(monkeypatch, allocated=(100 + 300) << 20, peak=900 << 20)
    budget, _ = _cuda_budget(others=300 << 20)
    gpu.use(600 << 20)  # the step's activations and transients: 1000 MiB, the device's new peak
    gpu.use(-(600 << 20))
    _first_step(budget, STATE)
    assert budget.working == 600 << 20, budget.working  # 1000 - 100 (this engine) - 300 (the other engine)
    assert gpu.resets == 0, "reset_peak_memory_stats clobbers the user's and other engines' peaks"
    assert gpu.peak == 1000 << 20


def test_an_earlier_higher_peak_leaves_the_sampled_working_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peak from before initialize (the full model built on the GPU, then sharded) hides this
    engine's: the working memory is then the most the allocator held at this engine's gathers
    and frees, less the state."""
    gpu = _FakeAllocator(monkeypatch, allocated=100 << 20, peak=5000 << 20)
    budget, storage = _cuda_budget()
    gpu.use(70 << 20)
    storage.meter.add(10)  # a gather: the allocator is read here
    gpu.use(-(70 << 20))
    storage.meter.add(-10)
    _first_step(budget, STATE)
    assert gpu.resets == 0 and gpu.peak == 5000 << 20
    assert budget.working == 70 << 20, budget.working


def test_the_other_engines_bytes_are_their_device_state() -> None:
    """What the budget subtracts as the other engines' (``others``): their device state and
    communication buffers, not its own."""
    import zero_strategy as zs
    from zero_strategy.runtime.module import get_engine

    a, _ = zs.initialize(torch.nn.Linear(8, 8), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    b, _ = zs.initialize(torch.nn.Linear(16, 16), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    ea, eb = get_engine(a), get_engine(b)
    sa, sb = ea.memory_stats(), eb.memory_stats()
    assert sb["tier_device"] > sa["tier_device"] > 0
    # (engines left alive by other tests in this process count for both alike)
    mine = ea._other_engines_bytes() - eb._other_engines_bytes()
    assert mine == sb["tier_device"] + sb["comm_scratch"] - sa["tier_device"] - sa["comm_scratch"]
