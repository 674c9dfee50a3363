"""One rank of ``zero-strategy bench --links``: every mode in turn on the same ranks, the same
weights (``torch.manual_seed(0)`` before ``GPT(cfg)``) and the same batches, measuring the step
time (rank 0's median, each step after a barrier) and, for this engine's modes, the bytes per
step of each link class from the engine's own counters (:func:`zs.comm_stats_by_link`, reset
after the warmup steps). The launcher sets ``ZERO_STRATEGY_NODE_SIZE`` so that the ranks count
as ``nodes x per_node`` (:mod:`zero_strategy.comm.counters`).

FSDP2's collectives run inside torch, so its row reports the sizes its arithmetic needs
(parameters in the blocks and in the root) and :mod:`zero_strategy.bench.links` computes its
bytes with the counters' convention.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.bench.presets import gpt_config
from zero_strategy.models import GPT, stdlib_corpus, text_batch
from zero_strategy.testing._pg import barrier_default_group

__all__ = ["run_link_modes"]

LR = 1e-3
CORPUS_BYTES = 200_000


def _build(mode: dict[str, Any], cfg: Any, nodes: int, per_node: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    gpt = GPT(cfg)
    if mode["kind"] == "fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("dp_replicate", "dp_shard"))
        for blk in gpt.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(gpt, mesh=mesh)
        return gpt, torch.optim.AdamW(gpt.parameters(), lr=LR)
    config = {"zero_optimization": dict(mode["zero_optimization"])}
    model, opt = zs.initialize(gpt, lambda p: torch.optim.AdamW(p, lr=LR), config=config)
    if opt is None:
        raise RuntimeError("zero_strategy.initialize returned no optimizer")
    return model, opt


def _run_mode(rank: int, mode: dict[str, Any], spec: dict[str, Any], corpus: torch.Tensor) -> dict[str, Any]:
    cfg = gpt_config(spec["model"])
    model, opt = _build(mode, cfg, spec["nodes"], spec["per_node"])
    warmup, steps, batch = spec["warmup"], spec["steps"], spec["batch"]
    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup:
            zs.reset_comm_stats()
        x, y = text_batch(corpus, batch, cfg.seq_len, step=i, rank=rank)
        barrier_default_group()
        t0 = time.perf_counter()
        loss = model.loss(x, y)  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    out: dict[str, Any] = {"mode": mode["name"], "losses": losses, "median_step_s": statistics.median(times)}
    if mode["kind"] == "engine":
        by_link = zs.comm_stats_by_link()
        out["bytes_per_step"] = {
            link: {kind: c["bytes"] / steps for kind, c in kinds.items()} for link, kinds in by_link.items()
        }
        engine: Any = model.zero_engine
        out["links"] = {"shard group": engine.ctx.link, "replica group": engine.replica.link,
                        "world": engine.world.link}  # fmt: skip
        engine.close()
    else:
        gpt = model
        out["block_params"] = sum(p.numel() for blk in gpt.blocks for p in blk.parameters())  # type: ignore[union-attr]
        out["params"] = sum(p.numel() for p in gpt.parameters())
    return out


def run_link_modes(rank: int, world: int, modes: list[dict[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every mode of ``modes`` (dicts from :func:`zero_strategy.bench.links.mode_specs`) in turn."""
    torch.set_num_threads(1)
    corpus = stdlib_corpus(CORPUS_BYTES)
    out = []
    for mode in modes:
        out.append(_run_mode(rank, mode, spec, corpus))
        gc.collect()
    return out
