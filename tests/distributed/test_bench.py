"""``zero-strategy bench`` and ``estimate`` against what the engine measures, on 2 ranks.

- this engine's formula (``zero-strategy estimate``) against ``memory_stats()`` at the step's
  peak, stages 1-3, fp32 and bf16, within 5%;
- a tiny bench run: every row's model states within 10% of its formula, every row's losses
  equal to DDP's, and the Markdown, JSON and three PNGs written with those numbers in them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from zero_strategy.testing import run_subtests, subtest_grid

SPEC = "d=128,layers=2,heads=4,seq=32"  # blocks above the ZeRO-3 persistence threshold


def _estimate_vs_memory_stats(stage: int, precision: str) -> None:
    import torch

    import zero_strategy as zs
    from zero_strategy.bench.estimate import Setup, this_engine
    from zero_strategy.bench.presets import gpt_config
    from zero_strategy.models import GPT, num_parameters, synthetic_batch

    cfg = gpt_config(SPEC)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    n = num_parameters(gpt)
    conf: dict = {"zero_optimization": {"stage": stage}, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
    model, opt = zs.initialize(gpt, lambda p: torch.optim.AdamW(p, lr=1e-3), config=conf)
    peak = 0
    for step in range(2):
        x, y = synthetic_batch(cfg, 2, step, seed=torch.distributed.get_rank())
        model.loss(x, y).backward()
        peak = max(peak, zs.memory_stats(model)["model_state"])
        opt.step()
        peak = max(peak, zs.memory_stats(model)["model_state"])
        opt.zero_grad()
    # the units small enough to stay gathered (stage3_param_persistence_threshold): an input of the formula
    persistent = sum(u.numel for u in getattr(model.zero_engine.params, "units", []) if u.persistent)
    assert stage < 3 or 0 < persistent < n / 4
    want = this_engine(Setup(n, torch.distributed.get_world_size(), stage, precision, persistent=persistent)).total
    assert math.isfinite(want) and want > 0
    assert abs(peak - want) <= 0.05 * want, f"stage {stage} {precision}: memory_stats {peak} vs formula {want:.0f}"
    model.zero_engine.close()


def _cache_tier_vs_memory_stats(units_cached: int) -> None:
    """``estimate --cache-budget``: this engine's formula with the cache tier against
    ``memory_stats()`` (model states, which count the cached full parameters, and the cache's
    peak) on a 4-block GPT whose cache holds the root unit and two blocks, or the whole model."""
    import torch

    import zero_strategy as zs
    from zero_strategy.bench.estimate import Setup, cache_bytes, this_engine
    from zero_strategy.bench.presets import gpt_config
    from zero_strategy.models import GPT, num_parameters, synthetic_batch

    cfg = gpt_config("d=128,layers=4,heads=4,seq=32")
    torch.manual_seed(0)
    gpt = GPT(cfg)
    n = num_parameters(gpt)
    block = 4 * sum(p.numel() for p in gpt.blocks[0].parameters())  # one unit's gathered fp32 bytes
    root = 4 * n - 4 * block  # the root unit (embeddings, final norm): gathered all step long, in the cache
    cap = units_cached * block + root
    # persistent share 0: no unit is kept persistent by the budget (that would shrink what the
    # cache can hold), so the cache tier is measured alone; it holds the root unit and the blocks
    conf = {"zero_optimization": {"stage": 3},
            "zero_strategy": {"memory": {"budget": "64MiB", "persistent": 0.0, "cache": cap, "working": 0.1}}}  # fmt: skip
    model, opt = zs.initialize(gpt, lambda p: torch.optim.AdamW(p, lr=1e-3), config=conf)
    peak = cache_peak = 0
    for step in range(2):
        x, y = synthetic_batch(cfg, 2, step, seed=torch.distributed.get_rank())
        model.loss(x, y).backward()
        stats = zs.memory_stats(model)
        peak, cache_peak = max(peak, stats["model_state"]), max(cache_peak, stats["cache"])
        opt.step()
        stats = zs.memory_stats(model)
        peak, cache_peak = max(peak, stats["model_state"]), max(cache_peak, stats["cache"])
        opt.zero_grad()
    assert stats["cache_cap"] == cap
    persistent = sum(u.numel for u in model.zero_engine.params.units if u.persistent)
    setup = Setup(n, torch.distributed.get_world_size(), 3, "fp32", persistent=persistent, cache_budget=cap)
    want_cache, want = cache_bytes(setup), this_engine(setup).total
    assert want_cache == (cap if units_cached < 4 else 4 * (n - persistent)) and want_cache > 0
    assert abs(cache_peak - want_cache) <= 0.05 * want_cache, f"cache {cache_peak} vs formula {want_cache:.0f}"
    assert abs(peak - want) <= 0.05 * want, f"model states with cache {peak} vs formula {want:.0f}"
    model.zero_engine.close()


def _estimate_worker(rank: int, world: int) -> None:
    run_subtests(_estimate_vs_memory_stats, subtest_grid(stage=[1, 2, 3], precision=["fp32", "bf16"]))
    run_subtests(_cache_tier_vs_memory_stats, subtest_grid(units_cached=[2, 4]))


def test_this_engines_formula_and_cache_tier_match_memory_stats_within_5_percent(launch) -> None:
    launch(_estimate_worker, 2, timeout=240)


def test_tiny_bench_rows_match_formula_and_ddp_and_write_their_files(tmp_path: Path) -> None:
    from zero_strategy.bench import harness, report
    from zero_strategy.bench.command import machine_info

    opts = harness.BenchOptions(model=SPEC, ranks=(2,), steps=2, warmup=1, batch=2, fresh=False, progress=False)
    data = harness.run_bench(opts)
    data.update(machine=machine_info(), command="test")
    data["summary"] = harness.summarize(data)
    rows = {e["row"]: e for e in data["summary"]}
    assert set(rows) == set(harness.CORE_ROWS)
    for row, e in rows.items():
        assert e["status"] == "ok", (row, e["status"])
        got, want = e["model_state_bytes"], e["formula_bytes"]
        assert want > 0 and abs(got - want) <= 0.10 * want, f"{row}: model states {got} vs formula {want:.0f}"
        assert all(math.isfinite(v) for v in e["losses"]) and len(e["losses"]) == 3
        assert e["samples_per_s"] > 0 and e["peak_rss_bytes"] > got
        if row != "ddp":
            assert isinstance(e["loss_vs_ddp"], float) and e["loss_vs_ddp"] <= 1e-5, (row, e["loss_vs_ddp"])
        if row.startswith("zero"):
            assert 0 <= e["exposed_pct"] <= 100 and e["breakdown"]["exposed_comm"] >= 0
        # offload I/O has its own bar: the waits on swap files, only where a tier is on disk
        io = e["breakdown"]["offload_io"]
        assert math.isfinite(io) and (0 < io < e["step_s"] if row == "zero3_nvme" else io == 0), (row, io)
        # by tier (device, host, disk): offload rows hold their model states off the device
        t = e["tiers"]
        got_tiers = [t["tier_device"], t["tier_host_pinned"] + t["tier_host_pageable"], t["tier_disk"]]
        for what, g, w in zip(("device", "host", "disk"), got_tiers, e["formula_tiers"]):
            assert abs(g - w) <= 0.10 * want, f"{row} {what}: {g} vs formula {w:.0f}"
    assert rows["zero3_cpu"]["tiers"]["tier_device"] < 0.2 * rows["zero3"]["tiers"]["tier_device"]
    assert rows["zero3_nvme"]["tiers"]["tier_disk"] > 0.5 * rows["zero3_nvme"]["model_state_bytes"]

    paths = report.write_outputs(data, tmp_path / "out")
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"] == json.loads(json.dumps(data["summary"]))
    table = paths["md"].read_text()
    for e in data["summary"]:
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {e['label']}"))
        assert f"{e['model_state_bytes'] / 2**20:.1f} ({e['formula_bytes'] / 2**20:.1f})" in line, line
        assert ("(reference)" if e["row"] == "ddp" else "| yes (") in line, line
    import matplotlib.image

    for name in ("memory", "breakdown", "losses"):
        img = matplotlib.image.imread(paths[name])
        assert img.shape[0] >= 300 and img.shape[1] >= 500, (name, img.shape)
        assert float(img[..., :3].std()) > 0.05, f"{name}.png is (nearly) blank"


def _saved_bench() -> dict[str, Any]:
    """A bench.json's content: one DDP row (what the table, JSON and plots are made from)."""
    return {
        "options": {"model": "tiny", "batch": 2, "warmup": 1, "steps": 1, "repeats": 1},
        "n_params": 1000, "wall_s": 1.0, "machine": {"device": "cpu"}, "command": "x",
        "summary": [{"row": "ddp", "label": "DDP", "ranks": 2, "status": "ok", "formula_bytes": 2**20,
                     "model_state_bytes": 2**20, "tiers": {}, "peak_rss_bytes": 2**30, "samples_per_s": 1.0,
                     "exposed_pct": None, "losses": [1.5], "loss_vs_ddp": 0.0}],
    }  # fmt: skip


def test_update_results_replaces_only_the_marked_section(tmp_path: Path) -> None:
    from zero_strategy.bench import report

    data = _saved_bench()
    md = tmp_path / "RESULTS.md"
    md.write_text("# history\n\nhand-written before\n")
    report.update_results(md, data)
    md.write_text(md.read_text() + "\nhand-written after\n")
    data["summary"][0]["losses"] = [2.25]
    report.update_results(md, data, plot="plots/memory.png")
    text = md.read_text()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert text.startswith("# history\n\nhand-written before\n") and text.endswith("hand-written after\n")
    assert "| 2.2500 |" in text and "| 1.5000 |" not in text and "![model states per rank](plots/memory.png)" in text


def test_bench_without_matplotlib_prints_the_table_and_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``bench`` does after its runs, with matplotlib unimportable: the table and JSON
    first, then one line naming the extra instead of the plots (and no traceback)."""
    from zero_strategy.bench import command

    data = _saved_bench()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    results = tmp_path / "RESULTS.md"
    command.publish(data, str(tmp_path / "out"), str(results))
    out = capsys.readouterr().out
    assert "| DDP" in out and "| 1.5000 |" in out, out
    assert "plots skipped: matplotlib is not installed (pip install 'zero-strategy[bench]')" in out, out
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["summary"] == data["summary"]
    assert not list((tmp_path / "out").glob("*.png")) and "| 1.5000 |" in results.read_text()


def test_deepspeed_rows_train_as_ddp_and_count_model_states_not_buffers() -> None:
    """``--peers``' DeepSpeed ZeRO-1/2/3 rows (pinned in the dev extra; skipped only where it is
    not installed): every step's loss equals DDP's, exposed communication is "n/a" (not timed by
    this engine's method, never estimated), and the model states counted hold at least what the
    ZeRO paper's fp32 formula says (DeepSpeed also keeps fp32 master partitions) but not its
    2 GB reduce bucket."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'zero-strategy[bench]')")
    from zero_strategy.bench import harness, report

    ds_rows = ("deepspeed1", "deepspeed2", "deepspeed3")
    opts = harness.BenchOptions(model=SPEC, ranks=(2,), steps=2, warmup=1, batch=2, progress=False,
                                rows=("ddp", *ds_rows))  # fmt: skip
    data = harness.run_bench(opts)
    data.update(machine={"device": "cpu"}, command="test")
    data["summary"] = harness.summarize(data)
    rows = {e["row"]: e for e in data["summary"]}
    assert set(rows) == {"ddp", *ds_rows}
    table = report.markdown(data)
    for row in ds_rows:
        e = rows[row]
        assert e["status"] == "ok", (row, e["status"])
        assert all(math.isfinite(v) for v in e["losses"]) and len(e["losses"]) == 3
        assert isinstance(e["loss_vs_ddp"], float) and e["loss_vs_ddp"] <= 1e-5, (row, e["loss_vs_ddp"])
        got, want = e["model_state_bytes"], e["formula_bytes"]
        assert math.isfinite(want) and want <= got < 2 * want, f"{row}: model states {got} vs formula {want:.0f}"
        assert e["exposed_pct"] is None and e["breakdown"]["exposed_comm"] is None
        assert e["samples_per_s"] > 0
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {e['label']} |"))
        assert "| n/a |" in line and "| yes (" in line, line
