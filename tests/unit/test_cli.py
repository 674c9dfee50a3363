"""The ``zero-strategy`` command line: ``check`` (every problem of a config in one run, the
resolved config with the honoured and ignored DeepSpeed keys), ``--help`` without torch, and
subcommands from the ``zero_strategy.commands`` entry points."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from zero_strategy import cli
from zero_strategy.config import ZeroConfig

ROOT = Path(__file__).resolve().parents[2]

THREE_MISTAKES = """\
zero_optimization: {stage: 3, reduce_bucket_sise: 100}
fp16: {enabled: true, hysteresis: 0}
zero_strategy: {compression: {type: topk}}
"""

HF_STYLE = """\
train_micro_batch_size_per_gpu: auto
gradient_clipping: 1.0
bf16: {enabled: true}
zero_optimization:
  stage: 3
  overlap_comm: 1
  reduce_bucket_size: auto
  stage3_prefetch_bucket_size: 0
  round_robin_gradients: true
  allgather_partitions: false
"""


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(["check", *argv])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out + out.err


def test_check_prints_every_problem_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "three.yaml"
    path.write_text(THREE_MISTAKES)
    code, text = _check(capsys, str(path))
    assert code == 1, text
    assert f"{path}: 3 problems" in text, text
    for part in ("unknown key 'zero_optimization.reduce_bucket_sise'", "did you mean 'reduce_bucket_size'?",
                 "fp16.hysteresis: must be > 0, got 0", "compression.type='topk' works at ZeRO stages 1 and 2"):  # fmt: skip
        assert part in text, text


def test_check_prints_the_resolved_config_with_honoured_and_ignored_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hf.yaml"
    path.write_text(HF_STYLE)
    code, text = _check(capsys, str(path))
    assert code == 0, text
    assert f"{path}: OK" in text
    resolved = text.split("resolved config")[1].split("\n\n")[0]
    lines = {line.split()[0]: line for line in resolved.splitlines()[1:]}
    assert len(lines) == len(dataclasses.fields(ZeroConfig)) - 1  # every field but _explicit
    assert lines["stage"].split()[1:] == ["3", "zero_optimization.stage"], lines["stage"]
    assert lines["overlap_comm"].split()[1:] == ["True", "zero_optimization.overlap_comm"]
    assert lines["reduce_bucket_size"].split()[1:] == ["4000000", "default"]
    assert lines["stage3_prefetch_bucket_size"].split()[1] == "0"
    assert "bf16.enabled" in lines["precision"] and "bf16" in lines["precision"]
    assert lines["gradient_clipping"].split()[1:] == ["1.0", "gradient_clipping"]
    honoured = text.split("honoured")[1].split("\n\n")[0]
    for key in (
        "zero_optimization.stage -> stage",
        "bf16.enabled -> precision",
        "gradient_clipping -> gradient_clipping",
    ):
        assert key in honoured, honoured
    assert "allgather_partitions=False is read but not applied" in text.split("read but not applied:")[1]
    ignored = text.split("ignored")[-1]
    assert "zero_optimization.round_robin_gradients" in ignored and "train_micro_batch_size_per_gpu" in ignored
    assert "zero_optimization.reduce_bucket_size" in text.split('"auto"')[1]


def test_check_with_world_size_and_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lb.yaml"
    path.write_text(
        "zero_optimization: {offload_param: {device: cpu}}\nzero_strategy: {load_balance: {scores: [3, 1]}}\n"
    )
    code, text = _check(capsys, str(path))
    assert code == 1 and "offload_param needs stage 3 (got stage 2)" in text, text
    assert "1 problem" in text and "zero_optimization.stage is not set" in text
    code, text = _check(capsys, str(path), "--stage", "3", "--world-size", "2")
    assert code == 0 and ": OK" in text, text
    stage_line = next(line for line in text.splitlines() if line.split()[:1] == ["stage"])
    assert stage_line.split()[1:] == ["3", "--stage"], stage_line
    code, text = _check(capsys, str(path), "--stage", "3", "--world-size", "4")
    assert code == 1 and "load_balance.scores has 2 entries for 4 ranks" in text, text
    code, text = _check(capsys, str(tmp_path / "missing.yaml"))
    assert code == 1 and "not found" in text


def test_help_lists_every_subcommand_and_imports_entry_points_only_when_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[list[str]] = []

    def load() -> object:
        return ran.append

    fake = {"launch": SimpleNamespace(name="launch", value="accelerate_zero.launch:main", load=load),
            "convert": SimpleNamespace(name="convert", value="lightning_zero.convert:main", load=load)}  # fmt: skip
    monkeypatch.setattr(cli, "_plugin_commands", lambda: fake)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for name in ("export", "check", "launch", "convert"):
        assert f"    {name}" in text, text
    assert ran == []
    cli.main(["convert", "a", "--b"])
    assert ran == [["a", "--b"]]


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from zero_strategy.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('SECONDS', time.perf_counter() - t); print('TORCH', 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    wall = time.perf_counter() - t0
    assert "TORCH False" in out.stdout, out.stdout + out.stderr
    for name in ("export", "check", "launch"):
        assert f"    {name}" in out.stdout, out.stdout
    print(f"zero-strategy --help: {wall:.2f} s in a fresh interpreter")


def test_lazy_public_names_match_the_type_checking_imports() -> None:
    import ast

    import zero_strategy

    tree = ast.parse((ROOT / "zero_strategy" / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    typed = {a.name: n.module for n in guarded.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == zero_strategy._PUBLIC
    assert set(zero_strategy.__all__) == {"__version__", *typed}
    for name, module in typed.items():
        assert getattr(zero_strategy, name) is getattr(sys.modules[module], name)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        zero_strategy.nope  # noqa: B018


def test_single_process_save_load_export_do_not_warn_and_help_has_no_raw_docstrings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One process is a supported case: DCP's "torch.distributed is disabled" warning is not shown
    by a save, a load or ``export``; ``check``/``export --help`` read as help, not as docstrings."""
    import warnings

    import torch

    import zero_strategy as zs

    model, opt = zs.initialize(torch.nn.Linear(3, 2), lambda p: torch.optim.SGD(p, lr=0.1), config="zero3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.save_checkpoint(tmp_path / "ckpt", model, opt)
        zs.load_checkpoint(tmp_path / "ckpt", model, opt)
        cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors")])
    zs.destroy(model)
    assert [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)] == []
    for name in ("check", "export"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        text = capsys.readouterr().out
        assert "Args:" not in text and "Returns" not in text and "usage: zero-strategy" in text, text


def test_check_lists_auto_precision_switches_as_auto_and_a_loss_scale_only_fp16_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' ``ds_config_zero3.json``: ``bf16.enabled`` and ``fp16.enabled`` are ``"auto"``
    (the ``Trainer``'s ``--bf16``/``--fp16`` decide), so they are left auto, not honoured; the fp16
    block's ``hysteresis`` applies only if fp16 is turned on, and a disabled block's not at all."""
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(
        '{"fp16": {"enabled": "auto", "loss_scale": 0, "hysteresis": 2}, "bf16": {"enabled": "auto"},'
        ' "zero_optimization": {"stage": 3}}'
    )
    code, text = _check(capsys, str(path))
    assert code == 0, text
    honoured = text.split("honoured")[1].split("\n\n")[0]
    assert "bf16.enabled" not in honoured and "fp16.enabled" not in honoured, honoured
    auto = text.split('left "auto"')[1].split("\n\n")[0]
    assert "bf16.enabled" in auto and "fp16.enabled" in auto, auto
    resolved = text.split("resolved config")[1].split("\n\n")[0]
    scale = next(line for line in resolved.splitlines() if line.split()[0] == "loss_scale")
    assert "only if fp16.enabled" in scale, scale
    path.write_text('{"fp16": {"enabled": false, "hysteresis": 2}, "zero_optimization": {"stage": 3}}')
    code, text = _check(capsys, str(path))
    resolved = text.split("resolved config")[1].split("\n\n")[0]
    scale = next(line for line in resolved.splitlines() if line.split()[0] == "loss_scale")
    assert scale.split()[1:] == ["(defaults)", "default"], scale
    assert "fp16.hysteresis -> loss_scale" not in text and "fp16.hysteresis" in text.split("ignored")[-1], text
