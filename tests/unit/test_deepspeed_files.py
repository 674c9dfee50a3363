"""DeepSpeed's checkpoint layouts read without DeepSpeed (``checkpoint/deepspeed_files.py``).

Small ``global_step*/`` directories are written here as DeepSpeed 0.19.8 lays them out (the
tests in ``tests/distributed/test_foreign_checkpoint.py`` read the files DeepSpeed itself
writes): ZeRO-1's flat partitions with ``param_alignment_paddings`` and a frozen parameter that
only the module's entries hold, ZeRO-3's per-parameter pieces with each rank's piece of a frozen
parameter in its own model-states file, and the runs that are refused with the field that says so
(tensor or pipeline parallelism, an optimizer file of no ZeRO layout)."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from zero_strategy.checkpoint.deepspeed_files import read_deepspeed

WORLD = 2
# name -> value, in module order; "b.weight" is frozen, between trainable parameters
PARAMS = OrderedDict(
    (n, torch.arange(s.numel(), dtype=torch.float32).view(s) + k * 100)
    for k, (n, s) in enumerate(
        [("a.weight", torch.Size([3, 5])), ("a.bias", torch.Size([3])), ("b.weight", torch.Size([2, 3])),
         ("b.bias", torch.Size([2])), ("c.weight", torch.Size([1, 2]))]
    )
)  # fmt: skip
FROZEN = "b.weight"
TRAINED = [n for n in PARAMS if n != FROZEN]


def _model_states(**extra: object) -> dict:
    return {
        "module": {n: v.to(torch.bfloat16) for n, v in PARAMS.items()} | {"scale": torch.tensor([0.5])},
        "buffer_names": ["scale"],
        "param_shapes": [OrderedDict((n, PARAMS[n].shape) for n in TRAINED)],
        "frozen_param_shapes": None,
        "frozen_param_fragments": None,
        "shared_params": {},
        "lr_scheduler": None,
        "global_steps": 3,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": "0.19.8",
        **extra,
    }


def _save(tag: str, name: str, value: object) -> None:
    os.makedirs(tag, exist_ok=True)
    torch.save(value, os.path.join(tag, name))


def _zero1(root: str, paddings: list[int], **model_extra: object) -> str:
    """BF16_Optimizer's ZeRO-1 files: the trained parameters flat, each followed by its padding,
    padded at the end to equal partitions; the moments cut the same way (2x and 3x the values)."""
    tag = os.path.join(root, "global_step3")
    pieces = []
    for n, pad in zip(TRAINED, paddings):
        pieces += [PARAMS[n].reshape(-1), torch.full((pad,), -1.0)]
    flat = torch.cat(pieces)
    flat = torch.cat([flat, torch.full((-flat.numel() % WORLD,), -1.0)])
    for r, part in enumerate(flat.chunk(WORLD)):
        state = {0: {"step": torch.tensor(3.0), "exp_avg": 2 * part, "exp_avg_sq": 3 * part}}
        optim = {
            "base_optimizer_state": {"state": state, "param_groups": [{"lr": 0.01, "params": [0]}]},
            "single_partition_of_fp32_groups": [part.clone()],
            "param_alignment_paddings": [paddings],
            "partition_count": [WORLD],
        }
        _save(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", {"optimizer_state_dict": optim})
    _save(tag, "mp_rank_00_model_states.pt", _model_states(**model_extra))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step3")
    return root


def _zero3(root: str) -> str:
    """ZeRO-3's files: rank r holds piece r (ceil(numel / world) elements) of every trained
    parameter one after the other, and piece r of the frozen one in its own model-states file."""
    tag = os.path.join(root, "global_step3")

    def piece(t: torch.Tensor, r: int) -> torch.Tensor:
        n = -(-t.numel() // WORLD)
        return torch.cat([t.reshape(-1), torch.full((n * WORLD - t.numel(),), -1.0)])[r * n : (r + 1) * n]

    for r in range(WORLD):
        flat = torch.cat([piece(PARAMS[n], r) for n in TRAINED])
        state = {0: {"step": torch.tensor(3.0), "exp_avg": 2 * flat, "exp_avg_sq": 3 * flat}}
        optim = {
            "optimizer_state_dict": {"state": state, "param_groups": [{"lr": 0.01, "params": [0]}]},
            "fp32_flat_groups": [flat],
            "partition_count": WORLD,
        }
        _save(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", {"optimizer_state_dict": optim})
        frozen = PARAMS[FROZEN].to(torch.bfloat16)
        states = _model_states(
            module={n: torch.empty(0, dtype=torch.bfloat16) for n in PARAMS} | {"scale": torch.tensor([0.5])},
            frozen_param_shapes=OrderedDict([(FROZEN, frozen.shape)]),
            frozen_param_fragments=OrderedDict([(FROZEN, piece(frozen.float(), r).to(torch.bfloat16))]),
        )
        _save(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", states)
    return tag


def _check(sd: dict, report: dict, stage: int, optimizer: str) -> None:
    assert report["deepspeed_stage"] == stage and report["deepspeed_optimizer"] == optimizer, report
    assert report["frozen"] == [FROZEN] and report["deepspeed_world_size"] == WORLD, report
    for n in TRAINED:
        assert sd[f"model.{n}"].dtype == torch.float32 and torch.equal(sd[f"model.{n}"], PARAMS[n]), n
        assert torch.equal(sd[f"optim.state.{n}.exp_avg"], 2 * PARAMS[n]), n
        assert torch.equal(sd[f"optim.state.{n}.exp_avg_sq"], 3 * PARAMS[n]), n
        assert sd[f"optim.state.{n}.step"].item() == 3.0, n
    frozen = sd[f"model.{FROZEN}"]  # the value as saved (bf16 here), no optimizer state
    assert frozen.dtype == torch.bfloat16 and torch.equal(frozen, PARAMS[FROZEN].to(torch.bfloat16))
    assert not any(k.startswith(f"optim.state.{FROZEN}.") for k in sd), sorted(sd)
    assert torch.equal(sd["model.scale"], torch.tensor([0.5])) and sd["optim.param_groups.0.lr"] == 0.01


@pytest.mark.parametrize("paddings", [[0, 0, 0, 0], [1, 3, 2, 0]])
def test_zero1_with_a_frozen_parameter_and_alignment_paddings(tmp_path, paddings: list[int]) -> None:
    sd, report = read_deepspeed(_zero1(str(tmp_path), paddings))
    _check(sd, report, 1, "BF16_Optimizer")


def test_zero3_frozen_pieces_from_every_rank(tmp_path) -> None:
    tag = _zero3(str(tmp_path))
    sd, report = read_deepspeed(tag)
    _check(sd, report, 3, "DeepSpeedZeroOptimizer_Stage3")
    os.remove(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(ValueError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt missing: copy every rank"):
        read_deepspeed(tag)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"mp_world_size": 2}, "mp_world_size 2"),
        ({"checkpoint_parallel_dimensions": {"pp_degree": 4, "tp_degree": 1}}, "pp_degree 4"),
        ({}, "1 files such as bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"),
    ],
)
def test_model_parallel_runs_are_refused_naming_the_field(tmp_path, extra: dict, named: str) -> None:
    root = _zero1(str(tmp_path), [0, 0, 0, 0], **extra)
    if not extra:
        _save(os.path.join(root, "global_step3"), "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", {})
    with pytest.raises(ValueError, match=rf"tensor- or pipeline-parallel run \({named}\).*ds_to_universal\.py"):
        read_deepspeed(root)


def test_an_optimizer_file_of_no_zero_layout_is_refused(tmp_path) -> None:
    root = _zero1(str(tmp_path), [0, 0, 0, 0])
    for r in range(WORLD):
        _save(os.path.join(root, "global_step3"), f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
              {"optimizer_state_dict": {"state": {}, "param_groups": []}})  # fmt: skip
    with pytest.raises(ValueError, match=r"neither ZeRO-1/2's single_partition_of_fp32_groups nor ZeRO-3's"):
        read_deepspeed(root)
