"""ZeroPlugin's settings, single process: files, the environment, the Accelerator's values,
and ``zero-strategy launch`` refusing a bad config before any process starts."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zero_strategy as zs
from accelerate_zero import CONFIG_ENV, ZeroPlugin, launch
from accelerate_zero.plugin import pair_models_and_optimizers
from zero_strategy import cli
from zero_strategy.config import PrecisionConfig


def write(tmp_path: Path, text: str, name: str = "zero.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def fake_accelerator(mixed: str = "no", gas: int = 1, native_amp: bool = True) -> SimpleNamespace:
    return SimpleNamespace(mixed_precision=mixed, gradient_accumulation_steps=gas, native_amp=native_amp)


def test_from_file_reads_deepspeed_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "zero_optimization:\n  stage: 3\n  reduce_bucket_size: 1e5\ngradient_clipping: 1.0\n")
    plugin = ZeroPlugin.from_file(path)
    assert (plugin.config.stage, plugin.config.reduce_bucket_size, plugin.config.gradient_clipping) == (3, 100000, 1.0)


def test_from_config_object_and_overrides() -> None:
    plugin = ZeroPlugin(zs.ZeroConfig(stage=1), prefetch=2)
    assert (plugin.config.stage, plugin.config.prefetch) == (1, 2)
    with pytest.raises(ValueError, match="stage=1 from the config conflicts with stage=3"):
        ZeroPlugin({"zero_optimization": {"stage": 1}}, stage=3)


def test_from_env_file_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "zero_optimization:\n  reduce_bucket_size: 1000\n")
    env = {CONFIG_ENV: path, "ZERO_STRATEGY_STAGE": "3", "ZERO_STRATEGY_OVERLAP_COMM": "false",
           "ZERO_STRATEGY_PRECISION": "bf16", "OTHER": "x"}  # fmt: skip
    cfg = ZeroPlugin.from_env(environ=env).config
    assert (cfg.stage, cfg.overlap_comm, cfg.reduce_bucket_size) == (3, False, 1000)
    assert cfg.precision.param_dtype == torch.bfloat16
    assert ZeroPlugin.from_env(environ={}).config == zs.ZeroConfig()
    assert (
        ZeroPlugin.from_env(environ={CONFIG_ENV: "zero3_offload"}).config
        == ZeroPlugin.from_file("zero3_offload").config
    )  # the built-in presets by name, from any directory
    assert launch._launch_options(["--zero-config", "zero2", "t.py"])[0][CONFIG_ENV] == "zero2"


def test_from_env_missing_file_fails_before_training(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(FileNotFoundError, match=f"{CONFIG_ENV}='{missing}': the file does not exist"):
        ZeroPlugin.from_env(environ={CONFIG_ENV: missing})
    with pytest.raises(ValueError, match=f"{CONFIG_ENV} is set but empty"):
        ZeroPlugin.from_env(environ={CONFIG_ENV: " "})


def test_from_env_bad_key_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "zero_optimization:\n  reduce_bucket_sise: 1000\n")
    with pytest.raises(
        ValueError,
        match=r"ZERO_STRATEGY_CONFIG=.*unknown key 'zero_optimization.reduce_bucket_sise'.*did you mean 'reduce_bucket_size'",
    ):
        ZeroPlugin.from_env(environ={CONFIG_ENV: path})


def test_from_env_bad_variables(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="ZERO_STRATEGY_STAGEE='3' is not a zero_strategy setting; did you mean ZERO_STRATEGY_STAGE"
    ):
        ZeroPlugin.from_env(environ={"ZERO_STRATEGY_STAGEE": "3"})
    with pytest.raises(ValueError, match="stage.*ZERO_STRATEGY_STAGE"):
        ZeroPlugin.from_env(environ={"ZERO_STRATEGY_STAGE": "7"})
    path = write(tmp_path, "zero_optimization:\n  stage: 2\n")
    with pytest.raises(ValueError, match="stage=2 from the config conflicts with stage=3"):
        ZeroPlugin.from_env(environ={CONFIG_ENV: path, "ZERO_STRATEGY_STAGE": "3"})
    with pytest.raises(ValueError, match="nested settings go in the file"):
        ZeroPlugin.from_env(environ={"ZERO_STRATEGY_PREFETCH": "{a: 1}"})


def test_accelerator_settings_map_onto_the_engine(tmp_path: Path) -> None:
    # Accelerate's names keep Accelerate's meaning: autocast over fp32 parameters
    cfg = ZeroPlugin(stage=2).resolved_config(fake_accelerator("bf16", gas=4))
    assert cfg.precision == PrecisionConfig(autocast_dtype=torch.bfloat16) and cfg.gradient_accumulation_steps == 4
    assert ZeroPlugin().resolved_config(fake_accelerator("fp16")).precision == PrecisionConfig(
        autocast_dtype=torch.float16
    )
    assert not ZeroPlugin().resolved_config(fake_accelerator("no")).precision.enabled
    # fp16 that Accelerate itself does not apply (on a CPU: native_amp False) is not applied either
    assert not ZeroPlugin().resolved_config(fake_accelerator("fp16", native_amp=False)).precision.enabled
    # Accelerator "no" leaves the file's precision alone; the file's DeepSpeed bf16 (16-bit parameters)
    # stays under Accelerate's "bf16"; another dtype conflicts
    plugin = ZeroPlugin({"bf16": {"enabled": True}})
    assert plugin.resolved_config(fake_accelerator("no")).precision.param_dtype == torch.bfloat16
    assert plugin.resolved_config(fake_accelerator("bf16")).precision.param_dtype == torch.bfloat16
    with pytest.raises(
        ValueError,
        match=r"precision=bf16 from the config conflicts with precision=16-mixed from Accelerator\(mixed_precision='fp16'",
    ):
        plugin.resolved_config(fake_accelerator("fp16"))
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps=4 from the config conflicts.*gradient_accumulation_steps=2"
    ):
        ZeroPlugin({"gradient_accumulation_steps": 4}).resolved_config(fake_accelerator(gas=2))
    assert (
        ZeroPlugin({"gradient_accumulation_steps": 2})
        .resolved_config(fake_accelerator(gas=2))
        .gradient_accumulation_steps
        == 2
    )
    # Accelerate's default (1) counts as "not given": the file's value applies
    assert (
        ZeroPlugin({"gradient_accumulation_steps": 4})
        .resolved_config(fake_accelerator(gas=1))
        .gradient_accumulation_steps
        == 4
    )
    with pytest.raises(ValueError, match="mixed_precision='fp8'.*use 'no', 'bf16' or 'fp16'"):
        ZeroPlugin().resolved_config(fake_accelerator("fp8"))


def test_shard_size_and_parallelism_config_reach_the_engine_config() -> None:
    from accelerate import ParallelismConfig

    assert ZeroPlugin(shard_size=2).config.shard_size == 2
    assert ZeroPlugin.from_env(environ={"ZERO_STRATEGY_SHARD_SIZE": "node"}).config.shard_size == "node"
    acc = fake_accelerator()
    acc.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=4)  # HSDP: groups of 4, 2 replicas
    assert ZeroPlugin(stage=3).resolved_config(acc).shard_size == 4
    with pytest.raises(
        ValueError, match=r"shard_size=2 from the config conflicts with shard_size=4 from .*ParallelismConfig"
    ):
        ZeroPlugin(shard_size=2).resolved_config(acc)
    acc.parallelism_config = ParallelismConfig(dp_replicate_size=2)  # dp_shard_size 1: not given
    assert ZeroPlugin(shard_size=2).resolved_config(acc).shard_size == 2
    acc.parallelism_config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"ParallelismConfig\(tp_size=2\) is not supported"):
        ZeroPlugin().resolved_config(acc)


def test_prepare_pairs_each_model_with_its_optimizer() -> None:
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert pair_models_and_optimizers((model, opt, None)) == [(model, [opt])]
    # several models, one of them without an optimizer (evaluation, gradient checks)
    assert pair_models_and_optimizers((other, model, opt)) == [(other, []), (model, [opt])]
    assert pair_models_and_optimizers((model,)) == [(model, [])]
    # several optimizers on one model, in the order given (disjoint parameters: initialize checks)
    weight, bias = torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)
    assert pair_models_and_optimizers((model, bias, other, weight)) == [(model, [bias, weight]), (other, [])]
    with pytest.raises(ValueError, match="no model among the objects"):
        pair_models_and_optimizers((opt,))
    with pytest.raises(ValueError, match="holds parameters of no model given here"):
        pair_models_and_optimizers((other, opt))
    mixed = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="holds parameters of 2 of the models given"):
        pair_models_and_optimizers((model, other, mixed))
    with pytest.raises(TypeError, match="expected an accelerate.Accelerator, got SimpleNamespace"):
        ZeroPlugin().prepare(fake_accelerator(), model, opt)


def test_cli_launch_refuses_bad_config_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--zero-config", str(tmp_path / "nope.yaml"), "train.py"])
    assert exc.value.code == 2
    assert "the file does not exist" in capsys.readouterr().err
    bad = write(tmp_path, "zero_optimization:\n  stag: 3\n")
    with pytest.raises(ValueError, match="did you mean 'stage'"):
        launch.launch(["--zero-config", bad, "train.py"])
    with pytest.raises(ValueError, match="--zero-config FILE is required"):
        launch.launch(["--num_processes", "2", "train.py"])
    good = write(tmp_path, "zero_optimization:\n  stage: 3\n", "good.yaml")
    with pytest.raises(ValueError, match="--cpu with --num_processes 2 starts ONE process"):
        launch.launch(["--zero-config", good, "--cpu", "--num_processes", "2", "train.py"])


def test_cli_launch_names_every_problem_and_conflict_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(
        tmp_path, "zero_optimization:\n  stage: 2\n  stag: 3\n  overlap_comm: maybe\n  offload_param: {device: cpu}\n"
    )
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--zero-config", bad, "train.py"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "3 problems" in err, err
    for part in ("did you mean 'stage'", "overlap_comm: expected true or false", "offload_param needs stage 3"):
        assert part in err, err
    unset = write(tmp_path, "zero_optimization:\n  offload_param: {device: cpu}\n", "no_stage.yaml")
    with pytest.raises(ValueError, match=r"offload_param needs stage 3 \(got stage 2\)"):  # the resolved config
        launch.launch(["--zero-config", unset, "train.py"])
    with pytest.raises(ValueError, match="--cpu with --num_processes 2"):  # --zero-stage 3 resolves it
        launch.launch(["--zero-config", unset, "--zero-stage", "3", "--cpu", "--num_processes", "2", "train.py"])
    with pytest.raises(zs.config.ConfigError) as info:  # from_env keeps the list of problems
        ZeroPlugin.from_env(environ={CONFIG_ENV: bad})
    assert len(info.value.problems) == 3 and f"{CONFIG_ENV}='{bad}'" in str(info.value)


def test_launch_names_a_missing_script_and_starts_cpu_processes_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong script name is one line before any process starts; a config asking for 2 processes
    on a machine without GPUs gets ``ACCELERATE_USE_CPU=true`` (else: 2 separate trainings)."""
    import accelerate.commands.launch as accelerate_launch

    started: list[str | None] = []
    monkeypatch.setattr(
        accelerate_launch, "launch_command", lambda args: started.append(os.environ.get("ACCELERATE_USE_CPU"))
    )
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--zero-config", "zero3", "trian.py"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "script 'trian.py' does not exist" in err, err
    assert started == []
    (tmp_path / "train.py").write_text("")
    cpu = str(Path(__file__).resolve().parents[2] / "configs" / "accelerate_cpu.yaml")
    launch.launch(["--zero-config", "zero3", "--config_file", cpu, "train.py"])
    assert started == ["true"] and "2 CPU processes (gloo), ACCELERATE_USE_CPU=true" in capsys.readouterr().err
    assert os.environ.pop(CONFIG_ENV) == "zero3" and os.environ.pop("ACCELERATE_USE_CPU") == "true"
    launch.launch(["--zero-config", "zero3", "--cpu", "train.py"])  # one process: nothing to set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    launch.launch(["--zero-config", "zero3", "--config_file", cpu, "train.py"])  # GPUs: Accelerate's own choice
    assert started == ["true", None, None]
    os.environ.pop(CONFIG_ENV)


def test_a_lone_process_of_a_multi_process_launch_refuses_to_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes that each believe they are rank 0 of world 1 would save into one place."""
    model, opt = zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config="zero2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"one of WORLD_SIZE=2 processes \(RANK=1\) but has no process group"):
        zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    zs.destroy(model)


def test_shared_parameters_and_destroy_after_mixed_precision() -> None:
    from accelerate import Accelerator

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    other.weight = model.weight
    with pytest.raises(ValueError, match="Linear and Linear share a parameter.*nn.ModuleDict"):
        pair_models_and_optimizers((model, other))
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = ZeroPlugin(stage=2).prepare(acc, torch.nn.Linear(2, 2), None)
    x = torch.ones(1, 2)
    assert model(x).dtype == torch.float32  # autocast inside, outputs converted to fp32
    zs.destroy(model)
    assert type(model) is torch.nn.Linear and "forward" not in vars(model)
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


@pytest.mark.parametrize(
    ("name", "processes", "mixed"), [("accelerate_cpu.yaml", 2, "no"), ("accelerate_gpu.yaml", 8, "bf16")]
)
def test_shipped_accelerate_configs_load_as_multi_process_launches(name: str, processes: int, mixed: str) -> None:
    """``configs/accelerate_*.yaml`` load with Accelerate's own reader (it refuses unknown
    keys) and make ``accelerate launch`` start N processes (not ``--cpu``'s one)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config_from_file(str(path))
    assert (cfg.distributed_type.value, cfg.num_processes, str(cfg.mixed_precision)) == ("MULTI_GPU", processes, mixed)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    assert (args.multi_gpu, args.cpu, args.num_processes) == (True, False, processes)
    assert ZeroPlugin.from_file(path.with_name("zero3.yaml")).config.stage == 3  # the pair docs/accelerate.md names


def test_launch_refuses_when_the_start_up_hook_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the installed ``.pth`` line the launched script would train DDP: refuse first."""
    assert launch.hook_files(), "the package's install (pip install -e .) puts zero_strategy_accelerate.pth here"
    assert launch.hook_active({**os.environ, CONFIG_ENV: "z.yaml"}) and not launch.hook_active(
        {**os.environ, CONFIG_ENV: ""}
    )  # the probe sees the effect: a child with the variable runs the hook, one without does not
    good = write(tmp_path, "zero_optimization:\n  stage: 2\n", "good.yaml")
    monkeypatch.setattr(launch, "hook_active", lambda environ: False)
    with pytest.raises(RuntimeError, match=r"start-up hook \(zero_strategy_accelerate.pth\) does not run"):
        launch.launch(["--zero-config", good, "train.py"])


def test_the_start_up_line_costs_nothing_unless_asked_and_then_imports_no_torch() -> None:
    """The installed line is the repository's; unset, it imports nothing; set, it only registers a
    finder (torch and Accelerate load when the script imports them), and a later ``import
    accelerate`` comes back wrapped."""
    import os
    import subprocess
    import sys

    source = Path(__file__).parents[2] / "integrations" / "zero_strategy_accelerate.pth"
    for installed in launch.hook_files():
        assert Path(installed).read_text() == source.read_text(), installed
    probe = (
        "import sys; print('accelerate_zero' in sys.modules, 'torch' in sys.modules, "
        "any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path))"
    )
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    unset = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert unset.stdout.split() == ["False", "False", "False"], unset
    asked = subprocess.run([sys.executable, "-c", probe], env={**env, CONFIG_ENV: "z.yaml"}, capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert asked.stdout.split() == ["True", "False", "True"], asked
    wrapped = "import accelerate; print(accelerate.Accelerator._zero_strategy_autostart)"
    out = subprocess.run([sys.executable, "-c", wrapped], env={**env, CONFIG_ENV: "z.yaml"}, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "True", out


def test_launch_refuses_a_script_still_passed_deepspeed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--deepspeed ds_config.json`` among the script's arguments makes the ``Trainer`` start
    DeepSpeed (``PackageNotFoundError: deepspeed`` where it is not installed): refused before
    any process starts, naming the fix. Accelerate's own options before the script are not it."""
    import accelerate.commands.launch as accelerate_launch

    started: list[str] = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: started.append(args.training_script))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for extra in (["--deepspeed", "ds_config.json"], ["--deepspeed=ds_config.json"]):
        with pytest.raises(ValueError, match=r"--deepspeed ds_config\.json.*drop --deepspeed") as info:
            launch.launch(["--zero-config", "zero3", "--cpu", "train.py", "--lr", "1", *extra])
        assert "--zero-config ds_config.json" in str(info.value)
    assert started == []
    launch.launch(["--zero-config", "zero3", "--cpu", "train.py", "--deepspeed_note", "x"])  # another flag
    assert started == ["train.py"]
    os.environ.pop(CONFIG_ENV)
