"""Train a small GPT with PyTorch Lightning and ZeRO-3, on the Python standard library's own
source (byte-level, found at run time, no download).

    python examples/train_lightning_gpt.py                          # 2 CPU processes, zero3
    python examples/train_lightning_gpt.py --strategy zero2 --devices 1
    torchrun --nproc_per_node 2 examples/train_lightning_gpt.py    # processes from torchrun
    python examples/train_lightning_gpt.py --accelerator gpu --devices 2 --precision bf16-mixed

Lightning starts the other processes itself (``devices=N`` in a script). The model is built
in ``configure_model``, so under ``zero3`` every rank builds only its own pieces. At the end
each rank prints the model state it holds next to what DDP would hold.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_zero
import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig, num_parameters
from zero_strategy.models.data import stdlib_corpus


class Windows(Dataset):
    """Random windows of the byte corpus; item ``i`` is always the same window."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.starts = torch.randint(0, corpus.numel() - seq_len - 1, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.corpus[s : s + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class LitGPT(pl.LightningModule):
    def __init__(self, d_model: int, layers: int, seq_len: int, lr: float, steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(vocab_size=256, seq_len=seq_len, d_model=d_model, n_layer=layers, n_head=4)
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:  # under zero3 each module is cut into shards as it is built
            torch.manual_seed(0)
            self.gpt = GPT(self.cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float().reshape(-1, 256), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class Report(pl.Callback):
    """Every rank's model-state bytes next to DDP's (fp32 params + grads + Adam moments)."""

    def on_train_end(self, trainer: pl.Trainer, module: LitGPT) -> None:
        psi = num_parameters(module.gpt)
        ddp = 16 * psi
        line = f"rank {trainer.global_rank}: "
        if getattr(module, "zero_engine", None) is not None:
            stats = zs.memory_stats(module)
            line += (f"model state {stats['model_state'] / 2**20:.1f} MiB (param shards {stats['param_shards'] / 2**20:.1f}, "
                     f"grad shards {stats['grad_shards'] / 2**20:.1f}, optimizer {stats['optimizer_state'] / 2**20:.1f}); ")  # fmt: skip
        line += f"DDP would hold {ddp / 2**20:.1f} MiB for {psi / 1e6:.2f}M parameters"
        print(line + "\n", end="", flush=True)  # one write: lines of ranks never interleave


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="zero3", help="zero1 | zero2 | zero3 | ddp, or a config file path")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="per device")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ckpt-dir", default=None, help="write sharded checkpoints here (ModelCheckpoint)")
    args = p.parse_args()

    strategy = args.strategy
    if os.path.exists(strategy):  # a YAML/JSON config (DeepSpeed key names)
        strategy = lightning_zero.ZeroStrategy(config=strategy)
    elif os.sep in strategy or strategy.endswith((".yaml", ".yml", ".json")):  # a path, not a strategy name
        p.error(
            f"--strategy {strategy}: the file does not exist (relative to {os.getcwd()}); give a config file or a name"
        )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    corpus = stdlib_corpus()
    n_train = args.steps * args.batch * args.devices * args.accumulate
    train = DataLoader(Windows(corpus, args.seq_len, n_train, seed=0), batch_size=args.batch)
    val = DataLoader(Windows(corpus, args.seq_len, 4 * args.batch * args.devices, seed=1), batch_size=args.batch)
    callbacks: list[pl.Callback] = [Report()]
    if args.ckpt_dir:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=max(1, args.steps // 2))
        )
    trainer = pl.Trainer(
        default_root_dir="runs/lightning",  # git-ignored, like every example's output
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        val_check_interval=max(1, args.steps // 4),
        limit_val_batches=4,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=callbacks + [PrintLoss()],
    )
    trainer.fit(LitGPT(args.d_model, args.layers, args.seq_len, args.lr, args.steps), train, val)
    trainer.strategy.barrier()  # every rank finished; what follows is teardown
    print(f"rank {trainer.global_rank}: done\n", end="", flush=True)  # one write per line


class PrintLoss(pl.Callback):
    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step, boundary = trainer.global_step, (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if trainer.is_global_zero and boundary and (step % 20 == 0 or step in (1, trainer.max_steps)):
            print(f"step {step:4d}  loss {float(trainer.callback_metrics['loss']):.4f}", flush=True)

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero and "val_loss" in trainer.callback_metrics and not trainer.sanity_checking:
            print(
                f"step {trainer.global_step:4d}  val_loss {float(trainer.callback_metrics['val_loss']):.4f}", flush=True
            )


if __name__ == "__main__":
    main()
