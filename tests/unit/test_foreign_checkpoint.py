"""Another engine's DCP checkpoint in one process (``checkpoint/foreign.py``): the
``import-checkpoint`` command's copy and report, loading either directory exactly (masters,
AdamW's moments and step, the param-group settings), and names that do not match the model.
The continuation against FSDP2 at 2 and 3 ranks is ``tests/distributed/test_foreign_checkpoint.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import zero_strategy as zs
from zero_strategy.checkpoint.files import single_process_quiet
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
        from zero_strategy.checkpoint.foreign import import_checkpoint

        (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        import_checkpoint(str(tmp_path), str(tmp_path / "out"))
