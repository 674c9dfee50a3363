"""Lightning programs as their users write them, against Lightning's own DDP: seeded with
``seed_everything``, dropout in every layer, a model from ``torch.nn`` (``TransformerEncoder``),
validation and test loops. Switching ``strategy="ddp"`` to a zero strategy must change no
random number and no logged value."""

from __future__ import annotations

from zero_strategy.testing import assert_close

VOCAB, SEQ, D = 32, 8, 32


def _rng_digest() -> dict[str, int]:
    """A digest of every random stream a training step draws from."""
    import hashlib
    import pickle
    import random

    import numpy as np
    import torch

    def h(obj) -> int:
        return int(hashlib.sha1(pickle.dumps(obj)).hexdigest()[:12], 16)

    out = {
        "torch": h(torch.get_rng_state().tolist()),
        "random": h(random.getstate()),
        "numpy": h(np.random.get_state()[1].tolist()),
    }
    if torch.cuda.is_available():
        out["cuda"] = h([s.tolist() for s in torch.cuda.get_rng_state_all()])
    return out


def _lit_transformer():
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class LitTransformer(pl.LightningModule):
        """A tiny language model on ``nn.TransformerEncoder`` with dropout 0.2 everywhere; built
        in ``configure_model`` (under ``sharded_init`` at zero3) when ``in_configure_model``."""

        def __init__(self, in_configure_model: bool = False) -> None:
            super().__init__()
            self.in_configure_model = in_configure_model
            if not in_configure_model:
                self._build()
            self.digests: dict[str, dict[str, int]] = {}
            self.first_rand: float | None = None

        def _build(self) -> None:
            self.emb = nn.Embedding(VOCAB, D)
            layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=64, dropout=0.2, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.drop = nn.Dropout(0.2)
            self.head = nn.Linear(D, VOCAB)

        def configure_model(self) -> None:
            if self.in_configure_model and not hasattr(self, "emb"):
                self._build()
                self.built_bytes = sum(p.untyped_storage().nbytes() for p in self.parameters())

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.drop(self.encoder(self.emb(x), mask=mask, is_causal=True)))

        def _loss(self, batch):
            x, y = batch
            return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

        def on_fit_start(self) -> None:
            self.digests["fit_start"] = _rng_digest()

        def training_step(self, batch, batch_idx):
            if self.first_rand is None:
                self.first_rand = float(torch.rand(1))  # the program's own draw, as in the report
            loss = self._loss(batch)
            self.log("train_loss", loss, sync_dist=True, on_step=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    return LitTransformer


def _data(n: int, batch: int, seed: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=True)


def _trainer_worker(rank: int, world: int) -> dict:
    import lightning.pytorch as pl

    import lightning_zero

    lightning_zero.register()  # the strategy names

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.train: list[float] = []
            self.val: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.train.append(float(trainer.callback_metrics["train_loss"]))

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self.val.append(float(trainer.callback_metrics["val_loss"]))

    LitTransformer = _lit_transformer()
    out: dict = {}
    names = ("ddp", "zero1", "zero2", "zero3", "zero3_freed", "ddp_configure_model", "zero3_configure_model")
    for name in names:
        pl.seed_everything(42, verbose=False)  # the user's first line; shuffling and dropout follow from it
        rec = Record()
        strategy = name.split("_")[0]
        if name == "zero3_freed":  # every unit freed after use (the default threshold keeps this model's gathered)
            strategy = lightning_zero.ZeroStrategy(stage=3, config={"stage3_param_persistence_threshold": 0})
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=30, gradient_clip_val=0.5,
                             val_check_interval=10, limit_val_batches=2, num_sanity_val_steps=1, callbacks=[rec],
                             logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        model = LitTransformer(in_configure_model=name.endswith("configure_model"))
        trainer.fit(model, _data(30 * 2 * world, 2, seed=1), _data(8, 2, seed=2))
        if name == "zero3_configure_model":  # sharded as it was built: no rank held the whole model
            out["built_bytes"] = (model.built_bytes, sum(p.numel() * 4 for p in model.parameters()))
        test = trainer.test(model, _data(8, 2, seed=3), verbose=False)[0]["test_loss"]
        out[name] = {"train": rec.train, "val": rec.val, "test": test, "digest": model.digests["fit_start"],
                     "first_rand": model.first_rand, "engine": getattr(model, "zero_engine", None) is not None}  # fmt: skip
    return out


def _lit_batchnorm():
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class LitBN(pl.LightningModule):
        """An MLP with BatchNorm: sync_batchnorm converts it, and it trains in fp32 statistics."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True, on_step=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LitBN


def _bn_clip_worker(rank: int, world: int) -> dict:
    """A BatchNorm model with gradient_clip_algorithm="value" against DDP; then sync_batchnorm=True,
    which torch's SyncBatchNorm runs on GPUs only: on CPU the check is that the strategy converted
    the layers before sharding them (the first training forward then reaches SyncBatchNorm's own
    device check)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero  # noqa: F401

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.train: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.train.append(float(trainer.callback_metrics["train_loss"]))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(80, 8, generator=g), torch.randint(0, 4, (80,), generator=g))
    out = {}
    for name in ("ddp", "zero2", "zero3"):
        pl.seed_everything(3, verbose=False)
        rec = Record()
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=world, max_steps=8,
                             gradient_clip_val=0.01, gradient_clip_algorithm="value", callbacks=[rec], logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        model = _lit_batchnorm()()
        trainer.fit(model, DataLoader(data, batch_size=4))
        out[name] = {"train": rec.train, "running_mean": model.net[1].running_mean.tolist()}
    for name in ("zero2", "zero3"):
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=world, max_steps=1, sync_batchnorm=True, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        model = _lit_batchnorm()()
        try:
            trainer.fit(model, DataLoader(data, batch_size=4))
            error = "trained"
        except ValueError as e:
            error = str(e)
        bn = model.net[1]
        engine = getattr(model, "zero_engine", None)
        managed = engine is not None and engine.reducer.manages(bn.weight)
        out[f"sync_{name}"] = {"type": type(bn).__name__, "managed": managed, "error": error}
    return out


def test_batchnorm_clipping_by_value_and_sync_batchnorm(launch) -> None:
    for rank, res in enumerate(launch(_bn_clip_worker, 2, timeout=300)):
        ref = res["ddp"]
        assert len(ref["train"]) == 8
        for name in ("zero2", "zero3"):
            got = res[name]
            assert_close(got["train"], ref["train"], rtol=1e-6, what=f"rank {rank} {name} losses")
            assert_close(
                got["running_mean"], ref["running_mean"], rtol=1e-6, atol=1e-7, what=f"rank {rank} {name} running mean"
            )
            sync = res[f"sync_{name}"]
            # converted before the engine took the module: the SyncBatchNorm's own weight is managed
            assert sync["type"] == "SyncBatchNorm" and sync["managed"], sync
            assert "SyncBatchNorm expected input tensor to be on GPU" in sync["error"], sync


def test_trainer_with_dropout_and_seed_everything_equals_ddp(launch) -> None:
    for rank, res in enumerate(launch(_trainer_worker, 2, timeout=600)):
        assert len(res["ddp"]["train"]) == 30 and len(res["ddp"]["val"]) == 3, res["ddp"]
        # built in configure_model (torch's TransformerEncoderLayer under sharded_init at zero3):
        # against DDP building it there too, as Lightning re-seeds before configure_model
        for name in ("zero1", "zero2", "zero3", "zero3_freed", "zero3_configure_model"):
            ref = res["ddp_configure_model" if name.endswith("configure_model") else "ddp"]
            got = res[name]
            assert got["engine"], name
            # setup leaves every random stream exactly where DDP's setup leaves it
            assert got["digest"] == ref["digest"], (rank, name, got["digest"], ref["digest"])
            assert got["first_rand"] == ref["first_rand"], (rank, name, got["first_rand"], ref["first_rand"])
            assert_close(got["train"], ref["train"], rtol=1e-6, what=f"rank {rank} {name} train_loss")
            assert_close(got["val"], ref["val"], rtol=1e-6, what=f"rank {rank} {name} val_loss")
            assert_close([got["test"]], [ref["test"]], rtol=1e-6, what=f"rank {rank} {name} test_loss")
        built, full = res["built_bytes"]
        assert built < full / 10, f"rank {rank}: configure_model left {built} of {full} bytes whole"


def _fabric_worker(rank: int, world: int) -> dict:
    import lightning as L
    import torch

    import lightning_zero  # noqa: F401

    out = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        L.seed_everything(7, verbose=False)
        fabric = L.Fabric(strategy=name, accelerator="cpu", devices=world)
        fabric.launch()
        with fabric.init_module():  # zero3: each module is sharded as it is built
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
        built_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = fabric.setup(model, opt)
        digest = _rng_digest()
        losses = []
        for step in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(x).square().mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        out[name] = {"digest": digest, "losses": losses, "built_bytes": built_bytes}
    return out


def test_fabric_setup_leaves_the_random_streams_as_ddp(launch) -> None:
    """Fabric's DDP does not re-seed at setup (the Trainer's does): neither may the zero strategies.
    The model is built in fabric.init_module(), which shards it at zero3."""
    for rank, res in enumerate(launch(_fabric_worker, 2, timeout=300)):
        # fabric.init_module() at zero3: no parameter held its full values after construction
        assert res["zero3"]["built_bytes"] < res["ddp"]["built_bytes"] / 10, (
            res["zero3"]["built_bytes"],
            res["ddp"]["built_bytes"],
        )
        for name in ("zero1", "zero2", "zero3"):
            assert res[name]["digest"] == res["ddp"]["digest"], (rank, name)
            assert_close(res[name]["losses"], res["ddp"]["losses"], rtol=1e-6, what=f"rank {rank} {name} losses")


def test_digest_sees_every_stream() -> None:
    """The digest itself: a draw from any one stream changes it."""
    import random

    import numpy as np
    import torch

    before = _rng_digest()
    torch.rand(1)
    after_torch = _rng_digest()
    random.random()
    after_random = _rng_digest()
    np.random.rand()
    after_numpy = _rng_digest()
    assert before["torch"] != after_torch["torch"] and after_torch["random"] != after_random["random"]
    assert after_random["numpy"] != after_numpy["numpy"]
