"""Unit tests for zero_strategy.config: construction, readers, precedence."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings

import pytest
import torch
import yaml

from zero_strategy.config import (
    ConfigError,
    LossScaleConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
    resolve_overrides,
)

SPEC_YAML = """\
zero_optimization:
  stage: 3
  offload_optimizer: {device: cpu, pin_memory: true}
  offload_param: {device: nvme, buffer_size: 1e9}
  overlap_comm: true
  contiguous_gradients: true
"""

# A DeepSpeed config as Hugging Face Trainer/Accelerate examples write it.
HF_JSON = {
    "bf16": {"enabled": True},
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --------------------------------------------------------------------------- defaults and kwargs


def test_defaults():
    cfg = ZeroConfig()
    assert cfg.stage == 2
    assert cfg.reduce_bucket_size == cfg.allgather_bucket_size == 4_000_000
    assert cfg.overlap_comm and cfg.contiguous_gradients and cfg.reduce_scatter and cfg.allgather_partitions
    assert cfg.offload_optimizer == OffloadConfig() and not cfg.offload_optimizer.enabled
    assert cfg.offload_param.device == "none" and not cfg.offload_param.enabled
    assert cfg.precision.param_dtype is None and cfg.precision.reduce_dtype == torch.float32
    assert not cfg.precision.enabled and cfg.precision.autocast_dtype is None
    assert cfg.loss_scale.hysteresis == 1 and cfg.loss_scale.dynamic
    assert cfg.gradient_clipping is None and cfg.gradient_accumulation_steps is None
    assert (cfg.comm_timeout, cfg.prefetch, cfg.check_unit_order, cfg.collective_impl) == (
        None,
        1,
        True,
        "auto",
    )  # None: the group's timeout
    assert cfg.stage3_prefetch_bucket_size == 50_000_000 and cfg.sub_group_size == 1_000_000_000
    assert not any(cfg.explicitly_set(f.name) for f in dataclasses.fields(cfg) if f.name != "_explicit")


def test_frozen():
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 3  # type: ignore[misc]


def test_kwargs_coercion():
    cfg = ZeroConfig(
        stage=3.0,
        reduce_bucket_size=1e9,
        allgather_bucket_size="5e8",
        sub_group_size="1_000",
        offload_param={"device": "CPU", "buffer_count": 4.0},
        offload_optimizer="cpu",
        precision="bf16",
        loss_scale={"hysteresis": "2"},
        gradient_clipping=1,
        comm_timeout="60",
    )
    assert cfg.stage == 3 and type(cfg.stage) is int
    assert cfg.reduce_bucket_size == 1_000_000_000 and type(cfg.reduce_bucket_size) is int
    assert cfg.allgather_bucket_size == 500_000_000 and cfg.sub_group_size == 1000
    assert cfg.offload_param == OffloadConfig(device="cpu", buffer_count=4)
    assert cfg.offload_optimizer.device == "cpu"
    assert cfg.precision == PrecisionConfig(param_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    assert cfg.loss_scale == LossScaleConfig(hysteresis=2)
    assert cfg.gradient_clipping == 1.0 and type(cfg.gradient_clipping) is float
    assert cfg.comm_timeout == 60.0


BF, HF = torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("name", "param", "autocast"),
    [
        # 16-bit parameters with fp32 master shards (DeepSpeed's bf16/fp16.enabled, Lightning's -true)
        ("bf16", BF, BF), ("bfloat16", BF, BF), ("bf16-true", BF, BF), (torch.bfloat16, BF, BF),
        ("fp16", HF, HF), ("float16", HF, HF), ("half", HF, HF), ("16-true", HF, HF), (torch.float16, HF, HF),
        # mixed: fp32 parameters under autocast (DDP's meaning of Lightning's -mixed, Accelerate's names)
        ("bf16-mixed", None, BF), ("16-mixed", None, HF),
        ("fp32", None, None), ("float32", None, None), ("32-true", None, None), (torch.float32, None, None),
        (None, None, None), (32, None, None),
    ],
)  # fmt: skip
def test_precision_names(name, param, autocast):
    for precision in (PrecisionConfig.from_name(name), ZeroConfig(precision=name).precision):
        assert (precision.param_dtype, precision.autocast_dtype) == (param, autocast)
        assert precision.enabled is (autocast is not None)
        assert precision.reduce_dtype == torch.float32


def test_frontend_precision_table():
    from zero_strategy.config import PRECISION_NAMES, frontend_precision

    assert frontend_precision("lightning", "32-true") is None and frontend_precision("accelerate", "no") is None
    assert (
        frontend_precision("accelerate", "bf16") == "bf16-mixed"
        and frontend_precision("accelerate", "fp16") == "16-mixed"
    )
    assert frontend_precision("lightning", "bf16-true") == "bf16-true"
    for table in ("lightning", "accelerate"):
        for flag in ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "fp16"):
            try:
                name = frontend_precision(table, flag)
            except ValueError:
                continue
            assert name in PRECISION_NAMES
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported.*use one of"):
        frontend_precision("lightning", "64-true")


def test_precision_fields_and_errors():
    assert PrecisionConfig(reduce_dtype="bf16").reduce_dtype == torch.bfloat16
    assert PrecisionConfig(autocast_dtype="bf16").autocast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"PrecisionConfig.param_dtype: unknown dtype 'int8'; use 'bf16'"):
        PrecisionConfig(param_dtype="int8")
    with pytest.raises(ValueError, match=r"'bf16-mixed' is a precision mode, not a dtype; pass it as precision="):
        PrecisionConfig(param_dtype="bf16-mixed")
    with pytest.raises(ValueError, match=r"torch.float64 is not supported"):
        PrecisionConfig(param_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"param_dtype=bf16 with autocast_dtype=fp16"):
        PrecisionConfig(param_dtype="bf16", autocast_dtype="fp16")
    with pytest.raises(ValueError, match=r"PrecisionConfig.reduce_dtype: 'int8' is not a supported reduction dtype"):
        PrecisionConfig(reduce_dtype="int8")
    with pytest.raises(TypeError, match=r"PrecisionConfig.param_dtype: expected a dtype name"):
        PrecisionConfig(param_dtype=3.5)
    with pytest.raises(ValueError, match=r"ZeroConfig.precision: unknown precision 'int8'; use 'fp32', 'bf16-mixed'"):
        ZeroConfig(precision="int8")
    with pytest.raises(ValueError, match=r"unknown precision '16'"):  # Lightning's alias for 16-mixed: ambiguous here
        ZeroConfig(precision="16")


def test_loss_scale_config():
    assert LossScaleConfig().dynamic and LossScaleConfig().hysteresis == 1
    static = LossScaleConfig(loss_scale="128")
    assert not static.dynamic and static.loss_scale == 128.0
    with pytest.raises(ValueError, match=r"LossScaleConfig.hysteresis: must be > 0, got 0"):
        LossScaleConfig(hysteresis=0)
    with pytest.raises(ValueError, match=r"LossScaleConfig.min_loss_scale: must be > 0"):
        LossScaleConfig(min_loss_scale=0)


def test_offload_config():
    nvme = OffloadConfig(device="nvme")  # nvme_path is checked by the engine, not here
    assert nvme.enabled and nvme.nvme_path is None
    assert OffloadConfig(device=None).device == "none"
    with pytest.raises(ValueError, match=r"OffloadConfig.device: 'gpu' is not one of 'none', 'cpu', 'nvme'"):
        OffloadConfig(device="gpu")
    with pytest.raises(ValueError, match=r"OffloadConfig.ratio: must be <= 1.0, got 1.5; or 'auto' \(with zero_"):
        OffloadConfig(ratio=1.5)
    with pytest.raises(ValueError, match=r"OffloadConfig.ratio: .*'half'.*; or 'auto'"):
        OffloadConfig(ratio="half")
    with pytest.raises(TypeError, match=r"OffloadConfig.pin_memory: expected true or false"):
        OffloadConfig(pin_memory=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"stage": 0}, ValueError, r"ZeroConfig.stage: stage 0 is plain data parallelism; use torch DDP"),
        ({"stage": 4}, ValueError, r"ZeroConfig.stage: 4 is not a ZeRO stage; use 1, 2 or 3"),
        ({"reduce_bucket_size": -1}, ValueError, r"ZeroConfig.reduce_bucket_size: must be >= 0, got -1"),
        ({"allgather_bucket_size": -2}, ValueError, r"ZeroConfig.allgather_bucket_size: must be >= 0, got -2"),
        ({"reduce_bucket_size": "abc"}, ValueError,
         r"ZeroConfig.reduce_bucket_size: could not parse 'abc' as a number"),
        ({"reduce_bucket_size": 1.5}, ValueError, r"ZeroConfig.reduce_bucket_size: expected a whole number, got 1.5"),
        ({"reduce_bucket_size": True}, TypeError, r"ZeroConfig.reduce_bucket_size: expected a number, got the bool"),
        ({"reduce_bucket_size": [1]}, TypeError, r"ZeroConfig.reduce_bucket_size: expected a number, got list"),
        ({"stage3_max_live_parameters": -5}, ValueError, r"stage3_max_live_parameters: must be >= 0, got -5"),
        ({"overlap_comm": "true"}, TypeError,
         r"ZeroConfig.overlap_comm: expected true or false \(or 0/1\), got str 'true'; write"),
        ({"check_unit_order": 2}, TypeError, r"ZeroConfig.check_unit_order: expected true or false \(or 0/1\), got int 2"),
        ({"gradient_clipping": 0}, ValueError, r"ZeroConfig.gradient_clipping: must be > 0.0, got 0.0"),
        ({"gradient_accumulation_steps": 0}, ValueError, r"ZeroConfig.gradient_accumulation_steps: must be > 0"),
        ({"comm_timeout": float("inf")}, ValueError, r"ZeroConfig.comm_timeout: must be a finite number"),
        ({"prefetch": -1}, ValueError, r"ZeroConfig.prefetch: must be >= 0, got -1"),
        ({"collective_impl": "nccl"}, ValueError, r"ZeroConfig.collective_impl: 'nccl' is not one of 'auto'"),
        ({"offload_param": {"devcie": "cpu"}}, ValueError,
         r"unknown key 'ZeroConfig.offload_param.devcie'; did you mean 'device'\?"),
        ({"precision": {"param_dtype": "bf16", "reduce": "fp32"}}, ValueError,
         r"unknown key 'ZeroConfig.precision.reduce'; did you mean 'reduce_dtype'\?"),
        ({"_explicit": {"stag"}}, ValueError, r"ZeroConfig._explicit: unknown field names \['stag'\]"),
    ],
)  # fmt: skip
def test_kwargs_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ZeroConfig(**kwargs)


# --------------------------------------------------------------------------- DeepSpeed-style dicts


def test_from_dict_deepspeed_style():
    d = {
        "zero_optimization": {
            "stage": 3,
            "allgather_partitions": False,
            "allgather_bucket_size": 2e8,
            "reduce_scatter": False,
            "reduce_bucket_size": "5e7",
            "overlap_comm": False,
            "contiguous_gradients": False,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5, "fast_init": True},
            "stage3_max_live_parameters": 3e8,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 1e6,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_gather_fp16_weights_on_model_save": True,
            "sub_group_size": 1e8,
        },
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2,
                 "loss_scale_window": 500, "min_loss_scale": 0.5, "consecutive_hysteresis": True},
        "communication_data_type": "fp16",
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 4,
        "zero_strategy": {"comm_timeout": 120, "prefetch": 2, "check_unit_order": False, "collective_impl": "p2p"},
    }  # fmt: skip
    with _no_warnings():
        cfg = ZeroConfig.from_dict(d, source="ds.json")
    assert cfg.stage == 3 and not cfg.allgather_partitions and not cfg.reduce_scatter
    assert cfg.allgather_bucket_size == 200_000_000 and cfg.reduce_bucket_size == 50_000_000
    assert cfg.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True, ratio=0.5, fast_init=True)
    assert cfg.stage3_max_live_parameters == 300_000_000 and cfg.stage3_max_reuse_distance == 0
    assert cfg.stage3_prefetch_bucket_size == 1_000_000 and cfg.stage3_param_persistence_threshold == 10_000
    assert cfg.stage3_gather_16bit_weights_on_model_save is True and cfg.sub_group_size == 100_000_000
    assert cfg.precision == PrecisionConfig(
        param_dtype=torch.float16, reduce_dtype=torch.float16, autocast_dtype=torch.float16
    )
    assert cfg.loss_scale == LossScaleConfig(
        initial_scale_power=12, hysteresis=2, loss_scale_window=500, min_loss_scale=0.5, consecutive_hysteresis=True
    )
    assert cfg.gradient_clipping == 1.0 and cfg.gradient_accumulation_steps == 4
    assert (cfg.comm_timeout, cfg.prefetch, cfg.check_unit_order, cfg.collective_impl) == (120.0, 2, False, "p2p")
    assert cfg.explicitly_set("stage") and cfg.explicitly_set("precision") and cfg.explicitly_set("loss_scale")
    assert cfg.explicitly_set("stage3_gather_16bit_weights_on_model_save")
    assert cfg.explicitly_set("allgather_bucket_size") and not cfg.explicitly_set("offload_param")


def test_explicit_records_exactly_the_file_fields():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "reduce_bucket_size": 4_000_000}})
    assert cfg == ZeroConfig()  # same values as the defaults ...
    assert cfg.explicitly_set("stage") and cfg.explicitly_set("reduce_bucket_size")  # ... but set by the file
    assert not cfg.explicitly_set("overlap_comm") and not cfg.explicitly_set("precision")


def test_reduce_dtype_alone_does_not_set_precision():
    cfg = ZeroConfig.from_dict({"communication_data_type": "bf16", "zero_optimization": {"stage": 1}})
    assert cfg.precision == PrecisionConfig(reduce_dtype=torch.bfloat16)
    assert not cfg.explicitly_set("precision")
    cfg = ZeroConfig.from_dict({"zero_strategy": {"reduce_dtype": "fp32"}, "bf16": {"enabled": True}})
    assert cfg.precision == PrecisionConfig(param_dtype="bf16", reduce_dtype="fp32", autocast_dtype="bf16")


def test_gradient_clipping_zero_means_off():
    cfg = ZeroConfig.from_dict({"gradient_clipping": 0.0})
    assert cfg.gradient_clipping is None and not cfg.explicitly_set("gradient_clipping")
    with pytest.raises(ValueError, match=r"gradient_clipping: must be >= 0.0, got -1.0 \(in <dict>\)"):
        ZeroConfig.from_dict({"gradient_clipping": -1})


def test_disabled_precision_blocks_leave_fp32():
    cfg = ZeroConfig.from_dict({"bf16": {"enabled": False}, "fp16": {"enabled": False}})
    assert cfg.precision == PrecisionConfig() and not cfg.explicitly_set("precision")


def test_bf16_and_fp16_both_enabled():
    with pytest.raises(ValueError, match=r"bf16.enabled and fp16.enabled are both true in ds.json"):
        ZeroConfig.from_dict({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, source="ds.json")


def test_conflicting_aliases_and_reduce_dtypes():
    with pytest.raises(ValueError, match=r"stage3_gather_fp16_weights_on_model_save=False conflicts with"):
        ZeroConfig.from_dict(
            {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True,
                                   "stage3_gather_fp16_weights_on_model_save": False}}
        )  # fmt: skip
    message = "communication_data_type=bf16 conflicts with zero_strategy.reduce_dtype=fp32"
    with pytest.raises(ValueError, match=re.escape(message)):
        ZeroConfig.from_dict({"communication_data_type": "bf16", "zero_strategy": {"reduce_dtype": "fp32"}})


def test_auto_means_not_set():
    d = {
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "offload_param": "auto",
                              "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}},
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": "auto"},
        "gradient_clipping": "auto", "gradient_accumulation_steps": "AUTO", "communication_data_type": "auto",
    }  # fmt: skip
    cfg = ZeroConfig.from_dict(d)
    assert cfg.stage == 2 and cfg.reduce_bucket_size == 4_000_000
    assert cfg.offload_param == OffloadConfig()
    assert cfg.offload_optimizer == OffloadConfig(device="cpu")
    assert cfg.precision == PrecisionConfig() and cfg.gradient_clipping is None
    assert cfg.gradient_accumulation_steps is None and cfg.loss_scale == LossScaleConfig()
    assert not cfg.explicitly_set("stage") and not cfg.explicitly_set("gradient_clipping")
    assert cfg.explicitly_set("offload_optimizer")


@pytest.mark.parametrize(
    ("d", "pattern"),
    [
        ({"zero_optimisation": {}},
         r"unknown key 'zero_optimisation' in zero3.yaml; did you mean 'zero_optimization'\?"),
        ({"stage": 3, "zero_optimization": {}},
         r"unknown key 'stage' in zero3.yaml; did you mean 'zero_optimization.stage'\?"),
        ({"zero_optimization": {"reduce_bucket_sise": 5}},
         r"unknown key 'zero_optimization.reduce_bucket_sise' in zero3.yaml; did you mean 'reduce_bucket_size'\?"),
        ({"zero_optimization": {"offload_param": {"devcie": "cpu"}}},
         r"unknown key 'zero_optimization.offload_param.devcie' in zero3.yaml; did you mean 'device'\?"),
        ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
         r"unknown key 'zero_optimization.offload_optimizer.pin_memroy' in zero3.yaml; did you mean 'pin_memory'\?"),
        ({"bf16": {"enable": True}}, r"unknown key 'bf16.enable' in zero3.yaml; did you mean 'enabled'\?"),
        ({"fp16": {"initial_scale_pow": 8}},
         r"unknown key 'fp16.initial_scale_pow' in zero3.yaml; did you mean 'initial_scale_power'\?"),
        ({"zero_strategy": {"comm_timout": 5}},
         r"unknown key 'zero_strategy.comm_timout' in zero3.yaml; did you mean 'comm_timeout'\?"),
        ({"zero_strategy": {"zzz": 5}},
         r"unknown key 'zero_strategy.zzz' in zero3.yaml; valid keys under 'zero_strategy' are: check_unit_order, "
         r"collective_impl, comm_timeout, compression, gather_checks, gather_dtype, load_balance, memory, moe_compact_gather, "
         r"moe_expert_cache, moe_expert_layout, "
         r"moe_full_gather_share, "
         r"prefetch, reduce_dtype"),
        ({"qqqq": 1}, r"unknown key 'qqqq' in zero3.yaml; valid keys at the top level are: .*zero_optimization"),
    ],
)  # fmt: skip
def test_unknown_keys(d, pattern):
    with pytest.raises(ValueError, match=pattern):
        ZeroConfig.from_dict(d, source="zero3.yaml")


@pytest.mark.parametrize(
    ("d", "error", "message"),
    [
        ({"zero_optimization": {"stage": 5}}, ValueError,
         "zero_optimization.stage: 5 is not a ZeRO stage; use 1, 2 or 3"),
        ({"zero_optimization": {"stage": 0}}, ValueError, "zero_optimization.stage: stage 0 is plain data parallelism"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, ValueError,
         "zero_optimization.reduce_bucket_size: must be >= 0, got -1"),
        ({"zero_optimization": {"reduce_bucket_size": "abc"}}, ValueError,
         "zero_optimization.reduce_bucket_size: could not parse 'abc' as a number"),
        ({"zero_optimization": {"overlap_comm": "yes"}}, TypeError,
         "zero_optimization.overlap_comm: expected true or false"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, ValueError,
         "zero_optimization.offload_param.device: 'gpu' is not one of"),
        ({"zero_optimization": {"offload_param": {"buffer_count": 0}}}, ValueError,
         "zero_optimization.offload_param.buffer_count: must be > 0, got 0"),
        ({"zero_optimization": {"offload_param": True}}, TypeError,
         "zero_optimization.offload_param: expected a mapping"),
        ({"zero_optimization": []}, TypeError, "zero_optimization: expected a mapping, got list"),
        ({"bf16": {"enabled": "true"}}, TypeError, "bf16.enabled: expected true or false (or 0/1), got str 'true'"),
        ({"fp16": {"hysteresis": 0}}, ValueError, "fp16.hysteresis: must be > 0, got 0"),
        ({"communication_data_type": "int8"}, ValueError, "communication_data_type: 'int8' is not a supported"),
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps: must be > 0, got 0"),
        ({"zero_strategy": {"collective_impl": "mpi"}}, ValueError,
         "zero_strategy.collective_impl: 'mpi' is not one of"),
        ({"zero_strategy": {"comm_timeout": -1}}, ValueError, "zero_strategy.comm_timeout: must be > 0.0, got -1.0"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key_path_and_source(d, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        ZeroConfig.from_dict(d, source="zero3.yaml")
    assert "zero3.yaml" in str(info.value)


def test_spec_yaml_loads_unchanged(tmp_path):
    assert yaml.safe_load(SPEC_YAML)["zero_optimization"]["offload_param"]["buffer_size"] == "1e9"  # YAML 1.1
    path = tmp_path / "zero3.yaml"
    path.write_text(SPEC_YAML)
    with _no_warnings():
        cfg = ZeroConfig.from_file(path)
    assert cfg.stage == 3 and cfg.overlap_comm and cfg.contiguous_gradients
    assert cfg.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert cfg.offload_param == OffloadConfig(device="nvme", buffer_size=1_000_000_000)
    assert type(cfg.offload_param.buffer_size) is int
    assert cfg.explicitly_set("offload_param") and not cfg.explicitly_set("reduce_bucket_size")


def test_hf_json_file_loads_with_warning(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_JSON, indent=2))
    with pytest.warns(UserWarning, match="front-end owns them") as record:
        cfg = ZeroConfig.from_file(str(path))
    text = str(record[0].message)
    for key in ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print"):
        assert key in text
    assert str(path) in text
    assert cfg.stage == 3 and cfg.precision.param_dtype == torch.bfloat16
    assert cfg.reduce_bucket_size == 4_000_000 and cfg.stage3_prefetch_bucket_size == 50_000_000  # "auto"
    assert cfg.sub_group_size == 1_000_000_000 and cfg.stage3_gather_16bit_weights_on_model_save
    assert cfg.loss_scale.hysteresis == 2  # an explicit DeepSpeed value is honoured
    assert cfg.gradient_clipping is None and cfg.gradient_accumulation_steps is None


def test_yml_extension_and_flat_file(tmp_path):
    path = tmp_path / "cfg.yml"
    path.write_text("stage: 1\nprefetch: 3\n")
    cfg = ZeroConfig.from_file(path)
    assert (cfg.stage, cfg.prefetch) == (1, 3)


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        ZeroConfig.from_file(missing)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list.yaml: the top level must be a mapping.*got a list"):
        ZeroConfig.from_file(listed)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"top level must be a mapping.*got an empty file"):
        ZeroConfig.from_file(empty)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"could not parse .*broken.json"):
        ZeroConfig.from_file(broken)
    toml = tmp_path / "cfg.toml"
    toml.write_text("stage = 3")
    with pytest.raises(ValueError, match=r"unsupported config file type '.toml'; use .yaml, .yml or .json"):
        ZeroConfig.from_file(toml)
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_optimization:\n  stag: 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'zero_optimization.stag' in .*bad.yaml; did you mean 'stage'\?"):
        ZeroConfig.from_file(bad)


# --------------------------------------------------------------------------- coerce, to_dict, replace


def test_coerce(tmp_path):
    cfg = ZeroConfig(stage=3)
    assert ZeroConfig.coerce(cfg) is cfg
    assert ZeroConfig.coerce(None) == ZeroConfig()
    assert ZeroConfig.coerce({"zero_optimization": {"stage": 1}}).stage == 1
    path = tmp_path / "c.yaml"
    path.write_text(SPEC_YAML)
    assert ZeroConfig.coerce(path).stage == 3
    assert ZeroConfig.coerce(str(path)).offload_param.device == "nvme"
    with pytest.raises(TypeError, match=r"cannot build a ZeroConfig from int 3; pass a ZeroConfig, a mapping"):
        ZeroConfig.coerce(3)
    with pytest.raises(TypeError, match=r"expected a mapping, got list"):
        ZeroConfig.from_dict([1])  # type: ignore[arg-type]


def test_to_dict_round_trip():
    cfg = ZeroConfig(
        stage=3, offload_param={"device": "nvme", "nvme_path": "/tmp/x"}, precision="fp16",
        loss_scale={"loss_scale": 64.0}, gradient_clipping=0.5, gradient_accumulation_steps=2, collective_impl="p2p",
    )  # fmt: skip
    d = cfg.to_dict()
    assert "_explicit" not in d
    assert d["precision"] == {"param_dtype": "fp16", "reduce_dtype": "fp32", "autocast_dtype": "fp16"}
    assert d["offload_param"]["nvme_path"] == "/tmp/x"
    back = ZeroConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert ZeroConfig.from_dict(ZeroConfig().to_dict()) == ZeroConfig()


def test_flat_native_dict():
    cfg = ZeroConfig.from_dict({"stage": 1, "precision": "bf16", "gradient_clipping": 2})
    assert cfg.stage == 1 and cfg.precision.param_dtype == torch.bfloat16 and cfg.gradient_clipping == 2.0
    assert cfg.explicitly_set("stage") and not cfg.explicitly_set("prefetch")
    with pytest.raises(ValueError, match=r"^stage: 7 is not a ZeRO stage; use 1, 2 or 3 \(in flat\)$"):
        ZeroConfig.from_dict({"stage": 7}, source="flat")


def test_replace_and_explicitly_set():
    cfg = ZeroConfig(stage=3)  # kwargs: explicitness inferred from "differs from the default"
    assert cfg.explicitly_set("stage") and not cfg.explicitly_set("prefetch")
    new = cfg.replace(prefetch=2, precision="bf16")
    assert new.prefetch == 2 and new.precision.param_dtype == torch.bfloat16 and cfg.prefetch == 1
    assert new.explicitly_set("prefetch") and new.explicitly_set("stage") and new.explicitly_set("precision")
    assert not new.explicitly_set("reduce_bucket_size")
    # setting a value equal to the default through replace() still counts as explicit
    assert ZeroConfig().replace(stage=2).explicitly_set("stage")
    with pytest.raises(TypeError, match=r"unknown setting 'stag'; did you mean 'stage'\?"):
        cfg.replace(stag=3)
    with pytest.raises(ValueError, match=r"unknown setting 'bogus'"):
        cfg.explicitly_set("bogus")
    with pytest.raises(ValueError, match=r"ZeroConfig.stage: 9 is not a ZeRO stage"):
        cfg.replace(stage=9)


# --------------------------------------------------------------------------- precedence


def test_resolve_overrides_applies_unset_values():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3}})
    out = resolve_overrides(
        cfg, source="Lightning Trainer", gradient_clipping=0.5, precision="bf16-mixed", prefetch=None
    )
    assert out.gradient_clipping == 0.5 and out.precision == PrecisionConfig(autocast_dtype=torch.bfloat16)
    assert out.prefetch == 1 and out.stage == 3  # None means "not given"
    assert out.explicitly_set("gradient_clipping") and out.explicitly_set("stage")
    assert cfg.gradient_clipping is None  # the input is untouched
    assert resolve_overrides(cfg, source="x") is cfg


def test_resolve_overrides_same_value_is_fine():
    cfg = ZeroConfig.from_dict({"gradient_clipping": 1.0, "bf16": {"enabled": True}, "communication_data_type": "bf16"})
    out = resolve_overrides(cfg, source="Lightning", gradient_clipping=1, precision="bf16-mixed")
    assert out == cfg
    # the file's DeepSpeed bf16 (16-bit parameters) stays under a "bf16-mixed" flag: same dtype, no conflict
    assert out.precision.param_dtype == torch.bfloat16
    assert out.precision.reduce_dtype == torch.bfloat16  # precision override keeps the config's reduce dtype
    red = ZeroConfig.from_dict({"communication_data_type": "bf16"})
    assert resolve_overrides(red, source="x", precision="16-mixed").precision == PrecisionConfig(
        reduce_dtype=torch.bfloat16, autocast_dtype=torch.float16
    )


def test_resolve_overrides_conflict_names_both():
    cfg = ZeroConfig.from_dict({"gradient_clipping": 1.0})
    message = (
        "gradient_clipping=1.0 from the config conflicts with gradient_clipping=0.5 from "
        "Lightning Trainer(gradient_clip_val=...); set it in one place only"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_overrides(cfg, source="Lightning Trainer(gradient_clip_val=...)", gradient_clipping=0.5)
    fp16 = ZeroConfig.from_dict({"fp16": {"enabled": True}})
    message = "precision=fp16 from the config conflicts with precision=bf16-mixed from Trainer(precision=...)"
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_overrides(fp16, source="Trainer(precision=...)", precision="bf16-mixed")
    kwargs_cfg = ZeroConfig(stage=3)  # inferred explicitness also protects against silent overrides
    with pytest.raises(ValueError, match=r"stage=3 from the config conflicts with stage=2 from acc"):
        resolve_overrides(kwargs_cfg, source="acc", stage=2)


def test_resolve_overrides_errors():
    cfg = ZeroConfig()
    pattern = r"resolve_overrides\(\): unknown setting 'grad_clip'; did you mean 'gradient_clipping'\?"
    with pytest.raises(TypeError, match=pattern):
        resolve_overrides(cfg, source="x", grad_clip=1.0)
    with pytest.raises(ValueError, match=r"ZeroConfig.stage: 7 is not a ZeRO stage; use 1, 2 or 3 \(from cli\)"):
        resolve_overrides(cfg, source="cli", stage=7)
    with pytest.raises(ValueError, match=r"precision: unknown precision 'int4'.* \(from cli\)"):
        resolve_overrides(cfg, source="cli", precision="int4")
    pattern = r"precision: pass a name such as 'bf16-mixed' or a torch.dtype, not a config \(from cli\)"
    with pytest.raises(TypeError, match=pattern):
        resolve_overrides(cfg, source="cli", precision=PrecisionConfig())
    with pytest.raises(TypeError, match=r"expected a ZeroConfig, got dict"):
        resolve_overrides({}, source="cli", stage=2)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- every problem in one read

THREE_MISTAKES = """\
zero_optimization:
  stage: 2
  reduce_bucket_sise: 5e5
  overlap_comm: maybe
  offload_param: {device: cpu}
"""


def test_every_problem_of_a_file_in_one_error(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text(THREE_MISTAKES)
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_file(path)
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert "unknown key 'zero_optimization.reduce_bucket_sise'" in problems[0] and "reduce_bucket_size" in problems[0]
    assert "zero_optimization.overlap_comm: expected true or false" in problems[1]
    assert "zero_optimization.offload_param needs stage 3 (got stage 2)" in problems[2]
    text = str(info.value)
    assert f"3 problems in {path}" in text and all(p in text for p in problems)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_every_problem_in_nested_blocks_and_kwargs():
    d = {"zero_optimization": {"offload_optimizer": {"devcie": "cpu", "buffer_count": 0}, "stage": 9},
         "bf16": {"enabled": "yes"}, "qqqq": 1}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_dict(d, source="ds.json")
    joined = "\n".join(info.value.problems)
    for part in ("offload_optimizer.devcie", "offload_optimizer.buffer_count: must be > 0", "stage: 9 is not a ZeRO",
                 "bf16.enabled: expected true or false", "unknown key 'qqqq'"):  # fmt: skip
        assert part in joined, joined
    assert len(info.value.problems) == 5
    with pytest.raises(ConfigError) as info:
        ZeroConfig(stage=7, prefetch=-1)
    assert [p.split(":")[0] for p in info.value.problems] == ["ZeroConfig.stage", "ZeroConfig.prefetch"]


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         "zero_optimization.offload_param needs stage 3 (got stage 2)"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}},
         "zero_optimization.offload_param.ratio takes only 'auto' (with zero_strategy.memory)"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}},
         "zero_optimization.offload_optimizer.ratio='auto' picks the smallest fraction whose device bytes fit"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "ratio": "auto"}},
          "zero_strategy": {"memory": {"budget": "8GB"}}},
         "offload_param.ratio='auto' picks the smallest fraction whose device bytes fit the persistent tier of "
         "zero_strategy.memory, with device 'cpu' (got device 'nvme'"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                                "offload_optimizer": {"device": "nvme", "ratio": 0.5}}},
         "zero_optimization.offload_optimizer.ratio=0.5 with offload_param on nvme"),
        ({"zero_optimization": {"stage": 3}, "zero_strategy": {"compression": {"type": "topk"}}},
         "compression.type='topk' works at ZeRO stages 1 and 2"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
          "zero_strategy": {"load_balance": {"preset": "compute"}}},
         "load_balance at stage 3 with offload_param: {device: nvme} is not supported"),
    ],
)  # fmt: skip
def test_conflicting_settings_fail_at_construction(d, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        ZeroConfig.from_dict(d, source="zero3.yaml")
    assert "zero3.yaml" in str(info.value)


def test_a_conflict_with_an_unset_stage_waits_for_the_resolved_config():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"offload_param": {"device": "cpu"}}}, source="off.yaml")
    assert cfg.stage == 2 and not cfg.explicitly_set("stage")  # a front-end's stage=3 may still come
    assert [p.split(" (")[0] for p in cfg.conflicts()] == ["zero_optimization.offload_param needs stage 3"]
    assert resolve_overrides(cfg, source="ZeroStrategy(stage=3)", stage=3).conflicts() == []
    with pytest.raises(ValueError, match=r"offload_param needs stage 3 \(got stage 1\)"):
        resolve_overrides(cfg, source="ZeroStrategy(stage=1)", stage=1)
    with pytest.raises(ValueError, match=r"^initialize\(\): zero_optimization.offload_param needs stage 3"):
        cfg.check(caller="initialize()")
    scores = ZeroConfig(load_balance={"scores": [3, 1]})
    assert scores.conflicts() == [] and scores.conflicts(world_size=2) == []
    assert "load_balance.scores has 2 entries for 4 ranks" in scores.conflicts(world_size=4)[0]
