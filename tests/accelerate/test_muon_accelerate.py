"""Muon through the Accelerate plugin and the transformers ``Trainer``, against their own DDP.

One 2-process ``accelerate launch`` of ``_job.py``'s ``muon`` job (``_muon_jobs.py``): one
optimizer with Muon groups and AdamW groups (``MuonWithAdamW``, ``use_muon`` per group)

- through ``ZeroPlugin.prepare(accelerator, model, optimizer, ...)`` at ZeRO-3 (units freed),
  against ``accelerator.prepare`` (Accelerate's DDP): accumulation 2, ``clip_grad_norm_``, an
  LR schedule, 12 optimizer steps;
- through ``Trainer(..., optimizers=(optimizer, scheduler))`` on the engine (ZeRO-3, units
  freed) against the ``Trainer``'s own DDP: accumulation 2, ``max_grad_norm``, 4 steps.

Losses and gradient norms equal DDP's within 1e-6 relative (fp32), the final weights within 1e-6
of each tensor's largest magnitude (a gradient norm summed over pieces differs from DDP's by an
ulp, which after 12 Muon steps leaves a few ulps in some elements near zero), and the engine
steps every hidden matrix whole (8 in the Accelerate model, 8 in the GPT-2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.accelerate.test_accelerate_launch import run_launch
from zero_strategy.testing import assert_close

ZERO3_FREED = "zero_optimization: {stage: 3, stage3_param_persistence_threshold: 0}\n"
MATRICES = 8


def _compare(got: dict[str, Any], ref: dict[str, Any], what: str, weights: bool = True) -> None:
    assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=1e-7, what=f"{what} losses")
    assert_close(got["norms"], ref["norms"], rtol=1e-6, atol=1e-7, what=f"{what} norms")
    assert got["whole"] == MATRICES and ref["whole"] == -1, (what, got["whole"], ref["whole"])
    if not weights:
        return
    assert got["weights"].keys() == ref["weights"].keys(), what
    for k, v in ref["weights"].items():
        want = torch.tensor(v)  # within 1e-6 of the tensor's largest magnitude (12 steps: a few ulps)
        assert_close(torch.tensor(got["weights"][k]), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()),
                     what=f"{what} {k}")  # fmt: skip


def test_muon_through_accelerate_and_the_trainer_equals_ddp(tmp_path: Path) -> None:
    config = tmp_path / "zero3_freed.yaml"
    config.write_text(ZERO3_FREED)
    env = {"ZERO_STRATEGY_CONFIG": str(config), "MUON_TRAINER_CONFIG": str(config)}
    for rank, res in enumerate(run_launch(tmp_path, "muon", 2, env=env)):
        assert len(res["accelerate-ddp"]["norms"]) == 12 and len(res["trainer-ddp"]["losses"]) == 4, res.keys()
        # accelerator.get_state_dict gathers the ZeRO-3 weights on the main process only
        _compare(res["accelerate-zero3"], res["accelerate-ddp"], f"rank {rank} Accelerate ZeRO-3", weights=rank == 0)
        _compare(res["trainer-zero"], res["trainer-ddp"], f"rank {rank} Trainer ZeRO-3")
