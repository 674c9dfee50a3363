"""The smoke runs of ``bench/bench_gpu.py`` and ``bench/bench_dispatch.py`` (``--tiny``: a
2-layer Llama on CPU, gloo, world size 1) and of ``bench/bench_muon.py`` (the same Llama on 2
ranks): every row prints, and the loss check refuses a row whose losses differ from the
reference's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_ROWS = ("plain", "fsdp2", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def _run(script: str, *extra: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), str(ROOT / "integrations")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, f"bench/{script}", "--tiny", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def _table(stdout: str) -> dict[str, str]:
    return {line.split("|")[1].strip(): line for line in stdout.splitlines() if line.startswith("| ")}


def test_bench_gpu_tiny_prints_every_row_with_equal_losses() -> None:
    out = _run("bench_gpu.py", "--warmup", "1", "--steps", "2", "--sync-steps", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    for name in GPU_ROWS:
        assert name in rows, out.stdout
        assert "error" not in rows[name] and "DIFFER" not in rows[name], rows[name]
        assert ("reference" if name == "plain" else "| yes (max rel") in rows[name], rows[name]
    assert "every row's losses equal" in out.stdout


def test_bench_gpu_refuses_a_row_whose_losses_differ() -> None:
    """The check can fail: one row stepped with a 1000x learning rate is refused, and the run fails."""
    out = _run("bench_gpu.py", "--rows", "plain,zero3", "--warmup", "1", "--steps", "2", "--sync-steps", "0",
               "--perturb", "zero3")  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    assert "LOSSES DIFFER" in rows["zero3"] and "| yes" not in rows["zero3"], out.stdout
    assert "FAILED" in out.stdout


def test_bench_dispatch_tiny_counts_ops_and_hooks_of_every_row() -> None:
    """Every row prints; the plain model has no engine ops nor hooks, every engine row has both;
    the model's own ops are the same under every row (the attribution does not leak engine work
    into the model's column, nor the other way)."""
    out = _run("bench_dispatch.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    cols = {}
    for name in ("plain", "fsdp2", "zero1", "zero2", "zero3"):
        assert name in rows and "error" not in rows[name], out.stdout
        cells = [c.strip() for c in rows[name].split("|")[2:-1]]
        keys = ("ops", "kernels", "x", "model", "optimizer", "in_hooks", "outside", "hook_ms", "calls")
        cols[name] = dict(zip(keys, cells))
    plain = cols["plain"]
    assert plain["in_hooks"] == plain["outside"] == "0 (0)" and plain["calls"] == "0", rows["plain"]
    for name in ("fsdp2", "zero1", "zero2", "zero3"):
        assert int(cols[name]["in_hooks"].split()[0]) > 0 and int(cols[name]["calls"]) > 0, rows[name]
        assert float(cols[name]["hook_ms"]) > 0, rows[name]
        assert cols[name]["model"] == plain["model"], (rows[name], rows["plain"])
    assert "zero3: top 15 engine sites" in out.stdout and "ours / FSDP2:" in out.stdout


def test_bench_muon_tiny_prints_every_row_equal_to_ddp() -> None:
    """Every row prints with its losses equal to DDP's; each Muon matrix has one owner (its state
    is half of DDP's on 2 ranks) and the exchange moves 3 x the matrices' elements per step."""
    out = _run("bench_muon.py", "--warmup", "1", "--steps", "2", "--mem-steps", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        for optim in ("adamw", "muon"):
            name = f"{kind}_{optim}"
            assert name in rows and "DIFFER" not in rows[name], out.stdout
            cells = [c.strip() for c in rows[name].split("|")[2:-1]]
            if kind == "ddp":
                assert cells[0] == "reference", rows[name]
                continue
            assert float(cells[0]) <= 1e-5, rows[name]
            if optim == "muon":
                assert cells[6] == "0.50", rows[name]  # Muon state x DDP: one owner of each matrix
    assert out.stdout.count("= 3.00 x numel") == 3, out.stdout
    assert "every ZeRO row's losses equal DDP's" in out.stdout


def test_bench_muon_refuses_a_row_whose_losses_differ() -> None:
    """The check can fail: the ZeRO-3 Muon row stepped at a 1000x learning rate is refused and the run fails."""
    out = _run("bench_muon.py", "--stages", "3", "--optims", "muon", "--warmup", "1", "--steps", "2", "--mem-steps",
               "0", "--perturb", "zero3_muon")  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    assert "LOSSES DIFFER from ddp_muon" in rows["zero3_muon"], out.stdout
    assert "FAILED" in out.stdout
