"""DeepSpeed's checkpoint layouts read without DeepSpeed (``checkpoint/deepspeed_files.py``).

Small ``global_step*/`` directories are written here as DeepSpeed 0.19.8 lays them out (the
tests in ``tests/distributed/test_foreign_checkpoint.py`` read the files DeepSpeed itself
writes): ZeRO-1's flat partitions with ``param_alignment_paddings`` and a frozen parameter that
only the module's entries hold, ZeRO-3's per-parameter pieces with each rank's piece of a frozen
parameter in its own model-states file, and the runs that are refused with the field that says so
(tensor or pipeline parallelism, an optimizer file of no ZeRO layout). DeepSpeed's own Adams
(FusedAdam, DeepSpeedCPUAdam) keep each state's step as a Python int and implementation keys in
their param groups; their files are imported, loaded in one process and stepped against a torch
AdamW from the same state."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.checkpoint.deepspeed_files import read_deepspeed
from zero_strategy.checkpoint.files import SafeFileSystemReader
from zero_strategy.checkpoint.foreign import import_checkpoint, read_bytes_entry, read_foreign

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


def _zero3(root: str, subgroups: int = 1) -> str:
    """ZeRO-3's files: rank r holds piece r (ceil(numel / world) elements) of every trained
    parameter one after the other, and piece r of the frozen one in its own model-states file;
    ``subgroups`` (sub_group_size) cuts the one param group into flat sub-groups of their own."""
    tag = os.path.join(root, "global_step3")
    cut = [TRAINED[: len(TRAINED) // 2], TRAINED[len(TRAINED) // 2 :]] if subgroups == 2 else [TRAINED]

    def piece(t: torch.Tensor, r: int) -> torch.Tensor:
        n = -(-t.numel() // WORLD)
        return torch.cat([t.reshape(-1), torch.full((n * WORLD - t.numel(),), -1.0)])[r * n : (r + 1) * n]

    for r in range(WORLD):
        flats = [torch.cat([piece(PARAMS[n], r) for n in names]) for names in cut]
        state = {i: {"step": torch.tensor(3.0), "exp_avg": 2 * f, "exp_avg_sq": 3 * f} for i, f in enumerate(flats)}
        groups = [{"lr": 0.01, "params": list(range(len(cut)))}]
        optim = {
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flats,
            "partition_count": WORLD,
        }
        _save(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", {"optimizer_state_dict": optim})
        frozen = PARAMS[FROZEN].to(torch.bfloat16)
        states = _model_states(
            module={n: torch.empty(0, dtype=torch.bfloat16) for n in PARAMS} | {"scale": torch.tensor([0.5])},
            param_shapes=[OrderedDict((n, PARAMS[n].shape) for n in names) for names in cut],
            frozen_param_shapes=OrderedDict([(FROZEN, frozen.shape)]),
            frozen_param_fragments=OrderedDict([(FROZEN, piece(frozen.float(), r).to(torch.bfloat16))]),
        )
        _save(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", states)
    return tag


def _edit(tag: str, change: Callable[[dict, dict], None]) -> None:
    """Apply ``change(file's dict, the wrapped optimizer's state_dict)`` to every rank's optimizer file."""
    for r in range(WORLD):
        path = os.path.join(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        saved = torch.load(path, weights_only=False)
        optim = saved["optimizer_state_dict"]
        change(saved, optim.get("base_optimizer_state", optim.get("optimizer_state_dict")))
        torch.save(saved, path)


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


@pytest.mark.parametrize("stage", [1, 3])
def test_partitions_shorter_than_the_shapes_are_named(tmp_path, stage: int) -> None:
    """Rank files from another save (fewer elements than ``param_shapes`` needs): named with the
    fix, not a ``view`` error (review finding)."""
    root = _zero1(str(tmp_path), [0, 0, 0, 0]) if stage == 1 else os.path.dirname(_zero3(str(tmp_path)))
    if stage == 3:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("global_step3")
    key = "single_partition_of_fp32_groups" if stage == 1 else "fp32_flat_groups"
    _edit(os.path.join(root, "global_step3"), lambda saved, _: saved["optimizer_state_dict"].update(
        {key: [t[: t.numel() // 2] for t in saved["optimizer_state_dict"][key]]}))  # fmt: skip
    with pytest.raises(ValueError, match=r"partitions hold \d+ elements, the parameter shapes .*need \d+.*of one tag"):
        read_deepspeed(root)


class _Model(nn.Module):
    """The parameters of PARAMS (b.weight frozen) and the buffer ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 3), nn.Linear(3, 2), nn.Linear(2, 1, bias=False)
        self.register_buffer("scale", torch.tensor([0.5]))
        self.b.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))) * self.scale


def _deepspeed_adam(kind: str) -> Callable[[dict, dict], None]:
    """Rewrite a file as FusedAdam ("fused": int steps, the group's step 0 and bias_correction) or
    DeepSpeedCPUAdam ("cpu": int steps, bias_correction and amsgrad) would have saved it."""

    def change(saved: dict, base: dict) -> None:
        states = base["state"].values() if isinstance(base, dict) else base
        for state in states:
            state["step"] = 3
        group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "bias_correction": True}
        group |= {"step": 0} if kind == "fused" else {"amsgrad": False}
        for g in base["param_groups"]:
            g.update(group)
        saved["ds_config"] = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}

    return change


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", ["fused", "cpu"])
def test_deepspeed_own_adams_import_load_and_step_as_torch_adamw(tmp_path, stage: int, kind: str) -> None:
    root = str(tmp_path / "ds")
    tag = os.path.join(_zero1(root, [0, 0, 0, 0]), "global_step3") if stage == 1 else _zero3(root, subgroups=2)
    _edit(tag, _deepspeed_adam(kind))
    sd, report = read_deepspeed(tag)
    step = sd["optim.state.a.weight.step"]
    assert step.dtype == torch.float32 and step.shape == () and step.item() == 3.0, step
    groups = {k for k in sd if k.startswith("optim.param_groups.")}
    assert not groups & {"optim.param_groups.0.step", "optim.param_groups.0.bias_correction"}, groups
    assert sd["optim.param_groups.0.params"] == TRAINED and report["deepspeed_adam_w_mode"] is True
    written = import_checkpoint(tag, str(tmp_path / "zs"))
    assert written["step"] == 3, written
    ckpt = read_foreign(written["written"])  # the group's parameter names, written by DCP as a list
    assert read_bytes_entry(SafeFileSystemReader(ckpt.path, bytes_entries=True), ckpt.metadata,
                            "optim.param_groups.0.params") == TRAINED  # fmt: skip

    torch.manual_seed(0)
    ref = _Model()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(PARAMS[n].to(torch.bfloat16) if n == FROZEN else PARAMS[n])
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            ref_opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": 2 * PARAMS[n], "exp_avg_sq": 3 * PARAMS[n]}
    plain = _Model()
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1.0)
    model, opt = zs.initialize(plain, opt, config=zs.ZeroConfig(stage=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zs.load_checkpoint(str(tmp_path / "zs"), model, opt)
    engine: Any = model.zero_engine
    master = engine.master_of(dict(model.named_parameters())["a.weight"])
    assert float(opt.state[master]["step"]) == 3.0 and opt.param_groups[0]["lr"] == 0.01
    assert not {"step", "bias_correction"} & set(opt.param_groups[0]), sorted(opt.param_groups[0])
    x = torch.linspace(-1, 1, 20).view(4, 5) / 100
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n].detach().float(), p.detach().float(), msg=n)
    assert float(opt.state[master]["step"]) == 4.0


@pytest.mark.parametrize("decay", [0.1, 0.0])
def test_adam_w_mode_false_warns_to_load_into_torch_adam(tmp_path, decay: float) -> None:
    tag = os.path.join(_zero1(str(tmp_path), [0, 0, 0, 0]), "global_step3")

    def l2_adam(saved: dict, base: dict) -> None:
        base["param_groups"][0].update(weight_decay=decay, bias_correction=True, step=0)
        saved["ds_config"] = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": decay}}}

    _edit(tag, l2_adam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd, report = read_deepspeed(tag)
    said = [str(w.message) for w in caught if "adam_w_mode" in str(w.message)]
    assert report["deepspeed_adam_w_mode"] is False and sd["optim.param_groups.0.weight_decay"] == decay
    if decay:  # L2 and decoupled decay differ: named, with the optimizer that continues the run
        assert len(said) == 1 and "adam_w_mode false" in said[0] and "torch.optim.Adam with the same" in said[0]
    else:  # without weight decay Adam and AdamW are the same update
        assert not said, said


def test_zero1_elastic_checkpoint_is_read(tmp_path) -> None:
    tag = os.path.join(_zero1(str(tmp_path), [1, 3, 2, 0]), "global_step3")

    def elastic(saved: dict, base: dict) -> None:  # a list of group states, no param groups
        saved["optimizer_state_dict"]["base_optimizer_state"] = [base["state"][0]]
        saved["optimizer_state_dict"]["base_optimizer_state_step"] = 0

    _edit(tag, elastic)
    sd, report = read_deepspeed(tag)
    for n in TRAINED:
        assert torch.equal(sd[f"optim.state.{n}.exp_avg"], 2 * PARAMS[n]) and sd[f"optim.state.{n}.step"] == 3.0
    assert sd["optim.param_groups.0.params"] == TRAINED and "optim.param_groups.0.lr" not in sd


def test_zero3_a_sub_group_without_moments_is_refused_naming_it(tmp_path) -> None:
    tag = _zero3(str(tmp_path), subgroups=2)
    sd, _ = read_deepspeed(tag)  # two sub-groups of one param group, all moments: read whole
    for n in TRAINED:
        assert torch.equal(sd[f"optim.state.{n}.exp_avg_sq"], 3 * PARAMS[n]), n
    assert sd["optim.param_groups.0.params"] == TRAINED

    def drop(saved: dict, base: dict) -> None:
        del base["state"][1]["exp_avg"]

    _edit(tag, drop)
    with pytest.raises(ValueError, match=r"saved exp_avg for 1 of the 2 sub-groups .*missing for sub-groups \[1\]"):
        read_deepspeed(tag)
