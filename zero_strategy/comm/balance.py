"""Load balancing: uneven shards by rank speed.

ZeRO gives every rank the same share of the optimizer state, so the optimizer step takes as
long as on the slowest rank, and the others wait for it in the next gather. When ranks differ
in speed (mixed hardware, a shared host, thermal limits), each rank can instead own a share
proportional to a *score*:

    score = alpha * compute + beta * memory bandwidth

``compute`` is a matmul's FLOP/s and ``memory bandwidth`` a large copy's bytes/s, each measured
for a few tens of milliseconds at start on the engine's device and divided by its mean over the
ranks; the design notes' presets are ``compute`` (alpha 0.7, beta 0.3: compute-bound models)
and ``bandwidth`` (0.3, 0.7). Scores can also be given (``load_balance: {scores: [...]}``).
Every rank gathers every rank's measurements and computes the same fractions.

What becomes uneven: each rank's piece of every parameter (contiguous, ``layout.py``), so its
master pieces, optimizer state and optimizer step. The forward and backward stay the same on
every rank (full parameters and full local gradients at ZeRO-1/2), and so do the collectives,
whose rows are padded to the largest piece (the gradient shard too is that size).
ZeRO-3 gathers each unit's padded rows the same way, so its forward and backward compute on
the same full parameters on every rank too.

At ZeRO-3 the units' rows are cut the same way (their gathers are padded like the
collectives above); refused there: NVMe offload (its swap files are laid out for even shards)
and models built under ``sharded_init`` (cut into even pieces before the engine exists).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.config.comm import LoadBalanceConfig

__all__ = ["check_load_balance", "measure_speed", "shard_fractions"]

_SECONDS = 0.02  # per trial of a micro-benchmark (three trials each)


def check_load_balance(config: LoadBalanceConfig, stage: int, *, built_sharded: bool) -> None:
    """Refuse what cannot be balanced (before the engine changes anything; the config's own
    rules with the world size, ``ZeroConfig.conflicts``, ran first): ``built_sharded``, some
    parameter was built under ``sharded_init`` at ``stage`` 3."""
    if not config.enabled or stage != 3:
        return
    if built_sharded:
        raise ValueError(
            "load_balance at stage 3 with a model built under sharded_init is not supported (sharded_init cut "
            "even pieces); build the model without sharded_init, or remove load_balance"
        )


def _timed(fn: Callable[[], None], seconds: float) -> tuple[int, float]:
    """Run ``fn`` until ``seconds`` passed (at least twice, after one untimed call); return
    the timed calls and their time."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if n >= 2 and elapsed >= seconds:
            return n, elapsed


def measure_speed(device: torch.device, seconds: float = _SECONDS) -> tuple[float, float]:
    """This rank's matmul FLOP/s and copy bandwidth (bytes/s) on ``device``."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)
    out = torch.empty(256, 256, device=device)

    def mm() -> None:
        torch.mm(a, b, out=out)
        sync()

    src = torch.ones(4 << 20, device=device)  # 16 MB
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        sync()

    # the best of three short trials: a transient stall elsewhere on the host is not this rank's speed
    flops = max(2 * 256**3 * n / t for n, t in (_timed(mm, seconds) for _ in range(3)))
    moved = 2 * src.numel() * src.element_size()  # read + write
    bandwidth = max(moved * n / t for n, t in (_timed(copy, seconds) for _ in range(3)))
    return flops, bandwidth


def shard_fractions(config: LoadBalanceConfig, ctx: C.CommContext) -> tuple[float, ...] | None:
    """Every rank's share of each shard group (the same on every rank), or None for even shards.
    Collective when the scores are measured."""
    if not config.enabled or ctx.world_size == 1:
        return None
    if config.scores is not None:
        scores = [float(s) for s in config.scores]
    else:
        alpha, beta = config.weights()
        mine = torch.tensor(measure_speed(ctx.device), dtype=torch.float64, device=ctx.device)
        every = torch.zeros(ctx.world_size * 2, dtype=torch.float64, device=ctx.device)
        C.all_gather(ctx, every, mine, what="load-balance speed measurements").wait()
        rows = every.view(ctx.world_size, 2).cpu()
        norm = rows / rows.mean(dim=0)
        scores = (alpha * norm[:, 0] + beta * norm[:, 1]).tolist()
    total = sum(scores)
    return tuple(s / total for s in scores)
