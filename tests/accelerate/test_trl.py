"""TRL's ``SFTTrainer`` and ``DPOTrainer`` (with and without a ``ref_model``) and the plain ``Trainer``
with a ``get_peft_model`` model, each with a LoRA adapter,
unmodified, under ``zero-strategy launch`` at ZeRO-2 and ZeRO-3 (units really freed), against
the Trainer's own DDP.

One 2-process launch runs ``_trl_jobs.py``: the three DDP jobs first (``ZERO_STRATEGY_CONFIG``
removed, as in ``_trainer_jobs.py``), then the same three at ZeRO-2 and at ZeRO-3. Without a
``ref_model`` the DPO reference log-probs come from a forward of the whole model under
``no_grad`` (adapter disabled) between the policy's forward and its backward: at ZeRO-3 it freed
the root unit the backward needed, and the run trained on NaN gradients, exited 0 and saved an
all-NaN adapter.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.accelerate.test_accelerate_launch import rel_diff, run_launch
from tests.accelerate.test_unmodified_scripts import ZERO3_FREED, _zero_launch
from zero_strategy.testing import assert_close

JOBS = Path(__file__).with_name("_trl_jobs.py")
CONFIGS = Path(__file__).parents[2] / "configs"
KINDS = ("sft", "dpo", "dpo-ref", "peft")
REL = 1e-5  # fp32: per logged value against DDP


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trl")
    z3 = tmp / "zero3_freed.yaml"
    z3.write_text(ZERO3_FREED)
    configs = {"ddp": "ddp", "zero2": str(CONFIGS / "zero2.yaml"), "zero3": str(z3)}
    jobs = ",".join(f"{kind}-{mode}={cfg}" for mode, cfg in configs.items() for kind in KINDS)
    ranks = run_launch(tmp, "trl", 2, script=JOBS, front=_zero_launch(z3),
                       env={"TRL_JOBS": jobs, "TRL_OUT": str(tmp / "trl"), "ZERO_SHARDED_FROM_PRETRAINED": "1"})  # fmt: skip
    assert ranks[0] == ranks[1], ranks  # the logged values are the same on every rank
    return {"out": tmp / "trl", "jobs": ranks[0]}


def _adapter(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
@pytest.mark.parametrize("kind", KINDS)
def test_trl_trainers_with_lora_train_on_the_engine_as_under_ddp(
    trl_runs: dict[str, Any], kind: str, mode: str
) -> None:
    ref, got = trl_runs["jobs"][f"{kind}-ddp"], trl_runs["jobs"][f"{kind}-{mode}"]
    assert ref["wrapped"] == "DistributedDataParallel" and ref["stage"] is None  # the oracle is the Trainer's DDP
    assert got["stage"] == int(mode[-1]), got
    for key in ("loss", "grad_norm"):
        assert len(got[key]) == len(ref[key]) == 3, (key, got, ref)
        assert all(math.isfinite(v) for v in got[key] + ref[key]), (key, got, ref)
        assert rel_diff(got[key], ref[key]) < REL, (key, got[key], ref[key])
    want, have = _adapter(trl_runs["out"] / f"{kind}-ddp"), _adapter(trl_runs["out"] / f"{kind}-{mode}")
    assert sorted(have) == sorted(want) and want
    for name, value in want.items():  # assert_close fails on NaN/inf: the adapter is finite, as DDP's
        assert_close(have[name], value, rtol=1e-5, atol=1e-6, what=f"{kind} {mode}: {name}")


def test_dpo_reference_model_is_sharded_at_zero3(trl_runs: dict[str, Any]) -> None:
    """TRL prepares a ``ref_model`` with ``accelerator.prepare_model(ref, evaluation_mode=True)``
    (no DeepSpeed, no FSDP): at ZeRO-3 it goes to the engine without an optimizer, so each rank
    holds about 1/world of its parameters (units freed); DDP and ZeRO-2 keep it whole, as
    DeepSpeed's stage-0 reference does below ZeRO-3."""
    jobs = trl_runs["jobs"]
    full = jobs["dpo-ref-ddp"]["ref_full"]
    for mode in ("ddp", "zero2"):
        got = jobs[f"dpo-ref-{mode}"]
        assert got["ref_stage"] is None and got["ref_held"] == [full, full], (mode, got)
    got = jobs["dpo-ref-zero3"]
    assert got["ref_stage"] == 3 and got["ref_full"] == full, got
    world = len(got["ref_held"])
    for held in got["ref_held"]:  # the rows of every unit, padded to a multiple of the world
        assert abs(held - full / world) <= 0.02 * full, (held, full, got)


def test_peft_model_saves_its_adapter_only_at_zero3(trl_runs: dict[str, Any]) -> None:
    """The plain ``Trainer`` with ``get_peft_model``: ``save_model`` (compared with DDP above)
    writes the adapter's tensors alone; ``save_pretrained(dir)`` as it is raises at ZeRO-3
    naming the fix (DeepSpeed would write an empty adapter), and that fix,
    ``save_pretrained(dir, state_dict=accelerator.get_state_dict(model))``, writes DDP's values."""
    out, jobs = trl_runs["out"], trl_runs["jobs"]
    want = _adapter(out / "peft-ddp")
    assert want and all("lora_" in name for name in want), sorted(want)
    assert jobs["peft-ddp"]["bare_save_error"] is None and jobs["peft-zero2"]["bare_save_error"] is None
    error = jobs["peft-zero3"]["bare_save_error"]
    assert error and "state_dict=" in error and "get_state_dict" in error, error
    assert not (out / "peft-zero3" / "bare" / "adapter_model.safetensors").exists()
    for mode in ("ddp", "zero2", "zero3"):
        have = _adapter(out / f"peft-{mode}" / "plain")
        assert sorted(have) == sorted(want), (mode, sorted(have))
        for name, value in want.items():
            assert_close(have[name], value, rtol=1e-5, atol=1e-6, what=f"peft {mode} save_pretrained: {name}")
