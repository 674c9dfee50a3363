"""``ZeroStrategy`` takes Lightning's ``DeepSpeedStrategy`` keyword arguments: the ones that mean
the same thing here go into the config (and meet a config file by the usual override rule), the
ones that mean nothing here are named in one warning, and ``zero_optimization=False`` (plain
data parallelism) is refused. One process, no Trainer run."""

from __future__ import annotations

import inspect
import logging
import warnings
from datetime import timedelta

import pytest


def _deepspeed_parameters() -> list[str]:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return [n for n in inspect.signature(DeepSpeedStrategy.__init__).parameters if n != "self"]


def test_every_deepspeed_strategy_argument_is_a_zero_strategy_argument() -> None:
    import lightning_zero

    ours = set(inspect.signature(lightning_zero.ZeroStrategy.__init__).parameters)
    theirs = _deepspeed_parameters()
    assert len(theirs) >= 46, theirs  # Lightning 2.6.6's list (the issue names all of them)
    assert [n for n in theirs if n not in ours] == []


def _every_argument(tmp_path, env, **precision) -> dict:
    """Every DeepSpeedStrategy argument, each with a value other than DeepSpeed's default;
    ``precision``: the Trainer's ``precision_plugin=None`` or Fabric's ``precision=None``."""
    import torch

    return dict(
        accelerator=None, zero_optimization=True, stage=3, remote_device="cpu",
        offload_optimizer=True, offload_parameters=True, offload_params_device="nvme", nvme_path=str(tmp_path),
        params_buffer_count=7, params_buffer_size=12_345, max_in_cpu=999, offload_optimizer_device="cpu",
        optimizer_buffer_count=6, block_size=4096, queue_depth=4, single_submit=True, overlap_events=False,
        thread_count=2, pin_memory=True, sub_group_size=1000, contiguous_gradients=False, overlap_comm=False,
        allgather_partitions=False, reduce_scatter=False, allgather_bucket_size=5e6, reduce_bucket_size=3_000_000,
        zero_allow_untested_optimizer=False, logging_batch_size_per_gpu=4, config=None, logging_level=logging.INFO,
        parallel_devices=[torch.device("cpu")], cluster_environment=env, loss_scale=128.0, initial_scale_power=8,
        loss_scale_window=50, hysteresis=3, min_loss_scale=2, partition_activations=True, cpu_checkpointing=True,
        contiguous_memory_optimization=True, synchronize_checkpoint_boundary=True, load_full_weights=True,
        process_group_backend="gloo", timeout=timedelta(minutes=5), exclude_frozen_parameters=True, **precision,
    )  # fmt: skip


def test_all_deepspeed_arguments_map_into_the_config(tmp_path) -> None:
    """Every argument at once, each with a value other than DeepSpeed's default."""
    import torch
    from lightning.pytorch.plugins.environments import LightningEnvironment

    import lightning_zero

    env = LightningEnvironment()
    given = _every_argument(tmp_path, env, precision_plugin=None)
    assert sorted(given) == sorted(_deepspeed_parameters())
    level = logging.getLogger("zero_strategy").level
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = lightning_zero.ZeroStrategy(**given)
        assert logging.getLogger("zero_strategy").level == logging.INFO
    finally:
        logging.getLogger("zero_strategy").setLevel(level)
    ours = [str(w.message) for w in caught if "ZeroStrategy" in str(w.message)]
    assert len(ours) == 1, ours  # one warning names every argument without a meaning here
    for name in ("remote_device", "block_size", "queue_depth", "single_submit", "overlap_events", "thread_count",
                 "zero_allow_untested_optimizer", "logging_batch_size_per_gpu", "partition_activations",
                 "cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                 "exclude_frozen_parameters"):  # fmt: skip
        assert f"{name}=" in ours[0], (name, ours[0])
    for mapped in ("overlap_comm", "offload_optimizer", "hysteresis", "load_full_weights", "stage="):
        assert f"{mapped}=" not in ours[0].split(":", 1)[1], (mapped, ours[0])
    cfg = s.zero_config
    assert cfg.stage == 3
    opt, par = cfg.offload_optimizer, cfg.offload_param
    # nvme_path goes into both blocks, as DeepSpeedStrategy writes it (unused while the device is "cpu")
    assert (opt.device, opt.buffer_count, opt.pin_memory, opt.nvme_path) == ("cpu", 6, True, str(tmp_path))
    assert (par.device, par.nvme_path, par.buffer_count, par.buffer_size, par.max_in_cpu, par.pin_memory) == (
        "nvme", str(tmp_path), 7, 12_345, 999, True,
    )  # fmt: skip
    assert (cfg.contiguous_gradients, cfg.overlap_comm, cfg.allgather_partitions, cfg.reduce_scatter) == (False,) * 4
    assert (cfg.allgather_bucket_size, cfg.reduce_bucket_size, cfg.sub_group_size) == (5_000_000, 3_000_000, 1000)
    ls = cfg.loss_scale
    assert (ls.loss_scale, ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis, ls.min_loss_scale) == (
        128.0, 8, 50, 3, 2.0,
    )  # fmt: skip
    assert s.cluster_environment is env and s.parallel_devices == [torch.device("cpu")]
    assert s.process_group_backend == "gloo" and s._timeout == timedelta(minutes=5)
    assert s.load_full_weights is True


def test_deepspeed_defaults_change_nothing_and_warn_nothing() -> None:
    """DeepSpeed's defaults for the arguments without a meaning here are silent; the others,
    left out, keep the config's (or zero_strategy's) values."""
    import lightning_zero
    import zero_strategy as zs

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = lightning_zero.ZeroStrategy(
            zero_optimization=True, partition_activations=False, cpu_checkpointing=False, single_submit=False,
            zero_allow_untested_optimizer=True, logging_batch_size_per_gpu="auto", exclude_frozen_parameters=False,
            load_full_weights=False,
        )  # fmt: skip
    assert s.zero_config == zs.ZeroConfig()


def test_deepspeed_arguments_meet_the_config_file(tmp_path) -> None:
    import lightning_zero
    from zero_strategy import ZeroConfig

    cfg = tmp_path / "z.yaml"
    cfg.write_text(
        "zero_optimization: {stage: 3, overlap_comm: true, offload_optimizer: {device: cpu}}\n"
        "fp16: {loss_scale_window: 500}\n"
    )
    with pytest.raises(ValueError, match="overlap_comm=True from the config conflicts with overlap_comm=False"):
        lightning_zero.ZeroStrategy(config=str(cfg), overlap_comm=False)
    with pytest.raises(ValueError, match="offload_optimizer=.*from the config conflicts.*offload_optimizer_device"):
        lightning_zero.ZeroStrategy(config=str(cfg), offload_optimizer=True, offload_optimizer_device="nvme")
    # a block the file sets is compared whole: a field it leaves at the default counts as set
    with pytest.raises(ValueError, match=r"loss_scale=.*from the config conflicts.*ZeroStrategy\(hysteresis=2\)"):
        lightning_zero.ZeroStrategy(config=str(cfg), hysteresis=2)
    # the same values, and blocks the file does not set, merge
    s = lightning_zero.ZeroStrategy(
        config=str(cfg), offload_optimizer=True, loss_scale_window=500, stage=3, offload_parameters=True,
        params_buffer_count=3, overlap_comm=True,
    )  # fmt: skip
    z = s.zero_config
    assert z.offload_optimizer == ZeroConfig.from_file(cfg).offload_optimizer
    assert (z.offload_param.device, z.offload_param.buffer_count) == ("cpu", 3)
    assert z.loss_scale == ZeroConfig.from_file(cfg).loss_scale
    assert z.overlap_comm is True and z.stage == 3


def test_deepspeed_arguments_that_would_change_the_run_are_refused() -> None:
    import lightning_zero

    with pytest.raises(ValueError, match=r"zero_optimization=False.*strategy=\"ddp\""):
        lightning_zero.ZeroStrategy(zero_optimization=False)
    with pytest.raises(ValueError, match="stage 0 is plain data parallelism"):
        lightning_zero.ZeroStrategy(stage=0)
    # a sub-argument without its switch: DeepSpeed drops it silently; here it is named
    with pytest.warns(UserWarning, match=r"offload_params_device='nvme'.*without offload_parameters=True"):
        lightning_zero.ZeroStrategy(offload_params_device="nvme")


def test_the_migration_line_from_the_issue() -> None:
    import lightning_zero

    s = lightning_zero.ZeroStrategy(stage=3, offload_optimizer=True, allgather_bucket_size=5e8)
    assert s.zero_config.stage == 3 and s.zero_config.offload_optimizer.device == "cpu"
    assert s.zero_config.allgather_bucket_size == 500_000_000


def _fabric_deepspeed_parameters() -> list[str]:
    from lightning.fabric.strategies import DeepSpeedStrategy

    return [n for n in inspect.signature(DeepSpeedStrategy.__init__).parameters if n != "self"]


def test_every_fabric_deepspeed_argument_builds_the_fabric_strategy(tmp_path) -> None:
    """Fabric's DeepSpeedStrategy arguments, every one with a value other than DeepSpeed's
    default, build ZeroFabricStrategy with the config the Trainer's ZeroStrategy gets from the
    same arguments, and the same one warning."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    import lightning_zero

    theirs = _fabric_deepspeed_parameters()
    ours = set(inspect.signature(lightning_zero.ZeroFabricStrategy.__init__).parameters)
    assert len(theirs) >= 46 and [n for n in theirs if n not in ours] == [], theirs
    given = _every_argument(tmp_path, LightningEnvironment(), precision=None)
    assert sorted(given) == sorted(theirs)
    level = logging.getLogger("zero_strategy").level
    built, messages = [], []
    try:
        for cls, precision_key in ((lightning_zero.ZeroFabricStrategy, "precision"),
                                   (lightning_zero.ZeroStrategy, "precision_plugin")):  # fmt: skip
            args = {k: v for k, v in given.items() if k != "precision"} | {precision_key: None}  # the Trainer's name
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                built.append(cls(**args))
            messages.append([str(w.message) for w in caught if cls.__name__ in str(w.message)])
        assert logging.getLogger("zero_strategy").level == logging.INFO
    finally:
        logging.getLogger("zero_strategy").setLevel(level)
    fabric, trainer = built
    assert fabric.zero_config == trainer.zero_config
    assert fabric.zero_config.stage == 3 and fabric.zero_config.offload_param.device == "nvme"
    assert fabric.zero_config.loss_scale.hysteresis == 3 and fabric.zero_config.reduce_bucket_size == 3_000_000
    assert len(messages[0]) == 1, messages[0]  # one warning naming every argument without a meaning here
    assert messages[0][0].split(":", 1)[1] == messages[1][0].split(":", 1)[1]
    assert "partition_activations=" in messages[0][0] and "overlap_comm=" not in messages[0][0].split(":", 1)[1]
    assert fabric.load_full_weights is True and fabric.process_group_backend == "gloo"
