"""docs/finetuning.md's commands, run as written: a tiny Llama made offline, SFT with a LoRA
adapter and DPO with a ``ref_model`` under ``zero-strategy launch`` at ZeRO-3 on 2 CPU
processes, and the adapter loaded back with PEFT.

The commands are the page's ``bash`` blocks marked ``<!-- not run: tests/accelerate/
test_finetuning_docs.py runs it as written -->`` (``tests/unit/test_docs.py`` skips them for
that marker), extracted with that test's own reader and run in order, each through ``bash -c``,
in a temporary directory that links the checkout's ``examples/`` and ``configs/`` (so the
page's relative paths hold and ``runs/`` is written there). Each must exit 0; the one failure
tolerated, as in the other launch tests, is gloo's SIGABRT at teardown after the script printed
its last line. Then: the saved adapter holds LoRA tensors, finite, ``lora_B`` not all zero
(PEFT starts it at zero), the DPO model's full weights are finite and moved from the start, and
every logged loss is finite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.unit.test_docs import _commands, extract_blocks
from zero_strategy.testing import torchrun_teardown_abort

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "finetuning.md"
MARK = "tests/accelerate/test_finetuning_docs.py runs it as written"
TIMEOUT_S = 240
ROUTED = "zero-strategy: accelerator.prepare runs models on the ZeRO-3 engine"


def page_commands() -> list[str]:
    """The marked blocks' commands, in page order."""
    blocks = [b for b in extract_blocks(PAGE) if b.lang == "bash" and b.marker == "not run" and b.value == MARK]
    return [command for block in blocks for command in _commands(block.code)]


def _run(command: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZERO_STRATEGY_CONFIG",
                "ZERO_SHARDED_FROM_PRETRAINED", "ACCELERATE_USE_CPU", "ACCELERATE_CONFIG_FILE"):  # fmt: skip
        env.pop(key, None)
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        last_words = " saved to " in proc.stdout
        if not (torchrun_teardown_abort(proc.stderr) and "Traceback" not in proc.stderr and last_words):
            pytest.fail(f"`{command}` exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        warnings.warn(f"`{command}`: gloo's SIGABRT at teardown after its last words (tolerated)", stacklevel=2)
    return out


def _losses(path: Path) -> list[float]:
    return [e["loss"] for e in json.loads(path.read_text()) if "loss" in e]


def test_the_fine_tuning_page_runs_as_written(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    commands = page_commands()
    scripts = [next((w for w in c.split() if w.startswith("examples/")), "") for c in commands]
    assert scripts == ["examples/make_tiny_llama.py", "examples/trl_sft_lora.py", "examples/load_adapter.py",
                       "examples/trl_dpo.py"], commands  # fmt: skip
    assert all("zero-strategy launch --zero-config zero3" in c for c in (commands[1], commands[3])), commands
    assert commands[3].startswith("ZERO_SHARDED_FROM_PRETRAINED=1 "), commands[3]
    for name in ("examples", "configs"):
        os.symlink(ROOT / name, tmp_path / name)
    outputs = [_run(command, tmp_path) for command in commands]
    runs = tmp_path / "runs"

    for i in (1, 3):  # both trained on the engine, announced once (rank 0)
        assert outputs[i].count(ROUTED) == 1, outputs[i][-3000:]
    assert "lora_B trained" in outputs[2], outputs[2][-2000:]

    adapter = load_file(runs / "sft-lora" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter), sorted(adapter)
    assert all(t.isfinite().all() for t in adapter.values())
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name), sorted(adapter)
    assert sum("lora_B" in name for name in adapter) == 8  # q/k/v/o in 2 layers

    start = load_file(runs / "tiny" / "model" / "model.safetensors")
    tuned = load_file(runs / "dpo" / "model.safetensors")
    assert sorted(tuned) == sorted(start)
    for name, t in tuned.items():
        assert t.shape == start[name].shape and t.isfinite().all(), name
    assert any(not t.equal(start[name]) for name, t in tuned.items())  # trained, not the start saved again

    for run in ("sft-lora", "dpo"):
        losses = _losses(runs / run / "log_history.json")
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses), (run, losses)
