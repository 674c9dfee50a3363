"""``save_model`` with ``TrainingArguments(save_on_each_node=True)``: every node's local main
writes the model, at every stage (issue 31, Low: at ZeRO-1/2 non-main nodes wrote nothing).
Two processes under one ``accelerate launch``, each its own node's first process with its own
output directory (``_trainer_jobs.py`` with ``TRAINER_EACH_NODE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.accelerate.test_accelerate_launch import run_launch

JOB = Path(__file__).with_name("_trainer_jobs.py")


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_writes_on_every_node(tmp_path: Path, stage: int) -> None:
    cfg = tmp_path / "zero.yaml"
    cfg.write_text(f"zero_optimization: {{stage: {stage}}}\n")
    ranks = run_launch(tmp_path, f"each-node-{stage}", 2, script=JOB,
                       env={"ZERO_STRATEGY_CONFIG": str(cfg), "TRAINER_OUT": str(tmp_path / "out"), "TRAINER_EACH_NODE": "1"})  # fmt: skip
    for rank, info in enumerate(ranks):
        assert info["engine"] != "NoneType", info  # the engine trained it, not the Trainer's DDP
        assert info["should_save"], info
        assert any(name.endswith(".safetensors") for name in info["wrote"]), (rank, info)
