"""The README's Accelerate line on a machine without GPUs, without ``ACCELERATE_USE_CPU``
(issue 47, section 2, item 1): ``ZERO_STRATEGY_CONFIG=FILE accelerate launch --multi_gpu
--num_processes 2 train.py``. Accelerate starts two processes and joins them in one process group,
but each Accelerator believes it runs alone (``num_processes`` 1, distributed type NO): each
would train on the whole dataset while the engine shards over both, and both would write one
output directory. The first ``prepare`` refuses it, naming the fix.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.accelerate.test_accelerate_launch import BIN, TIMEOUT_S, _free_port

SCRIPT = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator()
print(f"rank {accelerator.process_index} of {accelerator.num_processes}", flush=True)
model = torch.nn.Linear(4, 4)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
print("prepared", flush=True)
"""


def test_a_launch_whose_accelerators_run_alone_is_refused_at_the_first_prepare(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}
    env.update({"ZERO_STRATEGY_CONFIG": "zero3", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(script)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path, check=False)
    out = done.stdout + done.stderr
    assert out.count("rank 0 of 1") == 2, out[-4000:]  # the misconfiguration really happened
    assert done.returncode != 0 and "prepared" not in done.stdout, out[-4000:]
    assert "started as one of 2 processes" in out and "ACCELERATE_USE_CPU=true" in out, out[-4000:]
    assert "zero-strategy launch" in out, out[-4000:]  # the other fix: the launcher sets it
    assert not list(tmp_path.glob("*/zero_meta.json")), out[-4000:]  # nothing was trained nor written
