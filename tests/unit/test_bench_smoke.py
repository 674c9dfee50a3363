"""The smoke runs of ``bench/bench_gpu.py`` and ``bench/bench_dispatch.py`` (``--tiny``: a
2-layer Llama on CPU, gloo, world size 1): every row prints, and the loss check refuses a row
whose losses differ from the plain model's."""

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
