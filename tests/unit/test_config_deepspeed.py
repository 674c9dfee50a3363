"""ZeroConfig, continued (``test_config.py``): DeepSpeed keys that are recognised, reported or
refused, the warnings said once per job, and the shipped config files."""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.unit.test_config import SPEC_YAML
from zero_strategy.config import (
    OffloadConfig,
    ZeroConfig,
)

# A DeepSpeed config as Hugging Face Trainer/Accelerate examples write it.


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --------------------------------------------------------------------------- defaults and kwargs


def test_warns_once_for_ignored_deepspeed_keys():
    d = {
        "zero_optimization": {"stage": 2, "round_robin_gradients": True, "cpu_offload": False},
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "fp16": {"auto_cast": False},
    }
    with pytest.warns(UserWarning) as record:
        cfg = ZeroConfig.from_dict(d, source="ds.json")
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert "does not implement" in messages[0] and "ds.json" in messages[0]
    for key in ("zero_optimization.round_robin_gradients", "bf16.immediate_grad_update", "fp16.auto_cast"):
        assert key in messages[0]
    assert "cpu_offload" not in messages[0]  # read: DeepSpeed's legacy switch for offload_optimizer
    assert cfg.stage == 2 and cfg.precision.param_dtype == torch.bfloat16 and not cfg.offload_optimizer.enabled


# DeepSpeed 0.19's newer keys (runtime/config.py, zero/config.py, zero/offload_config.py), each
# recognised and reported as not implemented instead of an unknown key
RECENT_DEEPSPEED = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.8},
        "zenflow": {"topk_ratio": 0.1},
        "leaf_module": {"classes": ["MixtralSparseMoeBlock"]},
    },
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    "compile": {"deepcompile": True},
    "tensor_parallel": {"autotp_size": 2},
    "expert_parallel": {"enabled": True},
}
RECENT_KEYS = (
    "zero_optimization.offload_optimizer.super_offload", "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    "zero_optimization.zenflow", "zero_optimization.leaf_module", "torch_autocast", "compile", "tensor_parallel",
    "expert_parallel",
)  # fmt: skip


def test_recent_deepspeed_keys_are_recognised_and_reported_as_not_implemented(tmp_path):
    from zero_strategy.config.report import check_file

    with pytest.warns(UserWarning) as record:
        cfg = ZeroConfig.from_dict(RECENT_DEEPSPEED, source="ds.json")
    message = next(str(w.message) for w in record if "does not implement" in str(w.message))
    assert all(key in message for key in RECENT_KEYS), message
    assert cfg.stage == 3 and cfg.offload_optimizer.device == "cpu"  # the rest of the block is read
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(RECENT_DEEPSPEED))
    report = check_file(str(path))
    assert not report.problems, report.problems
    why = dict(report.ignored)
    assert all("not implemented" in why[key] for key in RECENT_KEYS), why
    assert "MoE" in why["zero_optimization.leaf_module"] and "moe.md" in why["zero_optimization.leaf_module"]


def test_mics_shard_size_is_our_shard_size(tmp_path):
    from zero_strategy.config.report import check_file

    d = {"zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True}}
    with pytest.warns(UserWarning) as record:
        cfg = ZeroConfig.from_dict(d, source="ds.json")
    assert cfg.shard_size == 8 and cfg.explicitly_set("shard_size")
    message = next(str(w.message) for w in record if "does not implement" in str(w.message))
    assert "mics_hierarchical_params_gather" in message and "mics_shard_size" not in message
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(d))
    why = dict(check_file(str(path)).ignored)
    assert "zero_optimization.mics_shard_size" not in why
    assert "shard group" in why["zero_optimization.mics_hierarchical_params_gather"]
    assert ZeroConfig.from_dict({"zero_optimization": {"mics_shard_size": -1}}).shard_size is None  # DeepSpeed's off
    assert ZeroConfig(shard_size="4").shard_size == 4 and ZeroConfig().shard_size is None
    assert ZeroConfig.from_dict(ZeroConfig(shard_size=2).to_dict()).shard_size == 2  # the flat form
    with pytest.raises(ValueError, match="0 is not a shard size"):
        ZeroConfig(shard_size=0)
    both = {"zero_optimization": {"mics_shard_size": 2}, "zero_strategy": {"shard_size": 4}}
    with pytest.raises(ValueError, match="conflicts with zero_optimization.mics_shard_size=2"):
        ZeroConfig.from_dict(both)


def test_zero_quantized_gradients_is_read_and_refused_with_topk():
    import warnings

    for stage in (1, 2, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # honoured: no "does not implement" warning
            cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}})
        assert cfg.zero_quantized_gradients
    both = {
        "zero_optimization": {"stage": 2, "zero_quantized_gradients": True},
        "zero_strategy": {"compression": {"type": "topk"}},
    }
    with pytest.raises(ValueError, match="zero_quantized_gradients with compression.type='topk'.*remove one"):
        ZeroConfig.from_dict(both)


def test_zero_hpz_partition_size_is_read(tmp_path):
    from zero_strategy.config.report import check_file

    zo = {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_nontrainable_weights": True}
    d = {"zero_optimization": zo}
    with pytest.warns(UserWarning) as record:
        cfg = ZeroConfig.from_dict(d, source="ds.json")
    assert cfg.zero_hpz_partition_size == 8 and cfg.explicitly_set("zero_hpz_partition_size")
    message = next(str(w.message) for w in record if "does not implement" in str(w.message))
    assert "zero_quantized_nontrainable_weights" in message and "zero_hpz_partition_size" not in message
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(d))
    assert "zero_optimization.zero_hpz_partition_size" not in dict(check_file(str(path)).ignored)
    assert ZeroConfig().zero_hpz_partition_size == 1  # DeepSpeed's default: off
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        ZeroConfig(zero_hpz_partition_size=0)
    with pytest.raises(ValueError, match="zero_hpz_partition_size needs stage 3"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    with pytest.raises(ValueError, match="zero_hpz_partition_size with zero_strategy.memory"):
        ZeroConfig(stage=3, zero_hpz_partition_size=2, memory={"budget": "1GiB"})


def test_legacy_cpu_offload_means_optimizer_offload():
    cfg = ZeroConfig.from_dict(
        {"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}
    )
    assert cfg.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)


def test_settings_read_but_not_applied_are_reported_once_at_initialize():
    import zero_strategy as zs
    from zero_strategy.config import not_applied_settings

    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "allgather_partitions": False, "reduce_scatter": False,
                                                      "contiguous_gradients": True, "sub_group_size": 1e9}})  # fmt: skip
    messages = not_applied_settings(cfg)
    assert sorted(m.split("=")[0] for m in messages) == ["allgather_partitions", "reduce_scatter", "sub_group_size"]
    assert all("is read but not applied by zero_strategy; in DeepSpeed it" in m for m in messages)
    assert not_applied_settings(ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "reduce_scatter": True}})) == []
    with pytest.warns(UserWarning, match="allgather_partitions=False is read but not applied") as record:
        zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
    assert sum("not applied" in str(w.message) for w in record) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second engine says nothing
        zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)


def test_warns_for_frontend_owned_keys():
    pattern = r"top-level DeepSpeed keys in <dict>.*front-end owns them: optimizer, steps_per_print"
    with pytest.warns(UserWarning, match=pattern):
        cfg = ZeroConfig.from_dict({"optimizer": {"type": "Adam"}, "steps_per_print": 10})
    assert cfg == ZeroConfig()


def test_clean_config_does_not_warn():
    with _no_warnings():
        cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}})
    assert cfg.stage == 1


# --------------------------------------------------------------------------- files


def test_deepspeed_zero_bucket_sizes_are_accepted():
    d = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 0, "allgather_bucket_size": 0,
                               "stage3_prefetch_bucket_size": 0}}  # fmt: skip
    with pytest.warns(UserWarning, match=r"_bucket_size: 0 \(DeepSpeed's 'no bucketing'\) is read as 1") as record:
        cfg = ZeroConfig.from_dict(d, source="hf.json")
    assert [str(w.message).count("read as 1") for w in record] == [1, 1]  # said once per key
    assert (cfg.reduce_bucket_size, cfg.allgather_bucket_size, cfg.stage3_prefetch_bucket_size) == (1, 1, 0)
    with pytest.raises(ValueError, match=r"zero_optimization.reduce_bucket_size: must be >= 0, got -1"):
        ZeroConfig.from_dict({"zero_optimization": {"reduce_bucket_size": -1}})


def test_deepspeed_integer_booleans_are_accepted():
    with _no_warnings():
        cfg = ZeroConfig.from_dict(
            {
                "zero_optimization": {
                    "overlap_comm": 0,
                    "contiguous_gradients": 1,
                    "offload_optimizer": {"device": "cpu", "pin_memory": 1},
                },
                "bf16": {"enabled": 1},
            }  # fmt: skip
        )
    assert cfg.overlap_comm is False and cfg.contiguous_gradients is True and cfg.offload_optimizer.pin_memory is True
    assert cfg.precision.param_dtype == torch.bfloat16
    assert ZeroConfig(check_unit_order=0).check_unit_order is False
    with pytest.raises(TypeError, match=r"overlap_comm: expected true or false \(or 0/1\), got int 2"):
        ZeroConfig.from_dict({"zero_optimization": {"overlap_comm": 2}})


# --------------------------------------------------------------------------- shipped configs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# file -> (stage, offload_optimizer.device, offload_param.device)
SHIPPED = {
    "zero1.yaml": (1, "none", "none"),
    "zero2.yaml": (2, "none", "none"),
    "zero2_offload.yaml": (2, "cpu", "none"),
    "zero3.yaml": (3, "none", "none"),
    "zero3_offload.yaml": (3, "cpu", "cpu"),
    "zero3_offload_nvme.yaml": (3, "cpu", "nvme"),
}
ACCELERATE_CONFIGS = ("accelerate_cpu.yaml", "accelerate_gpu.yaml")  # loaded in tests/accelerate/test_plugin_config.py


def test_the_configs_folder_holds_the_tested_files():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted([*SHIPPED, *ACCELERATE_CONFIGS])


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_load_cleanly_and_train(name):
    from zero_strategy import cli
    from zero_strategy.testing.compare import assert_state_close

    with _no_warnings():
        cfg = ZeroConfig.from_file(CONFIGS / name)
    assert (cfg.stage, cfg.offload_optimizer.device, cfg.offload_param.device) == SHIPPED[name]
    assert cfg.conflicts() == [] and cli.check(str(CONFIGS / name))
    # world size 1, a smoke test: one AdamW step equals plain PyTorch's
    import zero_strategy as zs

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    x = torch.randn(5, 6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref(x).square().mean().backward()
    ref_opt.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload_param.nvme_path is not set")  # the temp dir, as documented
        model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=0.1), config=str(CONFIGS / name))
    model(x).square().mean().backward()
    opt.step()
    assert_state_close(zs.destroy(model).state_dict(), ref.state_dict(), rtol=1e-6, atol=1e-7, what=name)


def test_shipped_configs_are_built_in_by_name_from_any_directory(tmp_path, monkeypatch):
    """``config="zero3"``, ``check zero3``: the presets ship in the package (``configs/`` links
    to them), so the names work outside the checkout; a missing file names cwd and the presets."""
    from zero_strategy import cli
    from zero_strategy.config import preset_names

    monkeypatch.chdir(tmp_path)
    assert preset_names() == tuple(sorted(Path(n).stem for n in SHIPPED))
    for name in SHIPPED:
        assert (CONFIGS / name).resolve().parent.parent.name == "config", "configs/ links to the package's presets"
        with _no_warnings():
            assert ZeroConfig.coerce(Path(name).stem) == ZeroConfig.from_file(CONFIGS / name)
    assert cli.check("zero3")
    with pytest.raises(FileNotFoundError, match=r"zero9 \(relative paths are read from .*\); .*: zero1, zero2, "):
        ZeroConfig.from_file("zero9")
    (tmp_path / "zero3").write_text("zero_optimization: {stage: 1}\n")  # a file wins over a name
    with pytest.raises(ValueError, match="unsupported config file type"):
        ZeroConfig.from_file("zero3")


def test_shipped_nvme_config_is_the_design_notes_template():
    with _no_warnings():
        assert ZeroConfig.from_file(CONFIGS / "zero3_offload_nvme.yaml") == ZeroConfig.from_dict(
            yaml.safe_load(SPEC_YAML)
        )


def test_config_warnings_are_said_once_per_job_and_the_16bit_save_key_says_what_happens(monkeypatch):
    """A launch reads its file several times per process (the plugin, the ``Trainer``) on every
    rank: each warning is said once, by rank 0. ``stage3_gather_16bit_weights_on_model_save``
    is not a setting that does nothing: every full-weight save gathers the full weights."""
    import zero_strategy as zs
    from zero_strategy.config import not_applied_settings

    data = {"zero_optimization": {"stage": 2, "sub_group_size": 4321}, "steps_per_print": 4321}
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 1 says nothing
        cfg = ZeroConfig.from_dict(data)
        zs.destroy(zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)[0])
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg = ZeroConfig.from_dict(data)
            zs.destroy(zs.initialize(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)[0])
    said = [str(w.message) for w in record]
    assert sum("steps_per_print" in m for m in said) == 1 and sum("sub_group_size=4321" in m for m in said) == 1, said
    (message,) = not_applied_settings(
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}})
    )
    assert "read but not applied" not in message, message
    for part in ("full weights", "save_model", "full_state_dict", "fp32"):
        assert part in message, message
