"""A Lightning GAN with two optimizers and manual optimization, in the shape of Lightning's
``domain_templates/generative_adversarial_net.py`` (``self.optimizers()``,
``toggle_optimizer``, ``manual_backward``, ``opt.step()``, ``opt.zero_grad()``,
``untoggle_optimizer``), plus ``self.clip_gradients(opt_d, ...)`` and dropout, against
Lightning's own ``ddp`` strategy: the same losses every step and the same weights at stages
1-3 (ZeRO-3 with every unit freed after use), and a resume from a checkpoint saved at ZeRO-2
and loaded at ZeRO-3 (``trainer.fit(ckpt_path=...)``) that continues exactly. Fabric:
``fabric.setup(gan, opt_g, opt_d)``, ``fabric.clip_gradients(gan, opt_d, ...)`` and
``fabric.save``/``fabric.load`` of both optimizers, against Fabric's DDP.

Each training step seeds torch from the global step, so the noise and dropout of a step are
the same in an uninterrupted run and in a resumed one."""

from __future__ import annotations

from pathlib import Path

from zero_strategy.testing import assert_close

LATENT, IMG, HID = 8, 12, 16


def _lit_gan():
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(LATENT, HID), nn.LeakyReLU(0.2), nn.Linear(HID, IMG), nn.Tanh())

        def forward(self, z):
            return self.model(z)

    class Discriminator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(IMG, HID), nn.LeakyReLU(0.2), nn.Dropout(0.25), nn.Linear(HID, 1))

        def forward(self, img):
            return self.model(img)

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = Generator()
            self.discriminator = Discriminator()
            self.losses: list[float] = []

        def forward(self, z):
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            (imgs,) = batch
            torch.manual_seed(1000 * self.global_step + self.global_rank)  # noise and dropout follow the step
            opt_g, opt_d = self.optimizers()
            z = torch.randn(imgs.shape[0], LATENT)
            valid, fake = torch.ones(imgs.size(0), 1), torch.zeros(imgs.size(0), 1)

            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs), valid)
            fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            self.manual_backward(d_loss)
            self.clip_gradients(opt_d, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            self.losses += [g_loss.item(), d_loss.item()]

        def configure_optimizers(self):
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
            return [opt_g, opt_d]

    return GAN


def _data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    imgs = torch.rand(24, IMG, generator=torch.Generator().manual_seed(7)) * 2 - 1
    return DataLoader(TensorDataset(imgs), batch_size=4, shuffle=True)  # 3 batches per rank and epoch


def _worker(rank: int, world: int, root: str) -> dict:
    import lightning.pytorch as pl
    import torch

    import lightning_zero
    import zero_strategy as zs

    GAN = _lit_gan()

    def fit(strategy, epochs: int, model=None, ckpt_path=None):
        pl.seed_everything(42, verbose=False)
        model = model or GAN()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=epochs, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return trainer, model

    def weights(model) -> dict:
        engine = getattr(model, "zero_engine", None)
        with zs.gathered_parameters(model) if engine is not None else torch.no_grad():
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    out = {}
    for name in ("ddp", "zero1", "zero2", "zero3_freed"):
        strategy = name
        if name == "zero3_freed":  # every unit freed after use (the default threshold keeps this model gathered)
            strategy = lightning_zero.ZeroStrategy(stage=3, config={"stage3_param_persistence_threshold": 0})
        if name == "ddp":
            strategy = "ddp_find_unused_parameters_true"  # toggle_optimizer leaves the other half unused
        trainer, model = fit(strategy, 2)
        out[name] = {"losses": model.losses, "weights": weights(model), "steps": trainer.global_step}
    # resume: one epoch at ZeRO-2, a sharded checkpoint, the second epoch at ZeRO-3 from it
    trainer, first = fit("zero2", 1)
    path = str(Path(root) / "gan.ckpt")
    trainer.save_checkpoint(path)
    _, resumed = fit(lightning_zero.ZeroStrategy(stage=3), 2, ckpt_path=path)
    out["resumed"] = {"losses": first.losses + resumed.losses, "weights": weights(resumed)}
    return out


def test_lightning_gan_manual_optimization_equals_ddp(launch, tmp_path: Path) -> None:
    for rank, res in enumerate(launch(_worker, 2, args=(str(tmp_path),), timeout=600)):
        ref = res["ddp"]
        assert len(ref["losses"]) == 12 and ref["steps"] == 12, ref["steps"]  # 6 batches, 2 optimizer steps each
        for name in ("zero1", "zero2", "zero3_freed", "resumed"):
            got = res[name]
            assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-7, what=f"rank {rank} {name} losses")
            for k, v in ref["weights"].items():
                assert_close(got["weights"][k], v, rtol=1e-5, atol=1e-6, what=f"rank {rank} {name} {k}")


def _fabric_worker(rank: int, world: int, root: str) -> dict:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.fabric.strategies import DDPStrategy
    from torch import nn

    import lightning_zero

    class GAN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.generator = nn.Sequential(nn.Linear(LATENT, HID), nn.LeakyReLU(0.2), nn.Linear(HID, IMG), nn.Tanh())
            self.discriminator = nn.Sequential(nn.Linear(IMG, HID), nn.Dropout(0.25), nn.Linear(HID, 1))

        def forward(self, z, real=None):
            fake = self.generator(z)
            if real is None:
                return self.discriminator(fake)
            return self.discriminator(real), self.discriminator(fake.detach())

    def run(strategy, steps: range, load: str | None = None, save: str | None = None) -> list[float]:
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=world)
        fabric.launch()
        torch.manual_seed(0)
        model = GAN()
        opt_g = torch.optim.Adam(model.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        model, opt_g, opt_d = fabric.setup(model, opt_g, opt_d)
        state = {"model": model, "opt_g": opt_g, "opt_d": opt_d}
        if load is not None:
            fabric.load(load, state)
        inner, out = model.module, []
        for step in steps:
            g = torch.Generator().manual_seed(100 * step + rank)
            z, real = torch.randn(4, LATENT, generator=g), torch.rand(4, IMG, generator=g)
            torch.manual_seed(10 * step + rank)
            inner.discriminator.requires_grad_(False)
            g_loss = F.binary_cross_entropy_with_logits(model(z), torch.ones(4, 1))
            fabric.backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            inner.discriminator.requires_grad_(True)
            inner.generator.requires_grad_(False)
            real_logit, fake_logit = model(z, real)
            d_loss = F.binary_cross_entropy_with_logits(
                real_logit, torch.ones(4, 1)
            ) + F.binary_cross_entropy_with_logits(fake_logit, torch.zeros(4, 1))
            fabric.backward(d_loss)
            out.append(float(fabric.clip_gradients(model, opt_d, max_norm=0.05)))
            opt_d.step()
            opt_d.zero_grad()
            inner.generator.requires_grad_(True)
            out += [g_loss.item(), d_loss.item()]
        if save is not None:
            fabric.save(save, state)
        return out

    ref = run(DDPStrategy(find_unused_parameters=True), range(4))
    path = str(Path(root) / "fabric-gan")
    first = run(lightning_zero.ZeroFabricStrategy(stage=2), range(2), save=path)
    rest = run(lightning_zero.ZeroFabricStrategy(stage=3), range(2, 4), load=path)
    return {"ddp": ref, "zero": first + rest}


def test_fabric_gan_two_optimizers_save_load_equals_ddp(launch, tmp_path: Path) -> None:
    for rank, res in enumerate(launch(_fabric_worker, 2, args=(str(tmp_path),), timeout=300)):
        assert len(res["ddp"]) == 12 and min(res["ddp"][0::3]) > 0.05  # the clipped norms: clipping was active
        assert_close(res["zero"], res["ddp"], rtol=1e-5, atol=1e-7, what=f"rank {rank} Fabric GAN")
