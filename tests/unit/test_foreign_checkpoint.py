"""Another engine's DCP checkpoint in one process (``checkpoint/foreign.py``): the
``import-checkpoint`` command's copy and report, loading either directory exactly (masters,
AdamW's moments and step, the param-group settings), and names that do not match the model.
Param groups are matched by the parameters they hold (an optimizer built with its groups in
another order gets each group's own settings; a group within one saved group takes its settings); a tied weight, saved
under each of its names, loads from either.
The continuation against FSDP2 at 2 and 3 ranks is ``tests/distributed/test_foreign_checkpoint.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import zero_strategy as zs
from zero_strategy.checkpoint.files import single_process_quiet
from zero_strategy.checkpoint.foreign import import_checkpoint
from zero_strategy.cli import main


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 7)
        self.down = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    model[0].up.bias.requires_grad_(False)  # a frozen parameter: loaded as a value, no optimizer state
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.05)
    for step in range(steps):
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with single_process_quiet():
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )


@pytest.mark.parametrize("stage", [1, 3])
def test_import_and_load_are_exact(tmp_path, capsys, stage: int) -> None:
    ref, ref_opt = _trained()
    src, dst = str(tmp_path / "fsdp2"), str(tmp_path / "zs")
    _save(src, ref, ref_opt)
    main(["import-checkpoint", src, dst])
    out = capsys.readouterr().out
    assert "model: 8 tensors, 134 elements" in out, out
    assert "7 parameters, keys exp_avg, exp_avg_sq, step" in out and "step: 3" in out, out
    for path in (src, dst):
        torch.manual_seed(1)
        model = nn.Sequential(Block(), Block())
        model[0].up.bias.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0)
        model, opt = zs.initialize(model, opt, config=zs.ZeroConfig(stage=stage), policy={Block})
        got = zs.load_checkpoint(path, model, opt)
        assert got["step"] == 3 and model.zero_engine.step_count == 3, got
        assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.05
        with zs.gathered_parameters(model):
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.detach(), q.detach()), f"{path}: {name}"
        # one process: each master is its parameter's whole flattened tensor
        masters = [model.zero_engine.master_of(p) for p in model.parameters() if p.requires_grad]
        for m, q in zip(masters, [q for q in ref.parameters() if q.requires_grad]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[m][key], ref_opt.state[q][key].reshape(-1)), f"{path}: {key}"
            assert float(opt.state[m]["step"]) == 3.0
        model.zero_engine.close()


def test_names_that_do_not_match_are_named(tmp_path) -> None:
    ref, ref_opt = _trained(1)
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)
    torch.manual_seed(0)
    other = nn.Sequential(Block(), nn.Sequential(Block()))
    model, opt = zs.initialize(other, torch.optim.AdamW(other.parameters()), config=zs.ZeroConfig(stage=2))
    with pytest.raises(
        ValueError,
        match=r"in the model but not the checkpoint: \[1\.0\.down\.bias.*in the checkpoint but not the model: \[1\.down\.bias.*Build the same model",
    ):
        zs.load_checkpoint(src, model, opt)
    model.zero_engine.close()
    with pytest.raises(SystemExit):
        main(["import-checkpoint", str(tmp_path), str(tmp_path / "out")])


def test_a_deepspeed_directory_names_the_conversion(tmp_path) -> None:
    tag = tmp_path / "global_step7"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step7")
    model = nn.Sequential(Block())
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters()), config=zs.ZeroConfig(stage=1))
    with pytest.raises(
        ValueError, match="DeepSpeed checkpoint; convert it once .*`zero-strategy import-checkpoint SRC DST`"
    ):
        zs.load_checkpoint(str(tmp_path), model, opt)
    model.zero_engine.close()
    with pytest.raises(
        ValueError, match=r"could not be read with torch.load\(weights_only=True\) \(EOFError"
    ):  # an empty file is no checkpoint
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        import_checkpoint(str(tmp_path), str(tmp_path / "out"))


def _grouped(model: nn.Module, order: tuple[str, ...]) -> list[dict]:
    """Weights and biases in their own groups (different lr and weight decay), in ``order``."""
    named = list(model.named_parameters())
    groups = {
        "decay": {"params": [p for n, p in named if n.endswith("weight")], "lr": 1e-3, "weight_decay": 0.1},
        "plain": {"params": [p for n, p in named if n.endswith("bias")], "lr": 5e-3, "weight_decay": 0.0},
    }
    return [groups[k] for k in order]


def test_param_groups_are_matched_by_their_parameters(tmp_path) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block())
    ref_opt = torch.optim.AdamW(_grouped(ref, ("decay", "plain")))
    for step in range(2):
        ref(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    src, dst = str(tmp_path / "fsdp2"), str(tmp_path / "zs")
    _save(src, ref, ref_opt)
    import_checkpoint(src, dst)  # the copy keeps each group's names
    for path in (src, dst):
        torch.manual_seed(1)
        other = nn.Sequential(Block(), Block())
        model, opt = zs.initialize(
            other, torch.optim.AdamW(_grouped(other, ("plain", "decay"))), config=zs.ZeroConfig(stage=2)
        )
        zs.load_checkpoint(path, model, opt)
        names = model.zero_engine.param_names()
        of_master = {id(model.zero_engine.master_of(p)): names[id(p)] for p in model.parameters()}
        refs = dict(ref.named_parameters())
        for group in opt.param_groups:
            for m in group["params"]:
                name = of_master[id(m)]
                want = (1e-3, 0.1) if name.endswith("weight") else (5e-3, 0.0)
                assert (group["lr"], group["weight_decay"]) == want, (path, name)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opt.state[m][key], ref_opt.state[refs[name]][key].reshape(-1)), (name, key)
        model.zero_engine.close()


def _state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, tuple]:
    """Each trained parameter's (lr, weight_decay, exp_avg, exp_avg_sq, step) on the engine, by name."""
    names = model.zero_engine.param_names()
    of_master = {id(model.zero_engine.master_of(p)): names[id(p)] for p in model.parameters() if p.requires_grad}
    out = {}
    for group in opt.param_groups:
        for m in group["params"]:
            st = opt.state[m]
            out[of_master[id(m)]] = (group["lr"], group["weight_decay"], st["exp_avg"], st["exp_avg_sq"], st["step"])
    return out


def test_a_frozen_parameter_inside_the_optimizers_group_matches(tmp_path, recwarn) -> None:
    """``AdamW(model.parameters())`` with a frozen parameter on both sides: FSDP2 lists it in its
    group, the engine owns no master for it; the groups are the same (review finding: refused)."""
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block())
    ref[0].up.bias.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05)
    ref(torch.randn(5, 4)).square().mean().backward()
    ref_opt.step()
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)
    other = nn.Sequential(Block(), Block())
    other[0].up.bias.requires_grad_(False)
    model, opt = zs.initialize(other, torch.optim.AdamW(other.parameters(), lr=1.0), config=zs.ZeroConfig(stage=3))
    zs.load_checkpoint(src, model, opt)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (3e-3, 0.05)
    assert not [w for w in recwarn if "parameter groups differ" in str(w.message)]
    model.zero_engine.close()


def test_groups_within_one_saved_group_take_its_settings_and_every_state(tmp_path) -> None:
    """DeepSpeed with a config ``optimizer`` block saves one group; the ``Trainer`` builds decay and
    no-decay groups: each takes the saved group's settings (as the saved run applied them), every
    parameter its moments and step, with a warning naming the groups (review finding: refused).
    A group spread over saved groups whose settings differ keeps its own."""
    ref, ref_opt = _trained(2)  # one group: lr 3e-3, weight decay 0.05; 0.up.bias frozen
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)
    refs = dict(ref.named_parameters())
    torch.manual_seed(1)
    other = nn.Sequential(Block(), Block())
    other[0].up.bias.requires_grad_(False)
    groups = _grouped(other, ("decay", "plain"))
    groups[1]["params"] = [p for p in groups[1]["params"] if p.requires_grad]
    model, opt = zs.initialize(other, torch.optim.AdamW(groups), config=zs.ZeroConfig(stage=2))
    with pytest.warns(
        UserWarning, match=r"groups differ.*group 1 \(first '0\.down\.bias'.*within saved group 0.*takes"
    ):
        zs.load_checkpoint(src, model, opt)
    got = _state_of(model, opt)
    assert sorted(got) == sorted(n for n, p in refs.items() if p.requires_grad)
    for name, (lr, wd, exp_avg, exp_avg_sq, step) in got.items():
        assert (lr, wd) == (3e-3, 0.05), name
        assert torch.equal(exp_avg, ref_opt.state[refs[name]]["exp_avg"].reshape(-1)), name
        assert torch.equal(exp_avg_sq, ref_opt.state[refs[name]]["exp_avg_sq"].reshape(-1)), name
        assert float(step) == 2.0, name
    model.zero_engine.close()

    torch.manual_seed(0)  # the other way: two saved groups, one optimizer group over both
    two = nn.Sequential(Block(), Block())
    two_opt = torch.optim.AdamW(_grouped(two, ("decay", "plain")))
    two(torch.randn(5, 4)).square().mean().backward()
    two_opt.step()
    src2 = str(tmp_path / "two")
    _save(src2, two, two_opt)
    other = nn.Sequential(Block(), Block())
    model, opt = zs.initialize(other, torch.optim.AdamW(other.parameters(), lr=7e-3), config=zs.ZeroConfig(stage=1))
    with pytest.warns(UserWarning, match=r"within saved group 0 .*saved group 1 .*keeps its own settings"):
        zs.load_checkpoint(src2, model, opt)
    assert opt.param_groups[0]["lr"] == 7e-3
    assert len(opt.state) == 8 and all(float(st["step"]) == 1.0 for st in opt.state.values())
    model.zero_engine.close()


def test_empty_groups_match_by_their_order(tmp_path, recwarn) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Block())
    ref_opt = torch.optim.AdamW(
        [{"params": list(ref.parameters()), "lr": 2e-3}, {"params": [], "lr": 4e-3}, {"params": [], "lr": 6e-3}]
    )
    ref(torch.randn(5, 4)).square().mean().backward()
    ref_opt.step()
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)
    other = nn.Sequential(Block())
    opt = torch.optim.AdamW([{"params": list(other.parameters())}, {"params": []}, {"params": []}], lr=1.0)
    model, opt = zs.initialize(other, opt, config=zs.ZeroConfig(stage=1))
    zs.load_checkpoint(src, model, opt)
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 4e-3, 6e-3]
    assert not [w for w in recwarn if "parameter groups differ" in str(w.message)]
    model.zero_engine.close()


def test_an_optimizer_stepping_whole_parameters_is_refused(tmp_path) -> None:
    """Muon's state lives on the owner rank's whole matrix, which this loader does not place: a
    foreign load with such an optimizer is refused, naming the fix (review finding: its groups
    were matched as empty and its state written where Muon never reads it)."""
    ref, ref_opt = _trained(1)
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)
    other = nn.Sequential(Block(), Block())
    other[0].up.bias.requires_grad_(False)
    matrices = [p for p in other.parameters() if p.ndim == 2]
    opt = torch.optim.Muon(matrices, lr=0.02)
    model, opt = zs.initialize(other, opt, config=zs.ZeroConfig(stage=1))
    with pytest.raises(ValueError, match=r"steps whole parameters .*Muon.*load_checkpoint\(path, model\)"):
        zs.load_checkpoint(src, model, opt)
    model.zero_engine.close()


class Tied(nn.Module):
    """A language model's shape: the head's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


@pytest.mark.parametrize("stage", [1, 3])
def test_tied_weights_load_under_either_name(tmp_path, stage: int) -> None:
    torch.manual_seed(0)
    ref = Tied()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    for _ in range(2):
        ref(torch.arange(5)).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    src = str(tmp_path / "fsdp2")
    _save(src, ref, ref_opt)  # holds both embed.weight and head.weight
    torch.manual_seed(1)
    other = Tied()
    model, opt = zs.initialize(other, torch.optim.AdamW(other.parameters(), lr=1.0), config=zs.ZeroConfig(stage=stage))
    got = zs.load_checkpoint(src, model, opt)
    assert got["step"] == 2
    with zs.gathered_parameters(model):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.detach(), q.detach()), name
    assert model.head.weight is model.embed.weight
    m = model.zero_engine.master_of(model.embed.weight)
    assert torch.equal(opt.state[m]["exp_avg"], ref_opt.state[ref.embed.weight]["exp_avg"].reshape(-1))
    model.zero_engine.close()


def test_tied_names_saved_with_different_values_warn(tmp_path) -> None:
    torch.manual_seed(0)
    ref = Tied()
    sd = get_model_state_dict(ref)
    sd["head.weight"] = sd["head.weight"] + 1  # not what a tied model saves
    src = str(tmp_path / "fsdp2")
    with single_process_quiet():
        dcp.save({"model": sd}, checkpoint_id=src)
    other = Tied()
    model, opt = zs.initialize(other, torch.optim.AdamW(other.parameters()), config=zs.ZeroConfig(stage=2))
    with pytest.warns(UserWarning, match=r"tied weights .* head\.weight \(loaded from embed\.weight\)"):
        zs.load_checkpoint(src, model, opt)
    with zs.gathered_parameters(model):
        assert torch.equal(model.head.weight.detach(), ref.embed.weight.detach())
    model.zero_engine.close()
