"""A small GPT-style language model, bundled for examples, tests and benchmarks.

It depends on torch alone and has no dropout, so runs are deterministic for a seed.
``GPTConfig.bench()`` is the ~60M-parameter setting used by ``bench/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    tie_embeddings: bool = True
    # Off in parity tests: the key bias gets a pure-rounding-noise gradient, which Adam turns
    # into updates of random sign, so no two reduction orders agree on it.
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "choose n_head so that it divides d_model"
            )

    @classmethod
    def bench(cls) -> GPTConfig:
        """About 63M parameters: the setting of ``../shared/PERF-NOTES.md``."""
        return cls(vocab_size=4096, seq_len=64, d_model=768, n_layer=8, n_head=12, tie_embeddings=False)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def synthetic_batch(cfg: GPTConfig, batch: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for ``step``: the same on every call, independent of global RNG state."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


__all__ = ["GPT", "GPTConfig", "Block", "num_parameters", "synthetic_batch"]
