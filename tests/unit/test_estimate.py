"""``zero-strategy estimate``: the printed formulas for GPT-3 175B, the tiers with offload, the
parameter count of ``--model``, and that the command needs no torch. The measured side (the
engine's ``memory_stats()`` against this engine's formula) is in
``tests/distributed/test_bench.py``."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_strategy import cli
from zero_strategy.bench.estimate import Setup, deepspeed, estimate, this_engine, zero_paper

ROOT = Path(__file__).resolve().parents[2]
P175 = 175e9


def _row(text: str, label: str) -> list[float]:
    """The four numbers (device, host, disk, total GB) of the printed row starting with ``label``."""
    line = next(ln for ln in text.splitlines() if ln.startswith(label))
    return [float(x.replace(",", "")) for x in re.findall(r"[\d,]+\.\d+", line[len(label) :])]


def test_gpt3_175b_on_8_ranks_stage_3_prints_section_1_1_and_the_zero_paper(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["estimate", "--params", "175e9", "--ranks", "8", "--stage", "3", "--precision", "fp16"])
    text = capsys.readouterr().out
    # section 1.1: 175B x 2 bytes = 350 GB of parameters, +350 GB gradients, +700 GB Adam = 1.4 TB
    assert "350.00 + 350.00 + 700.00 = 1,400.00 GB (8 B/param" in text, text
    assert _row(text, "design notes 1.1") == [1400 / 8, 0.0, 0.0, 1400 / 8]
    # the ZeRO paper: 2 + 2 + 12 = 16 B/param, / 8 ranks at stage 3 = 350 GB per rank, all on the device
    assert _row(text, "ZeRO paper (2 + 2 + 12)") == [16 * P175 / 8 / 1e9, 0.0, 0.0, 350.0]
    # DeepSpeed's estimate_zero3 without offload: 18 B/param / N (+ 4 B x largest layer, 0 here)
    assert _row(text, "DeepSpeed estimate_zero3")[0] == 18 * P175 / 8 / 1e9 == 393.75
    assert _row(text, "this engine") == [350.0, 0.0, 0.0, 350.0]
    assert "24 GB per GPU for ZeRO-3 on 8 GPUs" in text and "cannot hold without offload" in text


def test_paper_partitioning_by_stage_and_precision() -> None:
    p, n = 1e9, 4
    got = {s: zero_paper(Setup(p, n, s, "bf16")).total for s in (0, 1, 2, 3)}
    assert got == {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    # fp32: no masters, the parameters are the masters (4 + 4 + 8)
    assert zero_paper(Setup(p, n, 3, "fp32")).total == 16 * p / n
    assert zero_paper(Setup(p, n, 3, "fp32", optimizer="sgd")).total == 8 * p / n


def test_offload_moves_bytes_between_tiers_and_the_total_stays() -> None:
    p, n = 8e9, 8
    base = this_engine(Setup(p, n, 3, "fp32"))
    cpu = this_engine(Setup(p, n, 3, "fp32", offload_optimizer="cpu", offload_param="cpu"))
    nvme = this_engine(Setup(p, n, 3, "fp32", offload_optimizer="nvme", offload_param="nvme"))
    assert (base.device, base.host, base.disk) == (16 * p / n, 0.0, 0.0)
    assert (cpu.device, cpu.host, cpu.disk) == (0.0, 16 * p / n, 0.0)
    # on disk: parameter rows and optimizer state; gradient shards stay on the host
    assert (nvme.device, nvme.host, nvme.disk) == (0.0, 4 * p / n, 12 * p / n)
    opt_only = this_engine(Setup(p, n, 3, "fp32", offload_optimizer="cpu"))  # a separate host master copy
    assert (opt_only.device, opt_only.host) == (4 * p / n, 16 * p / n)
    ds = deepspeed(Setup(p, n, 3, "bf16", offload_optimizer="cpu", offload_param="cpu", largest_layer=1e8))
    assert ds.device == 4 * 1e8 and ds.host == 18 * p * 1.5 / n


def test_bad_inputs_name_the_option() -> None:
    with pytest.raises(ValueError, match="--offload-param needs --stage 3"):
        Setup(1e9, 8, 2, offload_param="cpu")
    with pytest.raises(ValueError, match="--optimizer 'lion'"):
        Setup(1e9, 8, 2, optimizer="lion")
    with pytest.raises(ValueError, match="--ranks >= 1"):
        Setup(1e9, 0, 2)
    assert len(estimate(Setup(1e9, 2, 1))) == 4


def test_model_counts_a_bundled_gpt_and_a_hugging_face_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zero_strategy.bench.estimate import count_model
    from zero_strategy.bench.presets import gpt_config
    from zero_strategy.models import GPT, num_parameters

    total, largest = count_model("small")
    real = GPT(gpt_config("small"))
    assert total == num_parameters(real)
    assert largest == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in real.modules())
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    want = sum({id(p): p.numel() for p in GPT2LMHeadModel(cfg).parameters()}.values())  # tied head counted once
    assert count_model(str(tmp_path))[0] == want
    cli.main(["estimate", "--model", str(tmp_path / "config.json"), "--ranks", "2", "--stage", "2"])
    assert f"{float(want):.4g} parameters" in capsys.readouterr().out


def test_estimate_runs_without_importing_torch() -> None:
    code = ("import sys; from zero_strategy.cli import main; "
            "main(['estimate', '--params', '7e9', '--ranks', '8', '--stage', '3', '--precision', 'bf16']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "this engine" in done.stdout


def test_bench_arguments_reach_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from zero_strategy.bench import command

    got: dict = {}
    monkeypatch.setattr(command, "bench", lambda *a, **k: got.update(args=a, kwargs=k))
    cli.main(["bench", "--model", "d=128,layers=2", "--ranks", "1,2,4", "--steps", "3", "--rows", "ddp,zero3",
              "--update-results", "--fresh-processes", "--launcher", "own"])  # fmt: skip
    assert got["args"] == ("d=128,layers=2", (1, 2, 4), 3, 2, 1, 4, "bench-out", False, ("ddp", "zero3"),
                           "bench/RESULTS.md")  # fmt: skip
    assert got["kwargs"] == {"fresh": True, "launcher": "own"}
    with pytest.raises(SystemExit):
        cli.main(["bench", "--ranks", "1,x"])
    with pytest.raises(ValueError, match="--model 'huge'"):
        from zero_strategy.bench.presets import gpt_config

        gpt_config("huge")


def test_estimate_defaults_to_the_engines_fp32_and_reads_counts_with_suffixes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli.main(["estimate", "--params", "7B", "--ranks", "8", "--stage", "3"])
    text = capsys.readouterr().out
    assert "7e+09 parameters, 8 ranks, stage 3, fp32," in text and _row(text, "this engine")[0] == 16 * 7 / 8
    assert "GPT-3" not in text and "24 GB per GPU" not in text  # the design notes' case only when asked
    for given, want in (("70e9", 70e9), ("1.5T", 1.5e12), ("350M", 350e6), ("7b", 7e9)):
        assert cli._count(given) == want
    for bad in ("7X", "-1B", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--params '{bad}'"):
            cli._count(bad)
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    assert re.search(r"masters\) \(default:\s+fp32\)", capsys.readouterr().out)


def test_moe_selected_share_applies_to_the_expert_params_a_step_gathers(capsys: pytest.CaptureFixture[str]) -> None:
    """``--moe-experts E --moe-topk k --tokens T``: a step selects the share 1 - (1 - k/E)^T of
    the experts (each token picks k of E), so ZeRO-3 gathers that share of the expert params
    and all the dense ones; model states (every expert stored, sharded) do not change."""
    from zero_strategy.bench.estimate import gathered_params, moe_selected_share

    e, k, t = 8, 2, 4
    share = 1 - (1 - k / e) ** t  # 0.68359375
    assert moe_selected_share(e, k, t) == pytest.approx(share, rel=1e-12) and 0.68 < share < 0.69
    assert moe_selected_share(64, 8, 10_000) == pytest.approx(1.0)  # many tokens: every expert
    p, experts, persistent = 10e9, 8e9, 1e8
    s = Setup(p, 8, 3, "bf16", persistent=persistent, moe_experts=e, moe_topk=k, tokens=t, expert_params=experts)
    assert gathered_params(s) == pytest.approx(p - persistent - experts + share * experts, rel=1e-12)
    dense = Setup(p, 8, 3, "bf16", persistent=persistent)
    assert gathered_params(dense) == p - persistent
    assert this_engine(s).total == this_engine(dense).total  # model states: every expert is stored
    with pytest.raises(ValueError, match="--moe-topk"):
        Setup(p, 8, 3, moe_experts=8, moe_topk=9, tokens=4, expert_params=experts)
    with pytest.raises(ValueError, match="--expert-params"):
        Setup(p, 8, 3, moe_experts=8, moe_topk=2, tokens=4, expert_params=2 * p)
    cli.main(["estimate", "--params", "10e9", "--ranks", "8", "--stage", "3", "--precision", "bf16",
              "--moe-experts", "8", "--moe-topk", "2", "--tokens", "4", "--expert-params", "8e9"])  # fmt: skip
    text = capsys.readouterr().out
    assert "selected share 1 - (1 - 2/8)^4 = 0.6836" in text, text
    assert f"{2 * (2e9 + share * 8e9) / 1e9:,.2f} GB" in text, text  # bf16 bytes gathered per step


def test_cache_budget_adds_the_cache_tier_to_this_engines_device_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--cache-budget``: the cache tier (``zero_strategy: memory: cache``) holds gathered full
    parameters up to its cap: min(cap, b x gathered params) more device bytes at ZeRO-3."""
    from zero_strategy.bench.estimate import cache_bytes

    p, n, persistent = 7e9, 8, 5e7
    base = this_engine(Setup(p, n, 3, "bf16", persistent=persistent))
    small = this_engine(Setup(p, n, 3, "bf16", persistent=persistent, cache_budget=10e9))
    whole = this_engine(Setup(p, n, 3, "bf16", persistent=persistent, cache_budget=1e12))
    assert small.device - base.device == 10e9 and small.host == base.host  # the cap binds: 10 GB < 2 B x 7e9
    assert whole.device - base.device == pytest.approx(2 * (p - persistent), rel=1e-12)
    assert cache_bytes(Setup(p, n, 3, "bf16", cache_budget=1e12)) == 2 * p
    with pytest.raises(ValueError, match="--cache-budget needs --stage 3"):
        Setup(p, n, 2, cache_budget=1e9)
    cli.main(["estimate", "--params", "7e9", "--ranks", "8", "--stage", "3", "--precision", "bf16",
              "--cache-budget", "10GB"])  # fmt: skip
    text = capsys.readouterr().out
    assert _row(text, "this engine")[0] == pytest.approx(
        (this_engine(Setup(p, n, 3, "bf16")).device + 10e9) / 1e9, abs=0.01
    )
    assert "gather cache (cache tier) 10.00" in text, text
    # a fraction of --budget, as the memory block reads it
    cli.main(["estimate", "--params", "7e9", "--ranks", "8", "--stage", "3", "--precision", "bf16",
              "--budget", "60GB", "--cache-budget", "0.5"])  # fmt: skip
    assert "gather cache (cache tier) 14.00" in capsys.readouterr().out  # min(30 GB, 2 B x 7e9)
