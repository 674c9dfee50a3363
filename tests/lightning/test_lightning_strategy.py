"""The Lightning front-end against Lightning's own DDP: same logged losses, validation metrics
and predictions; checkpoints resumed on another number of devices; LightningCLI; errors.

Every multi-rank case runs inside one launch per world size (ranks start once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_strategy.testing import assert_close, assert_state_close, rel_error

VOCAB, SEQ = 64, 8


def _gpt():
    import torch

    from zero_strategy.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=2, n_head=2, qkv_bias=False))


def _lit_class():
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class LitGPT(pl.LightningModule):
        """Built in configure_model when ``sharded`` (stage 3 shards it as it is built)."""

        def __init__(self, sharded: bool = False, lr: float = 1e-2) -> None:
            super().__init__()
            self.sharded, self.lr = sharded, lr
            self.gpt = None if sharded else _gpt()

        def configure_model(self) -> None:
            if self.gpt is None:
                self.gpt = _gpt()
                self.built_bytes = sum(p.untyped_storage().nbytes() for p in self.gpt.parameters())

        def forward(self, x):
            return self.gpt(x)

        def _loss(self, batch):
            x, y = batch
            return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("loss", loss, sync_dist=True, on_step=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0]).float()

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
            rest = [p for n, p in self.named_parameters() if p.ndim < 2]
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": self.lr / 2}],
                lr=self.lr,
            )
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    class ManualGPT(LitGPT):
        """Manual optimization as Lightning documents it (zero_grad first, inside the redirected
        forward): manual_backward, clip_gradients, step every 2 batches."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            if batch_idx % 2 == 0:
                opt.zero_grad()
            loss = self._loss(batch)
            self.log("loss", loss, sync_dist=True, on_step=True)
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
                opt.step()
                self.lr_schedulers().step()

    class SavedGPT(LitGPT):
        """Saves its hyperparameters (a converted checkpoint carries them to load_from_checkpoint).
        Only where needed: save_hyperparameters reads the calling frames' locals, and Python 3.11
        keeps that snapshot on a running frame, so a worker's deleted locals would stay alive."""

        def __init__(self, sharded: bool = False, lr: float = 1e-2) -> None:
            super().__init__(sharded, lr)
            self.save_hyperparameters()

    LitGPT.Manual, LitGPT.Saved = ManualGPT, SavedGPT
    return LitGPT


def _data(n: int, per_rank: int, seed: int = 0):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=per_rank, shuffle=False)


class _Losses:
    """A callback recording the logged (rank-averaged) loss of every training batch."""

    def __new__(cls):
        import lightning.pytorch as pl

        class Rec(pl.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

                self.norms: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.losses.append(float(trainer.callback_metrics["loss"]))

            def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
                import torch

                if not hasattr(pl_module, "zero_engine"):  # DDP: full gradients, before clipping
                    self.norms.append(
                        float(
                            torch.nn.utils.get_total_norm(
                                [p.grad for p in pl_module.parameters() if p.grad is not None]
                            )
                        )
                    )

        return Rec()


def _trainer(strategy, devices: int, **kw):
    import lightning.pytorch as pl

    base = dict(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    return pl.Trainer(strategy=strategy, **base)


def _parity_worker(rank: int, world: int) -> dict:
    import gc
    import threading
    import weakref

    import torch

    import lightning_zero
    import zero_strategy as zs

    LitGPT = _lit_class()
    out: dict = {}
    names = (
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "zero3_sharded_init",
        "ddp_bf16",
        "zero2_bf16",
        "zero2_offload",
        "zero3_offload",
        "zero3_offload_nvme",
    )
    for name in names:
        sharded = name.endswith("sharded_init")
        stage_name = name if "offload" in name else name.split("_")[0]  # the registered offload names
        strategy = (
            lightning_zero.ZeroStrategy(stage=3)
            if sharded
            else (stage_name if stage_name != "zero1" else lightning_zero.ZeroStrategy(stage=1))
        )
        rec = _Losses()
        # bf16 runs do not clip: the global norm is summed over shards in another order than
        # torch's, a last-bit difference that bf16 rounding of activations amplifies over steps
        clip = None if name.endswith("bf16") else 0.3
        trainer = _trainer(strategy, world, max_steps=10, accumulate_grad_batches=2, gradient_clip_val=clip, callbacks=[rec],
                           enable_checkpointing=False, num_sanity_val_steps=1, limit_val_batches=2,
                           precision="bf16-mixed" if name.endswith("bf16") else "32-true")  # fmt: skip
        model = LitGPT(sharded=sharded)
        if name == "zero2":  # set up for evaluation first, then fit: a fresh optimizer, as under DDP
            trainer.validate(model, _data(8, 2, seed=1), verbose=False)
        trainer.fit(model, _data(80, 2), _data(8, 2, seed=1))
        if name.endswith("bf16"):
            dtype = next(model.parameters()).dtype
            with zs.gathered_parameters(model) if name != "ddp_bf16" else torch.no_grad():
                params = {k: v.detach().clone() for k, v in model.gpt.state_dict().items()}
            out[name] = {"losses": rec.losses, "dtype": str(dtype), "params": params}
            continue
        sampler = type(trainer.train_dataloader.sampler).__name__
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if name.startswith("zero"):
            assert isinstance(trainer.strategy, lightning_zero.ZeroStrategy)
            engine = model.zero_engine
            assert engine.config.stage == int(name[4]) and trainer.strategy.zero_config.gradient_clipping == 0.3
            assert engine.config.gradient_clipping is None  # Lightning clips (global norm); the engine does not again
            stats = engine.memory_stats()
            host = stats["tier_host_pinned"] + stats["tier_host_pageable"]
            on_host = stats["masters"] + stats["grad_shards"] + stats["optimizer_state"]
            if name == "zero3_offload_nvme":  # rows and optimizer state in swap files, gradient shards in memory
                nvme_engine, swap_dirs = weakref.ref(engine), [d.path for d in engine.disk.dirs]
                assert stats["param_shards"] > 0 and stats["tier_disk"] > stats["param_shards"], stats
                assert stats["masters"] == 0 and host == on_host - (stats["tier_disk"] - stats["param_shards"]), stats
            elif name.endswith("offload"):  # the optimizer side (and at zero3 the rows) in host memory
                assert stats["optimizer_state"] > 0 and host == on_host + stats["param_shards"] * (
                    name == "zero3_offload"
                )
            else:
                assert host == 0, stats
            if sharded:  # configure_model under sharded_init: no rank held the full parameters
                assert model.built_bytes < sum(p.numel() * 4 for p in _gpt().parameters()) / 10, model.built_bytes
        val = trainer.validate(model, _data(8, 2, seed=2), verbose=False)[0]["val_loss"]
        test = trainer.test(model, _data(8, 2, seed=4), verbose=False)[0]["test_loss"]
        preds = torch.cat(trainer.predict(model, _data(8, 2, seed=3)))
        with zs.gathered_parameters(model) if name != "ddp" else torch.no_grad():
            params = {k: v.detach().clone() for k, v in model.gpt.state_dict().items()}
        out[name] = {"losses": rec.losses, "val": val, "test": test, "preds": preds, "params": params, "sampler": sampler,
                     "lr": lr, "norms": rec.norms}  # fmt: skip
    for name in ("ddp", "zero3"):  # manual optimization
        rec = _Losses()
        trainer = _trainer(
            name, world, max_steps=10, callbacks=[rec], enable_checkpointing=False, num_sanity_val_steps=0
        )
        model = LitGPT.Manual()
        trainer.fit(model, _data(80, 2))
        out[f"manual_{name}"] = rec.losses
    # the NVMe model was dropped (Lightning's teardown does not destroy an engine: test() may follow
    # fit()) and two more were fit: its engine, I/O threads and swap files went with it
    del engine, model, trainer
    gc.collect()
    out["nvme_left"] = {"engine": nvme_engine() is not None, "dirs": [d for d in swap_dirs if os.path.exists(d)],
                        "io_threads": [t.name for t in threading.enumerate() if t.name.startswith("zero-swap")]}  # fmt: skip
    return out


def test_ddp_parity_with_accumulation_clipping_and_scheduler(launch) -> None:

    results = launch(_parity_worker, 2, timeout=600)
    for rank, res in enumerate(results):
        ref = res["ddp"]
        assert len(ref["losses"]) == 20  # 10 optimizer steps x 2 accumulated batches
        for name in (
            "zero1", "zero2", "zero3", "zero3_sharded_init", "zero2_offload", "zero3_offload", "zero3_offload_nvme"
        ):  # fmt: skip
            got = res[name]
            assert got["sampler"] == "DistributedSampler", got["sampler"]
            assert_close(got["losses"], ref["losses"], rtol=1e-6, what=f"rank {rank} {name} losses")
            for key in ("val", "test"):
                assert_close([got[key]], [ref[key]], rtol=1e-6, what=f"rank {rank} {name} {key}")
            assert_close(got["preds"], ref["preds"], rtol=1e-5, atol=1e-6, what=f"rank {rank} {name} predictions")
            assert got["lr"] == ref["lr"] == pytest.approx(1e-2 * 0.5**3)
            assert_state_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6, what=f"rank {rank} {name} weights")
    assert all(res["nvme_left"] == {"engine": False, "dirs": [], "io_threads": []} for res in results), [
        res["nvme_left"] for res in results
    ]
    manual, manual_ddp = results[0]["manual_zero3"], results[0]["manual_ddp"]
    assert len(manual_ddp) == 20  # 10 optimizer steps, 2 batches each
    assert_close(manual, manual_ddp, rtol=1e-6, what="manual optimization losses")
    # clipping was active on every step (DDP's full-gradient norms before clipping)
    assert len(results[0]["ddp"]["norms"]) == 10 and min(results[0]["ddp"]["norms"]) > 0.3
    # bf16-mixed keeps DDP's meaning: fp32 parameters under autocast, the same numbers and weights
    for rank, res in enumerate(results):
        bf16, ddp_bf16 = res["zero2_bf16"], res["ddp_bf16"]
        assert bf16["dtype"] == ddp_bf16["dtype"] == "torch.float32"
        assert_close(bf16["losses"], ddp_bf16["losses"], rtol=1e-6, what=f"rank {rank} bf16-mixed losses")
        assert_state_close(
            bf16["params"], ddp_bf16["params"], rtol=1e-5, atol=1e-6, what=f"rank {rank} bf16-mixed weights"
        )
        assert rel_error(bf16["losses"], res["zero2"]["losses"]) > 1e-4  # autocast did change the numbers


GLOBAL_BATCH, EPOCH_STEPS = 12, 4


def _resume_worker(rank: int, world: int, root: str, phase: str) -> dict:

    import lightning.pytorch as pl

    import lightning_zero
    import zero_strategy as zs

    if phase == "slurm":  # Lightning's SLURM environment, ranks from SLURM_* variables
        os.environ.update(SLURM_NTASKS=str(world), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                          SLURM_JOB_NAME="zero-test", SLURM_NODELIST="127.0.0.1", SLURM_JOB_ID="1", SLURM_NTASKS_PER_NODE=str(world))  # fmt: skip
    LitGPT = _lit_class().Saved
    data = _data(GLOBAL_BATCH * EPOCH_STEPS, GLOBAL_BATCH // world)
    out: dict = {}
    stage = {"save": 3, "slurm": 3, "one": 1}[phase]
    rec = _Losses()
    if phase == "save":  # the uninterrupted run; checkpoints every epoch
        ckpt = pl.callbacks.ModelCheckpoint(
            dirpath=root, filename="ep{epoch}", save_top_k=-1, every_n_epochs=1, auto_insert_metric_name=False
        )
        best = pl.callbacks.ModelCheckpoint(
            dirpath=f"{root}/best", monitor="loss", save_top_k=1, every_n_train_steps=1, save_last=True
        )
        logger = pl.loggers.CSVLogger(f"{root}/logs", name="", version=0)
        trainer = _trainer(
            lightning_zero.ZeroStrategy(stage=stage),
            world,
            max_epochs=2,
            callbacks=[rec, ckpt, best, lightning_zero.ZeroMemoryMonitor()],
            gradient_clip_val=0.3,
            logger=logger,
            log_every_n_steps=1,
        )
        model = LitGPT()
        trainer.fit(model, data)
        out["losses"] = rec.losses
        out["memory"] = zs.memory_stats(model)
        trainer.strategy.state_dict_type = "full"  # one consolidated file, for the plain model
        trainer.save_checkpoint(f"{root}/full.ckpt")
        with zs.gathered_parameters(model):
            out["params"] = {k: v.detach().clone() for k, v in model.gpt.state_dict().items()}
    else:
        if phase == "slurm":
            assert (
                type(_trainer("zero3", world)._accelerator_connector.cluster_environment).__name__ == "SLURMEnvironment"
            )
        trainer = _trainer(
            lightning_zero.ZeroStrategy(stage=stage),
            world,
            max_epochs=2,
            callbacks=[rec],
            gradient_clip_val=0.3,
            enable_checkpointing=False,
        )
        model = LitGPT()
        trainer.fit(model, data, ckpt_path=f"{root}/ep0.ckpt")
        out["losses"] = rec.losses
        out["global_step"] = trainer.global_step
    out["cluster"] = type(trainer.strategy.cluster_environment).__name__
    return out


def test_checkpoint_resumes_on_other_device_counts(launch, tmp_path) -> None:
    import torch

    ref = launch(_resume_worker, 2, args=(str(tmp_path), "save"), timeout=300)[0]
    assert len(ref["losses"]) == 2 * EPOCH_STEPS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "ep0.ckpt", "ep1.ckpt", "full.ckpt", "logs"]
    _check_memory_log(tmp_path / "logs" / "version_0" / "metrics.csv", ref["memory"])
    _check_sharded_checkpoint_loads_in_lightning(tmp_path, ref["params"])
    # save_top_k=1 removed the sharded directories it replaced; last.ckpt is one too
    kept = sorted(p.name for p in (tmp_path / "best").iterdir())
    assert len(kept) == 2 and "last.ckpt" in kept and all((tmp_path / "best" / k / "latest").is_file() for k in kept), (
        kept
    )
    assert (tmp_path / "ep0.ckpt" / "latest").is_file()  # a sharded directory
    for world, phase in ((3, "slurm"), (1, "one")):
        got = launch(_resume_worker, world, args=(str(tmp_path), phase), timeout=300)[0]
        assert got["global_step"] == 2 * EPOCH_STEPS
        assert len(got["losses"]) == EPOCH_STEPS, got["losses"]
        assert_close(got["losses"], ref["losses"][EPOCH_STEPS:], rtol=1e-6, what=f"resumed on {world} losses")
        if phase == "slurm":
            assert got["cluster"] == "SLURMEnvironment"
    # the full checkpoint loads into the plain, unwrapped module
    full = torch.load(tmp_path / "full.ckpt", map_location="cpu", weights_only=False)
    plain = _lit_class()()
    plain.load_state_dict(full["state_dict"], strict=True)
    for k, v in plain.gpt.state_dict().items():
        assert torch.equal(v, ref["params"][k]), k


def _check_memory_log(csv_file: Path, stats: dict) -> None:
    """ZeroMemoryMonitor logged rank 0's bytes per kind and tier at every logged step."""
    import csv

    rows = [r for r in csv.DictReader(csv_file.open()) if r.get("zero_memory/tier_device")]
    assert len(rows) == 2 * EPOCH_STEPS, rows
    assert stats["tier_device"] > 0 and stats["optimizer_state"] > 0, stats
    last = rows[-1]
    for key, value in stats.items():
        assert float(last[f"zero_memory/{key}"]) == value, (key, last, stats)


def _check_sharded_checkpoint_loads_in_lightning(root: Path, params: dict) -> None:
    """A sharded directory (2 ranks, ZeRO-3) loads with LightningModule.load_from_checkpoint
    directly, and `zero-strategy convert` writes one fp32 .ckpt that it loads: the saved weights
    exactly, the hyperparameters and the loop state, no optimizer state."""
    import torch

    from lightning_zero import convert

    LitGPT = _lit_class().Saved
    out = root / "ep1-fp32.ckpt"
    convert.main([str(root / "ep1.ckpt"), str(out)])
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2 * EPOCH_STEPS and ckpt["epoch"] == 1, {k: ckpt[k] for k in ("epoch", "global_step")}
    assert "optimizer_states" not in ckpt and ckpt["hyper_parameters"] == {"sharded": False, "lr": 1e-2}
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values() if v.is_floating_point())
    for how, model in (("converted", LitGPT.load_from_checkpoint(out)),
                       ("directory", LitGPT.load_from_checkpoint(root / "ep1.ckpt"))):  # fmt: skip
        assert model.hparams.lr == 1e-2, how
        got = model.gpt.state_dict()
        assert sorted(got) == sorted(params), how
        for k, v in got.items():
            assert torch.equal(v, params[k]), (how, k)


def test_convert_is_a_zero_strategy_command(tmp_path) -> None:
    """``zero-strategy convert`` is registered as a ``zero_strategy.commands`` entry point (the
    way ``launch`` is) and names lightning_zero's converter; bad input exits with a message."""
    import importlib
    import re

    from lightning_zero import convert

    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."zero_strategy.commands"]', 1)[1].split("\n[", 1)[0]
    target = re.search(r'^convert = "([\w.]+):(\w+)"$', section, re.M)
    assert target, section
    assert getattr(importlib.import_module(target[1]), target[2]) is convert.main
    with pytest.raises(SystemExit) as exc:
        convert.main([str(tmp_path), str(tmp_path / "out.ckpt")])
    assert exc.value.code == 1 and not (tmp_path / "out.ckpt").exists()


def _cli_worker(rank: int, world: int, root: str) -> list:
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.cli import LightningCLI

    import lightning_zero

    LitGPT = _lit_class()

    class Data(LightningDataModule):
        def train_dataloader(self):
            return _data(8, 2)

    cfg = Path(root, "zero3.yaml")
    cfg.write_text("zero_optimization:\n  stage: 3\n  stage3_param_persistence_threshold: 0\n")
    trainer_yaml = Path(root, "cli.yaml")
    trainer_yaml.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  max_steps: 2\n  logger: false\n  enable_checkpointing: false\n"
        f"  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args: {{config: {cfg}}}\n"
    )
    seen = []
    cli = LightningCLI(LitGPT, Data, run=False, save_config_callback=None, args=["--config", str(trainer_yaml)])
    s = cli.trainer.strategy
    assert isinstance(s, lightning_zero.ZeroStrategy) and s.zero_config.stage == 3
    assert s.zero_config.stage3_param_persistence_threshold == 0
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.zero_engine.config.stage == 3 and cli.trainer.global_step == 2
    seen.append(type(s).__name__)
    cli2 = LightningCLI(
        LitGPT,
        Data,
        run=False,
        save_config_callback=None,
        args=["--trainer.strategy=zero2", "--trainer.accelerator=cpu", "--trainer.devices=1"],
    )
    assert (
        isinstance(cli2.trainer.strategy, lightning_zero.ZeroStrategy) and cli2.trainer.strategy.zero_config.stage == 2
    )
    seen.append(cli2.trainer.strategy.zero_config.stage)
    return seen


def test_lightning_cli_yaml_and_flag(launch, tmp_path) -> None:
    assert launch(_cli_worker, 1, args=(str(tmp_path),), timeout=180)[0] == ["ZeroStrategy", 2]


def _fabric_worker(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    import lightning_zero

    data = list(_data(4 * 12 * world, 4))[rank::world]  # 12 micro-batches of 4 per rank

    def build(name: str):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=name)
        fabric.launch()
        model = _gpt()
        return fabric, *fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train(fabric, model, opt, steps: range, losses: list, norms: list) -> None:
        for step in steps:
            for micro in range(2):
                x, y = data[2 * step + micro]
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
                    fabric.backward(loss / 2)
                losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.3)))
            opt.step()
            opt.zero_grad()

    out = {}
    for name in ("ddp", "zero2", "zero3"):
        fabric, model, opt = build(name)
        if name != "ddp":
            assert isinstance(fabric.strategy, lightning_zero.ZeroFabricStrategy)
        losses, norms = [], []
        train(fabric, model, opt, range(3), losses, norms)
        fabric.save(f"{root}/{name}", {"model": model, "optimizer": opt, "step": 3})
        train(fabric, model, opt, range(3, 6), losses, norms)
        fabric2, model2, opt2 = build(name)
        state = {"model": model2, "optimizer": opt2, "step": 0}
        fabric2.load(f"{root}/{name}", state)
        resumed, _ = [], []
        train(fabric2, model2, opt2, range(state["step"], 6), resumed, _)
        out[name] = {"losses": losses, "norms": norms, "resumed": resumed, "step": state["step"]}
    # shard groups through the strategy: a DeviceMesh (the launcher made the process group) and a
    # number, here groups of one rank replicated over both (a 2 x 1 layout; saving is refused with them)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    for name, kwargs in (
        ("zero3_mesh", {"stage": 3, "shard_size": mesh}),
        ("zero2_shard1", {"stage": 2, "shard_size": 1}),
    ):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=lightning_zero.ZeroFabricStrategy(**kwargs))
        fabric.launch()
        model = _gpt()
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        engine = model.zero_engine
        assert (engine.config.shard_size, engine.ctx.world_size, engine.replica.world_size) == (1, 1, world)
        losses, norms = [], []
        train(fabric, model, opt, range(6), losses, norms)
        out[name] = {"losses": losses, "norms": norms}
    return out


def test_fabric_matches_ddp_and_resumes(launch, tmp_path) -> None:
    res = launch(_fabric_worker, 2, args=(str(tmp_path),), timeout=300)[0]
    ref = res["ddp"]
    assert min(ref["norms"]) > 0.3  # clipping is active
    for name in ("zero2", "zero3"):
        got = res[name]
        assert got["step"] == 3
        for key in ("losses", "norms"):
            assert_close(got[key], ref[key], rtol=1e-6, what=f"Fabric {name} {key}")
        assert_close(got["resumed"], got["losses"][6:], rtol=1e-6, what=f"Fabric {name} resumed losses")
    for name in ("zero3_mesh", "zero2_shard1"):  # shard groups: DDP's numbers
        for key in ("losses", "norms"):
            assert_close(res[name][key], ref[key], rtol=1e-6, what=f"Fabric {name} {key}")


def test_errors_name_the_setting_and_the_fix(tmp_path) -> None:
    import lightning.pytorch as pl

    # without the import, Lightning's own error stands
    code = "import lightning.pytorch as pl\ntry:\n    pl.Trainer(strategy='zero3', accelerator='cpu')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Invalid strategy name zero3" in done.stdout or "invalid strategy" in done.stdout.lower(), (
        done.stdout + done.stderr
    )
    assert "lightning_zero" not in done.stdout
    import lightning_zero

    with pytest.raises(ValueError, match="stag.*did you mean 'stage'"):
        lightning_zero.ZeroStrategy(config={"zero_optimization": {"stag": 3}})
    cfg = tmp_path / "z.yaml"
    cfg.write_text("zero_optimization: {stage: 2}\n")
    with pytest.raises(ValueError, match="stage=2 from the config conflicts with stage=3"):
        lightning_zero.ZeroStrategy(config=str(cfg), stage=3)
    with pytest.raises(ValueError, match="state_dict_type"):
        lightning_zero.ZeroStrategy(state_dict_type="whole")
    # shard groups: a number or "node" reaches the config the engine gets (a mesh: the Fabric launch)
    for cls in (lightning_zero.ZeroStrategy, lightning_zero.ZeroFabricStrategy):
        assert cls(stage=3, shard_size="node").zero_config.shard_size == "node"
        assert cls(shard_size=2).zero_config.shard_size == 2
        with pytest.raises(
            ValueError, match=r"shard_size=2 from the config conflicts with shard_size=4 from \w+\(shard_size"
        ):
            cls(config={"zero_optimization": {"mics_shard_size": 2}}, shard_size=4)
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        pl.Trainer(strategy="zero2", accelerator="cpu", precision="64-true")
    # importing again registers nothing twice
    import importlib

    importlib.reload(lightning_zero)
    assert "zero3_offload_nvme" in pl.strategies.StrategyRegistry


def test_config_file_precision_conflicts_with_trainer() -> None:
    import zero_strategy as zs
    from lightning_zero import _settings as S

    cfg = zs.ZeroConfig.from_dict({"bf16": {"enabled": True}, "gradient_clipping": 1.0})
    assert S.apply_lightning_arguments(cfg, precision="32-true", gradient_clip_val=None, gradient_clip_algorithm="norm",
                                       accumulate_grad_batches=1, source="Trainer").precision.param_dtype is not None  # fmt: skip
    with pytest.raises(ValueError, match="gradient_clipping=1.0 from the config conflicts with gradient_clipping=0.5"):
        S.apply_lightning_arguments(cfg, precision="32-true", gradient_clip_val=0.5, gradient_clip_algorithm="norm",
                                    accumulate_grad_batches=1, source="Trainer")  # fmt: skip
    with pytest.raises(ValueError, match="precision=bf16 from the config conflicts with precision=16-mixed"):
        S.apply_lightning_arguments(cfg, precision="16-mixed", gradient_clip_val=None, gradient_clip_algorithm=None,
                                    accumulate_grad_batches=1, source="Trainer")  # fmt: skip
    # the file's DeepSpeed bf16 (16-bit parameters) stays under "bf16-mixed", as Lightning's DeepSpeed strategy maps it
    kept = S.apply_lightning_arguments(cfg, precision="bf16-mixed", gradient_clip_val=None, gradient_clip_algorithm=None,
                                       accumulate_grad_batches=1, source="Trainer")  # fmt: skip
    assert kept.precision.param_dtype == zs.ZeroConfig(precision="bf16-true").precision.param_dtype
    # without a file, the Trainer's names: "*-mixed" is autocast over fp32, "*-true" 16-bit parameters
    plain = zs.ZeroConfig()
    for flag, param, autocast in (
        ("bf16-mixed", None, "bf16"),
        ("16-mixed", None, "fp16"),
        ("bf16-true", "bf16", "bf16"),
    ):
        got = S.apply_lightning_arguments(plain, precision=flag, gradient_clip_val=None, gradient_clip_algorithm=None,
                                          accumulate_grad_batches=1, source="Trainer").precision  # fmt: skip
        assert got == zs.ZeroConfig(precision={"param_dtype": param, "autocast_dtype": autocast}).precision, flag


def _run_script(cmd: list[str], timeout: float) -> str:
    """Run ``cmd`` in its own process group; kill the whole group at the timeout."""
    import signal

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0 or teardown_abort_only(out, proc.returncode, ranks=2), out[-3000:]
    return out


def python_exceptions(text: str) -> list[str]:
    """The Python tracebacks in ``text``, except the launcher's own report of a failed child
    (torchrun's ChildFailedError, which follows any child's failure)."""
    blocks = text.split("Traceback (most recent call last)")[1:]
    return [b for b in blocks if "ChildFailedError" not in b.split("\n\n")[0]]


def teardown_abort_only(out: str, returncode: int, ranks: int) -> bool:
    """The one tolerated failure: every rank printed "rank N: done" after the example's final
    barrier, no Python exception was raised, and the failing processes were killed by SIGABRT
    (gloo's teardown abort): the launcher's own exit code, or torchrun's ``exitcode : -6``."""
    import re
    import signal

    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)] or [returncode]
    done = all(f"rank {r}: done" in out for r in range(ranks))
    return done and not python_exceptions(out) and all(c == -signal.SIGABRT for c in codes)


def test_only_a_teardown_sigabrt_after_the_final_barrier_is_tolerated() -> None:
    done = "rank 0: done\nrank 1: done\n"
    assert teardown_abort_only(done, -6, ranks=2)
    assert teardown_abort_only(
        done + "exitcode  : -6 (pid: 7)\nTraceback (most recent call last):\n  x\nChildFailedError:", 1, ranks=2
    )
    assert not teardown_abort_only("rank 0: done\n", -6, ranks=2)  # rank 1 never passed the barrier
    assert not teardown_abort_only(done, 1, ranks=2)  # an exit code, not gloo's abort
    assert not teardown_abort_only(done + "exitcode  : 1 (pid: 7)", 1, ranks=2)
    assert not teardown_abort_only(
        done + "Traceback (most recent call last):\n  File x\nValueError: boom\n", -6, ranks=2
    )


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_example_runs_with_two_processes(launcher: str) -> None:
    example = str(Path(__file__).parents[2] / "examples" / "train_lightning_gpt.py")
    tiny = ["--steps", "4", "--d-model", "32", "--layers", "1", "--seq-len", "16", "--batch", "2"]
    if launcher == "lightning":  # devices=2 in a script: Lightning's subprocess launcher starts rank 1
        cmd = [sys.executable, example, "--devices", "2", *tiny]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", example, *tiny]
    out = _run_script(cmd, timeout=240)
    assert "rank 0: model state" in out and "rank 1: model state" in out, out[-3000:]
    assert "rank 0: done" in out and "rank 1: done" in out, out[-3000:]
    assert "step    4  loss" in out, out[-3000:]


def test_example_names_a_missing_strategy_file(tmp_path: Path) -> None:
    """Not Lightning's "invalid strategy name": a path that is not there is a missing file."""
    example = str(Path(__file__).parents[2] / "examples" / "train_lightning_gpt.py")
    done = subprocess.run([sys.executable, example, "--strategy", "configs/zero9.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "--strategy configs/zero9.yaml: the file does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("accelerator", "precision"),
    [("cpu", "bf16-mixed"), pytest.param("gpu", "16-mixed", marks=pytest.mark.gpu),
     pytest.param("gpu", "bf16-mixed", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_example_with_mixed_precision(accelerator: str, precision: str) -> None:
    """fp16 runs through the engine's loss scaler, only where CUDA is present: on a CPU
    Lightning itself turns "16-mixed" into "bf16-mixed" (fp16 autocast is not its CPU path), the
    run of the ``cpu`` variant, which runs the same script in CI (about 20 s, mostly start-up)."""
    example = str(Path(__file__).parents[2] / "examples" / "train_lightning_gpt.py")
    out = _run_script([sys.executable, example, "--accelerator", accelerator, "--devices", "1", "--precision",
                       precision, "--steps", "20", "--d-model", "64", "--layers", "2"], timeout=300)  # fmt: skip
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step") and " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0], out[-3000:]


def test_a_sharded_directory_given_to_a_one_file_reader_names_the_fix(tmp_path) -> None:
    """``Trainer(ckpt_path=<ZeroStrategy's directory>)`` under another strategy reads it with
    Fabric's ``TorchCheckpointIO``, which opened it as a file (a bare ``IsADirectoryError``
    before): the error now names ZeroStrategy and ``zero-strategy convert`` (and stays an
    ``IsADirectoryError``); ``load_from_checkpoint`` reads the directory (the 2-rank test above)."""
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as StandaloneIO

    import lightning_zero  # noqa: F401  # installs the readers

    root = tmp_path / "ep1.ckpt"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "zero_meta.json").write_text("{}")  # what marks a zero_strategy checkpoint
    (root / "latest").write_text("step-1")
    for io in (TorchCheckpointIO(), StandaloneIO()):
        with pytest.raises(IsADirectoryError) as caught:
            io.load_checkpoint(root)
        message = str(caught.value)
        assert type(caught.value).__name__ == "ShardedCheckpointError", message
        assert f"`zero-strategy convert {root} out.ckpt`" in message and "ZeroStrategy" in message, message
    plain = tmp_path / "plain.ckpt"
    torch.save({"x": 1}, plain)
    assert TorchCheckpointIO().load_checkpoint(plain) == {"x": 1}  # a file: Fabric's reader, unchanged
