"""After ``trainer.fit`` with ``ZeroStrategy``, nothing of the engine's waits in a reference cycle.

Lightning itself keeps reference cycles, with its own DDP strategy as with ours: the Trainer and
its connectors and loops point at each other and at the LightningModule, the module's
``_trainer`` points back, and Lightning's forward redirection leaves the module's bound
``forward`` in its ``__dict__``. So after ``del trainer, model`` the module waits for Python's
cyclic collector, and the engine with it (the module owns its engine), as a DDP module does. What
is ours is checked here: the engine and the optimizer the strategy bound are in no reference
cycle (the engine goes with the module, by reference counting, as soon as the module goes), and
once the collector has run nothing is left: no registry of ours keeps the trainer, the module,
a parameter, the engine or the optimizer."""

from __future__ import annotations

import weakref

import pytest


def _fit(strategy):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    model = Lit()
    trainer.fit(model, data)
    return trainer, model


@pytest.mark.parametrize("strategy", ["zero3", "zero2_offload"])
def test_fit_leaves_no_cycle_of_ours(strategy: str) -> None:
    import lightning_zero
    from zero_strategy.testing.refcount import collector_off, cycle_through, left_to_the_collector, still_alive

    lightning_zero.register()
    try:
        _check_no_cycle(strategy, collector_off, cycle_through, left_to_the_collector, still_alive)
    finally:  # Lightning's launcher made a one-rank default group in this process (as its DDP does)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _check_no_cycle(strategy, collector_off, cycle_through, left_to_the_collector, still_alive) -> None:
    with collector_off():
        trainer, model = _fit(strategy)
        engine, opt = model.zero_engine, trainer.optimizers[0]
        refs = {"trainer": weakref.ref(trainer), "model": weakref.ref(model), "engine": weakref.ref(engine),
                "optimizer": weakref.ref(opt), "a parameter": weakref.ref(next(model.parameters()))}  # fmt: skip
        assert opt.zero_engine is engine
        cycles = {"engine": cycle_through(engine), "optimizer": cycle_through(opt)}
        assert cycles == {"engine": None, "optimizer": None}, cycles
        del trainer, model, engine, opt
        left_to_the_collector()  # Lightning's own cycles (module doc)
        assert still_alive(refs) == [], still_alive(refs)
