"""``examples/train_moe.py`` runs as its docstring says (fewer, smaller steps): a Hugging Face
Mixtral trained with the Lightning strategy at ZeRO-3 on 2 CPU processes, then ``generate`` on
every rank, gathering fewer expert bytes than all experts while decoding, in both expert layouts."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.lightning.test_lightning_strategy import _run_script


@pytest.mark.parametrize("layout", ["sharded", "owners"])
def test_moe_example_trains_and_generates_with_two_processes(layout: str) -> None:
    example = str(Path(__file__).parents[2] / "examples" / "train_moe.py")
    args = ["--devices", "2", "--steps", "3", "--new-tokens", "4", "--experts", "16", "--expert-layout", layout]
    out = _run_script([sys.executable, example, *args], timeout=280)
    assert "step    3  loss" in out and "generated: 'def " in out, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: done" in out, out[-3000:]
        m = re.search(rf"rank {rank}: generate: experts gathered (\S+) MiB of (\S+) MiB", out)
        assert m is not None and 0 < float(m[1]) < float(m[2]), out[-3000:]
