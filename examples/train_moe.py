"""Train a small top-2 mixture-of-experts transformer (a Hugging Face Mixtral built from a config,
no download) with PyTorch Lightning and ZeRO-3 on the bundled text, then generate from a prompt.

    python examples/train_moe.py                        # 2 CPU processes, ZeRO-3
    python examples/train_moe.py --experts 64 --steps 100
    python examples/train_moe.py --expert-layout owners # each expert whole on one rank

At ZeRO-3 the experts of each layer are gathered by the router's selection: only the experts
some rank's tokens chose travel (docs/moe.md). At the end every rank prints how many expert
bytes were gathered against what gathering every expert would have moved, then all ranks
generate together (every forward at ZeRO-3 is a collective) and rank 0 prints the text.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, Dataset

import lightning_zero
import zero_strategy as zs
from zero_strategy.models.data import stdlib_corpus


class Windows(Dataset):
    """Random windows of the byte corpus; item ``i`` is always the same window."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.starts = torch.randint(0, corpus.numel() - seq_len, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return self.corpus[s : s + self.seq_len].long()


class LitMoE(pl.LightningModule):
    def __init__(self, experts: int, hidden: int, layers: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = transformers.MixtralConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
            max_position_embeddings=512, tie_word_embeddings=False,
        )  # fmt: skip
        self.model: transformers.MixtralForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = transformers.MixtralForCausalLM(self.cfg)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, i: int) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % 20 == 0 or step in (1, trainer.max_steps)):
            print(f"step {step:4d}  loss {float(trainer.callback_metrics['loss']):.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=2, help="sequences per device")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument(
        "--expert-layout", choices=("sharded", "owners"), default="sharded",
        help="moe_expert_layout: experts cut across the ranks, or each whole on one rank (docs/moe.md)",
    )  # fmt: skip
    args = p.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    corpus = stdlib_corpus()
    data = DataLoader(Windows(corpus, args.seq_len, args.steps * args.batch * args.devices, 0), batch_size=args.batch)
    # persistence threshold 0: even these small layers are sharded, so their experts are fetched by selection
    # moe_full_gather_share 0.5: a selective gather up to half a whole one's bytes (the default 0.2
    # was measured with larger experts, docs/moe.md)
    config = {
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
        "zero_strategy": {"moe_full_gather_share": 0.5, "moe_expert_layout": args.expert_layout},
    }
    strategy = lightning_zero.ZeroStrategy(stage=3, config=config)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False, default_root_dir="runs/lightning",
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, callbacks=[PrintLoss()],
    )  # fmt: skip
    module = LitMoE(args.experts, args.hidden, args.layers, args.lr)
    trainer.fit(module, data)

    def report(what: str, before: dict[str, int], after: dict[str, int]) -> None:
        moved, whole = (after[k] - before.get(k, 0) for k in ("moe_gathered_bytes", "moe_full_bytes"))
        seen = max(after["moe_experts_seen"] - before.get("moe_experts_seen", 0), 1)
        union = (after["moe_union_experts"] - before.get("moe_union_experts", 0)) / seen
        print(f"rank {trainer.global_rank}: {what}: experts gathered {moved / 2**20:.2f} MiB of {whole / 2**20:.2f} "
              f"MiB (all experts), union share {union:.2f}\n", end="", flush=True)  # fmt: skip

    trained = zs.memory_stats(module)
    report("training", {}, trained)  # large batches select most experts: the cost switch gathers whole
    prompt = torch.tensor([list(b"def ")])
    module.model.eval()
    with torch.no_grad():  # every rank generates: each step's forward is a collective
        out = module.model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    report("generate", trained, zs.memory_stats(module))  # one token per step: few experts
    if trainer.is_global_zero:
        print("generated:", repr(bytes(out[0].tolist()).decode("utf-8", "replace")), flush=True)
    trainer.strategy.barrier()
    print(f"rank {trainer.global_rank}: done\n", end="", flush=True)  # one write per line


if __name__ == "__main__":
    main()
