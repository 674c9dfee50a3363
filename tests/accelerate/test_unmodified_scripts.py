"""Unmodified Accelerate scripts on the engine: the start-up hook (``accelerate_zero._autostart``).

Two scripts that know nothing of zero_strategy: ``_unmodified.py`` (a training loop as
Accelerate's documentation writes one: a model with dropout and an ``abc.ABC`` base) and
Accelerate's own ``test_utils/scripts/test_script.py`` (its CI script, which trains its
``RegressionModel`` with ``accelerator.prepare`` and checks the weights against training without
Accelerate). They run under ``zero-strategy launch --zero-config FILE`` and under ``accelerate
launch`` with ``ZERO_STRATEGY_CONFIG=FILE``, against the same script under Accelerate's DDP.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.accelerate.test_accelerate_launch import ACCEL_CONFIG, BIN, REL, TIMEOUT_S, _free_port, rel_diff, run_launch
from zero_strategy.testing import assert_close, torchrun_teardown_abort

SCRIPT = Path(__file__).with_name("_unmodified.py")
CONFIGS = Path(__file__).parents[2] / "configs"
ZERO3_FREED = "zero_optimization: {stage: 3, stage3_param_persistence_threshold: 0}\n"  # units really freed
ROUTED = re.compile(r"zero-strategy: accelerator\.prepare runs models on the ZeRO-(\d) engine")


def _zero_launch(config: Path) -> list[str]:
    return [str(BIN / "zero-strategy"), "launch", "--zero-config", str(config)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("unmodified")
    ranks = run_launch(tmp, "ddp", 2, script=SCRIPT)
    return {"tmp": tmp, "ranks": ranks, "weights": torch.load(tmp / "out-ddp-2" / "weights.pt")}


@pytest.mark.parametrize("how", ["zero1 launch", "zero2 env", "zero3-freed env"])
def test_an_unmodified_accelerate_script_trains_on_the_engine_as_under_ddp(ddp: dict[str, Any], how: str) -> None:
    mode, via = how.split()
    config = CONFIGS / f"{mode}.yaml"
    if mode == "zero3-freed":
        config = ddp["tmp"] / "zero3_freed.yaml"
        config.write_text(ZERO3_FREED)
    kw: dict[str, Any] = (
        {"front": _zero_launch(config)} if via == "launch" else {"env": {"ZERO_STRATEGY_CONFIG": str(config)}}
    )
    ranks = run_launch(ddp["tmp"], mode, 2, script=SCRIPT, **kw)
    stderr = (ddp["tmp"] / f"out-{mode}-2" / "stderr.txt").read_text()
    assert ROUTED.findall(stderr) == [mode[4]], stderr[-3000:]  # announced once, on rank 0, with the file's stage
    ref = ddp["ranks"][0]
    assert ref["engine"] == "NoneType" and ref["ddp"]  # the reference really is Accelerate's DDP
    for r in ranks:
        assert r["engine"] == "ZeroEngine" and not r["ddp"], r
        assert len(r["losses"]) == len(ref["losses"]) == 12 and len(r["norms"]) == 6
        assert rel_diff(r["losses"], ref["losses"]) < REL
        assert rel_diff(r["norms"], ref["norms"]) < REL  # accelerator.clip_grad_norm_: the global norm
        assert rel_diff([r["eval"]], [ref["eval"]]) < REL
    got = torch.load(ddp["tmp"] / f"out-{mode}-2" / "weights.pt")
    assert sorted(got) == sorted(ddp["weights"])
    for name, want in ddp["weights"].items():
        assert_close(got[name], want, rtol=1e-5, atol=1e-6, what=f"{how}: {name}")


def test_what_accelerate_allows_at_zero3_model_then_optimizer_dynamo_and_a_main_only_state_dict(
    ddp: dict[str, Any],
) -> None:
    """The same unmodified script at ZeRO-3 (units really freed), with three things Accelerate
    users write: ``prepare(model)`` then ``prepare(optimizer, ...)`` in a later call (refused
    before), ``accelerate launch --dynamo_backend eager`` (silently not compiled before;
    aot_eager, as docs/advanced.md tests), and ``get_state_dict`` under ``if
    accelerator.is_main_process:`` first (waited until the timeout before; refused at once now,
    then called on every process as the error says). The numbers are DDP's."""
    config = ddp["tmp"] / "zero3_freed_short_timeout.yaml"
    config.write_text(ZERO3_FREED + "zero_strategy: {comm_timeout: 60}\n")  # the old wait, cut short
    env = {"ZERO_STRATEGY_CONFIG": str(config), "UNMOD_LATE_OPTIMIZER": "1", "UNMOD_MAIN_ONLY_STATE": "1"}
    ranks = run_launch(ddp["tmp"], "zero3-allowed", 2, script=SCRIPT, env=env, extra=["--dynamo_backend", "eager"])
    ref = ddp["ranks"][0]
    for rank, r in enumerate(ranks):
        assert r["engine"] == "ZeroEngine" and not r["ddp"] and r["compiled"], r
        assert len(r["losses"]) == len(ref["losses"]) == 12 and len(r["norms"]) == 6
        assert rel_diff(r["losses"], ref["losses"]) < REL and rel_diff(r["norms"], ref["norms"]) < REL
        assert rel_diff([r["eval"]], [ref["eval"]]) < REL
        if rank == 0:
            assert r["main_only"] is not None and r["main_only"].startswith(
                "accelerator.get_state_dict(model) under `if accelerator.is_main_process:` with a ZeRO-3 model"
            ), r["main_only"]
            assert "Call it on every process" in r["main_only"], r["main_only"]
        else:
            assert r["main_only"] is None, r
    got = torch.load(ddp["tmp"] / "out-zero3-allowed-2" / "weights.pt")
    assert sorted(got) == sorted(ddp["weights"])
    for name, want in ddp["weights"].items():
        assert_close(got[name], want, rtol=1e-5, atol=1e-6, what=f"model, then optimizer: {name}")


def test_a_script_that_would_end_in_ddp_raises(ddp: dict[str, Any]) -> None:
    """``accelerator.prepare_model(model)`` bypasses the hook's routing: with ZeRO asked for,
    the DDP it returns is refused, naming the call, instead of training DDP silently."""
    out = ddp["tmp"] / "ddp-refused"
    out.mkdir()
    cfg = ddp["tmp"] / "accel-2-refused.yaml"
    cfg.write_text(ACCEL_CONFIG.format(n=2))
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(cfg), "--num_processes", "2",
           "--main_process_port", str(_free_port()), str(SCRIPT)]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "ACCEL_JOB_OUT": str(out),
           "UNMOD_PREPARE_MODEL": "1", "ZERO_STRATEGY_CONFIG": str(CONFIGS / "zero2.yaml")}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode != 0
    for r in range(2):
        error = (out / f"rank{r}.error").read_text()
        assert error.startswith(
            "RuntimeError: accelerator.prepare_model(model): ZERO_STRATEGY_CONFIG asks for the ZeRO"
        ), error
        assert "wrapped TinyLM in DistributedDataParallel" in error and "unset ZERO_STRATEGY_CONFIG" in error, error
    assert not list(out.glob("rank*.json"))  # nothing trained


def _launch_script(tmp: Path, front: list[str], env: dict[str, str], script: str, args: list[str], last: str) -> str:
    """Run ``script args`` on 2 CPU processes; its stdout and stderr. gloo's teardown abort after
    the script printed ``last`` (its last words) is tolerated (as in ``run_launch``); any other
    failure fails."""
    cfg = tmp / "accel-2-script.yaml"
    cfg.write_text(ACCEL_CONFIG.format(n=2))
    port = str(_free_port())
    cmd = [*front, "--config_file", str(cfg), "--num_processes", "2", "--main_process_port", port, script, *args]
    full_env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, timeout=TIMEOUT_S, check=False)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    if proc.returncode != 0:
        if not (torchrun_teardown_abort(stderr) and "Traceback" not in stderr.split("exitcode")[0] and last in stdout):
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}")
        warnings.warn(f"{script}: gloo's SIGABRT at teardown after its last words (tolerated)", stacklevel=2)
    return stdout + stderr


@pytest.mark.parametrize("how", ["zero3 launch"])  # zero-strategy launch at stages 1-3: above and the example
def test_accelerates_own_test_script_passes_on_the_engine(tmp_path: Path, how: str) -> None:
    """Its training check compares the prepared model's weights with training without
    Accelerate (DDP's numbers); at ZeRO-3 it reads the 0-dim parameters outside forward, which
    the default persistence threshold keeps whole (they read NaN before the fix)."""
    mode, via = how.split()
    config = CONFIGS / f"{mode}.yaml"
    front = _zero_launch(config) if via == "launch" else [str(BIN / "accelerate"), "launch"]
    import accelerate.test_utils.scripts.test_script as ts

    env = {} if via == "launch" else {"ZERO_STRATEGY_CONFIG": str(config)}
    output = _launch_script(tmp_path, front, env, ts.__file__, [], last="reinstantiated state")
    assert ROUTED.findall(output) and set(ROUTED.findall(output)) == {mode[4]}, output[-3000:]
    assert output.count("Training yielded the same results on one CPU or distributed setup") == 4, output[-3000:]


def test_the_accelerate_example_runs_unmodified_at_zero3(tmp_path: Path) -> None:
    """``examples/accelerate_hf_gpt2.py`` as its docstring launches it (fewer steps): a GPT-2 from
    transformers with units from its ``_no_split_modules``, ``save_state``, ``save_pretrained`` and
    ``from_pretrained`` equal (the script checks that itself)."""
    example = str(Path(__file__).parents[2] / "examples" / "accelerate_hf_gpt2.py")
    args = ["--steps", "2", "--batch", "2", "--out", str(tmp_path / "gpt2")]
    last = "from_pretrained gives the same weights"
    output = _launch_script(tmp_path, _zero_launch(CONFIGS / "zero3.yaml"), {}, example, args, last=last)
    assert ROUTED.findall(output) == ["3"] and last in output, output[-3000:]
    assert (tmp_path / "gpt2-state" / "latest").is_file() and (tmp_path / "gpt2" / "config.json").is_file()


REFUSALS = r"""
import os, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
from accelerate import Accelerator
from accelerate_zero._routing import refuse_ddp
seen = []

def expect(kind, words, fn):
    try:
        fn()
    except kind as exc:
        if words not in str(exc):
            raise AssertionError(f"{words!r} not in {exc}") from exc
        seen.append(words)
    else:
        raise AssertionError(f"{words}: did not raise")

from accelerate.utils import is_compiled_module
from accelerate_zero import ZeroPlugin
acc = Accelerator(dynamo_backend="eager")
torch.manual_seed(0)
ref = nn.Linear(4, 4)
model = acc.prepare(nn.Linear(4, 4))  # the engine takes it without an optimizer; compiled last, as Accelerate does
assert is_compiled_module(model)
import zero_strategy as zs
zs.load_full_state_dict(acc.unwrap_model(model, keep_torch_compile=False), ref.state_dict())  # both start from the same weights
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
expect(RuntimeError, "gave to the ZeRO engine without an optimizer", opt.step)
opt.zero_grad()
opt = acc.prepare(opt)  # the optimizer in a later call, as Accelerate allows: bound to the model's engine
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for net, o in ((model, opt), (ref, ref_opt)):
    net(torch.ones(2, 4)).square().sum().backward()
    o.step()
    o.zero_grad()
got = acc.get_state_dict(model)
assert all(torch.allclose(got[k], v, atol=1e-7) for k, v in ref.state_dict().items()), (got, ref.state_dict())
print("LATE OPTIMIZER TRAINS")
# ZeRO-1/2: the model is compiled the way Accelerate compiles it (torch.compile with the plugin's kwargs)
net2 = nn.Linear(4, 4)
compiled, opt2 = ZeroPlugin(stage=2).prepare(acc, net2, torch.optim.SGD(net2.parameters(), lr=0.1))
assert is_compiled_module(compiled) and acc.unwrap_model(compiled, keep_torch_compile=False) is net2
compiled(torch.ones(2, 4)).sum().backward()
opt2.step()
assert sorted(acc.get_state_dict(compiled)) == ["bias", "weight"]  # the engine's model under the wrapper
print("COMPILED AT ZERO-2")
acc.state.dynamo_plugin.use_regional_compilation = True  # it would compile the engine's units, hooks included
net3 = nn.Linear(4, 4)
expect(ValueError, "Set use_regional_compilation=False",
       lambda: ZeroPlugin(stage=2).prepare(acc, net3, torch.optim.SGD(net3.parameters(), lr=0.1)))
assert not hasattr(net3, "_zero_engine")  # refused before the engine took it
acc.state.dynamo_plugin.use_regional_compilation = False
other = nn.Linear(4, 4)
torch.optim.SGD(other.parameters(), lr=0.1).step()  # an optimizer of another model steps as usual
ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
expect(ValueError, "already wrapped in DistributedDataParallel", lambda: acc.prepare(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)))
expect(RuntimeError, "wrapped Linear in DistributedDataParallel", lambda: refuse_ddp(torch.compile(ddp), "prepare_model"))
print("REFUSED", len(seen))
dist.destroy_process_group()
"""


def test_what_would_not_train_sharded_is_refused_in_one_process(tmp_path: Path) -> None:
    """A model the hook gave to the engine alone, then stepped by an optimizer of its own; a
    model the user wrapped in DDP; a DDP under ``torch.compile`` (each trained silently
    unsharded, or not at all at ZeRO-3, before). And what Accelerate allows: the optimizer
    prepared in a later call than its model (bound to the model's engine, trains as plain SGD;
    refused before), ``dynamo_backend`` (compiled at ZeRO-3 and ZeRO-2; silently not compiled
    before), regional compilation refused before the engine takes the model. Two ranks: the
    test of ``zero3-allowed`` above."""
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    env = {**os.environ, "ZERO_STRATEGY_CONFIG": str(CONFIGS / "zero3.yaml"), "PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0 and "REFUSED 4" in out, out[-2000:] + proc.stderr[-4000:]
    assert "LATE OPTIMIZER TRAINS" in out and "COMPILED AT ZERO-2" in out, out[-2000:]
