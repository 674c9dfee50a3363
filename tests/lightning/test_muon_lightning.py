"""Muon through ``Trainer(strategy=...)`` (lightning_zero) against Lightning's own ``ddp``.

A tiny GPT (``zero_strategy.testing.parity.Net``) whose blocks' 2-D weights go to Muon and the
rest (embeddings, norms, head) to AdamW, in fp32 on 2 ranks, one launch:

- ``one``: ``configure_optimizers`` returns one optimizer with Muon groups and AdamW groups
  (``MuonWithAdamW`` from ``tests/accelerate/_muon_optim.py``, ``use_muon`` per group), with
  automatic optimization, ``accumulate_grad_batches=2`` and ``gradient_clip_val``: DDP, ZeRO-1
  and ZeRO-3 (every unit freed after use);
- ``two``: ``[torch.optim.Muon, torch.optim.AdamW]`` with manual optimization
  (``self.optimizers()``, ``manual_backward``, both stepped): DDP and ZeRO-2.

Every ZeRO run's losses and final weights equal its DDP run's within 1e-6 relative, and the
engine steps the 8 block matrices whole (one owner each, on both ranks)."""

from __future__ import annotations

from zero_strategy.testing import assert_close, run_subtests

MATRICES = 8  # 2 blocks x (qkv, proj, fc, mlp proj)


def _lit(form: str):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from tests.accelerate._muon_optim import one_optimizer, two_optimizers
    from zero_strategy.testing.parity import VOCAB, Cell, Net

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = form == "one"
            self.net = Net(Cell())
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.net(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            if form == "one":
                return loss
            opts = self.optimizers()
            self.manual_backward(loss)
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
            return None

        def configure_optimizers(self):
            return one_optimizer(self.net, "blocks") if form == "one" else two_optimizers(self.net, "blocks")

    return Lit, torch


def _worker(rank: int, world: int) -> bool:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero
    import zero_strategy as zs
    from zero_strategy.testing.parity import SEQ, VOCAB

    def fit(form: str, strategy):
        Lit, torch = _lit(form)
        torch.manual_seed(0)
        model = Lit()
        tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(3))
        extra = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5} if form == "one" else {}
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             **extra)  # fmt: skip
        trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=4))  # 4 batches per rank
        engine = getattr(model, "zero_engine", None)
        with zs.gathered_parameters(model) if engine is not None else torch.no_grad():
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model.losses, weights, engine

    refs = {form: fit(form, "ddp") for form in ("one", "two")}

    def case(form: str, stage: int) -> None:
        strategy = lightning_zero.ZeroStrategy(stage=stage, config={"stage3_param_persistence_threshold": 0})
        losses, weights, engine = fit(form, strategy)
        ref_losses, ref_weights, _ = refs[form]
        what = f"rank {rank} {form} ZeRO-{stage}"
        assert len(ref_losses) == 4, ref_losses
        assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7, what=f"{what} losses")
        for k, v in ref_weights.items():
            assert_close(weights[k], v, rtol=1e-6, atol=1e-7, what=f"{what} {k}")
        owners = [e.owner for e in engine.whole.entries]
        assert len(owners) == MATRICES and set(owners) == set(range(world)), f"{what}: owners {owners}"

    grid = [{"form": "one", "stage": 1}, {"form": "one", "stage": 3}, {"form": "two", "stage": 2}]
    run_subtests(case, grid, label="Lightning Muon")
    return True


def test_lightning_muon_equals_ddp(launch) -> None:
    assert all(launch(_worker, 2, timeout=300))
