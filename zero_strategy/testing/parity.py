"""DDP-parity harness for multi-rank tests: the oracle every mode is checked against.

A *cell* is one configuration: stage, optimizer, accumulation mode, clipping, tied weights,
frozen parameters, activation checkpointing, parameter groups, unused parameters, buffers,
dtype. :func:`run_cell` trains the same model under the oracle and under the engine and
returns the per-step losses and final parameters/buffers of both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import zero_strategy as zs
from zero_strategy.config import DTYPES, PrecisionConfig
from zero_strategy.config.comm import CompressionConfig, LoadBalanceConfig
from zero_strategy.config.memory import MemoryConfig
from zero_strategy.models.gpt import Block, GPTConfig
from zero_strategy.runtime.module import ZeroModule, get_engine
from zero_strategy.runtime.optimizer import ZeroOptimizer
from zero_strategy.sharding.memory import KINDS
from zero_strategy.testing.compare import assert_close
from zero_strategy.testing.frozen_adam import FrozenAdamW

VOCAB, SEQ, BATCH = 32, 8, 2


@dataclass(frozen=True)
class Cell:
    stage: int = 2
    optim: str = "adamw"
    accum: str = "none"  # none | plain (2 micro-steps, reduce each) | no_sync (2 micro-steps)
    clip: float | None = None
    # how the loop clips (both DDP and the engine run the same call, except "optimizer"):
    # "optimizer" the engine's optimizer.clip_grad_norm_ (DDP: torch's); "torch" a plain loop's
    # torch.nn.utils.clip_grad_norm_(model.parameters()); "masters" torch's over the optimizer's
    # parameters; "value" torch.nn.utils.clip_grad_value_(model.parameters(), clip)
    clip_with: str = "optimizer"
    tied: bool = False
    frozen: bool = False
    ckpt: str = "none"  # none | reentrant | nonreentrant
    groups: bool = False  # two param groups with different lr / weight decay
    unused: str = "none"  # none | some_steps | some_ranks
    buffers: bool = False
    dtype: str = "float64"
    steps: int = 10
    bucket: int = 700  # elements: several groups even for the tiny model
    # ZeRO-3 knobs
    policy: str = "default"  # default | blocks (explicit {Block}: `extra` becomes a unit too)
    tied_units: bool = False  # a weight shared by two blocks (two units)
    reuse: bool = False  # blocks[0] runs twice per forward
    prefetch: int = 1
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)
    late: bool = False  # a parameter used inside a checkpointed block and outside it too
    persist: int = 0  # stage3_param_persistence_threshold (0: every unit is freed after use)
    # communication paths: "native" is the NCCL code path (it runs on gloo too); overlap False
    # waits for each reduction at once; reduce "bf16" reduces gradients in bf16 (DDP: its bf16
    # compress hook, the same rounding)
    impl: str = "auto"
    overlap: bool = True
    reduce: str = "fp32"
    # offload (offload.py): "cpu" optimizer state on the host, "cpu_half" half of it (ratio
    # 0.5), "param" (ZeRO-3) parameter rows and optimizer state on the host
    offload: str = "none"
    # top-k compression's ratio (0: off); 1.0 sends every element through the sparse exchange,
    # which must give DDP's numbers
    topk: float = 0.0
    # DGC's momentum correction (compression.momentum; the cell's optimizer is then SGD, the
    # engine's with momentum 0) and momentum factor masking: at ratio 1.0 the engine must give
    # DDP's SGD with this momentum (masking: DDP's SGD without momentum, each step's gradient alone)
    topk_momentum: float = 0.0
    topk_masking: bool = False
    # the frozen-variance Adam mode (compression.optimizer: adam) with this many dense steps (0: off):
    # the cell's AdamW is then the engine's (the user's optimizer SGD with AdamW's weight decay), and
    # DDP steps the oracle FrozenAdamW (testing/frozen_adam.py)
    topk_adam: int = 0
    topk_refresh: int = 0  # with topk_adam: compression.variance_refresh (the oracle refreshes on the same steps)
    topk_regions: bool = False  # compression.region_indices: top-k per region, int16 offsets
    topk_global: bool = False  # compression.global_threshold: one threshold over the whole bucket
    topk_owner: bool = False  # with topk_adam: compression.owner_momentum (the owner keeps the momentum)
    # load balancing: given scores, one per rank (empty: even shards)
    scores: tuple[float, ...] = ()
    # the memory budget's cache tier (ZeRO-3): "none" (no budget), or a budget whose cache is 0,
    # one unit (with the root unit), half the blocks, or the whole model (cache_cap)
    cache: str = "none"
    n_blocks: int = 2
    evals: bool = False  # a no_grad forward after each step (its loss compared too)
    # the budget's persistent tier (a share of its 10**9 bytes, or bytes): 0.0 keeps no unit
    # persistent, so the cache cells test the cache alone; more makes the units that fit persistent
    persistent: float | int = 0.0
    ratio: float = 1.0  # offload "ratio": offload_optimizer on the host with this ratio
    shard_size: int | str | None = None  # shard groups of this many ranks, replicated across groups (None: flat)
    hpz: int = 1  # zero_hpz_partition_size: ZeRO-3's secondary shards within groups of this many ranks (1: off)
    mesh: str = ""  # "RxS": initialize(mesh=) a 2-D DeviceMesh of R replicas x S shards; "RxSt": its rows are columns


# a plain loop's torch.nn.utils clipping over the model's (or the optimizer's) parameters, in the
# ZeRO-1/2 and ZeRO-3 grids: the engine's global clipping, DDP's result (runtime/torch_clipping.py);
# the frozen and tied cell checks which parameters make up "the whole model"
TORCH_CLIPPING: list[dict[str, Any]] = [
    {"clip": 0.05, "clip_with": "torch", "accum": "no_sync", "frozen": True, "tied": True},
    {"clip": 0.05, "clip_with": "masters"},
    {"clip": 0.01, "clip_with": "value", "accum": "plain"},
]

OFFLOADS: dict[str, dict[str, Any]] = {
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu"}},
    "cpu_half": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    "auto": {"offload_optimizer": {"device": "cpu", "ratio": "auto"}},  # needs a budget (cache cells)
    "auto_both": {
        "offload_optimizer": {"device": "cpu", "ratio": "auto"},
        "offload_param": {"device": "cpu", "ratio": "auto"},
    },
    "ratio": {"offload_optimizer": {"device": "cpu"}},  # with Cell.ratio
    "param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "nvme": {"offload_optimizer": {"device": "nvme"}},  # no nvme_path: a fresh directory under the temp dir
    # the design notes' template: optimizer on the host, ZeRO-3 rows on disk (16-bit there, fp32 masters on the host)
    "param_nvme": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
    # ZeRO-Infinity: both on disk (the masters are views of the rows; between steps only gradient shards in memory)
    "all_nvme": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}


def check_tiers(c: Cell, stats: dict[str, int], swap_files: list[str] | None = None) -> None:
    """Where the bytes are, from ``memory_stats()``: on a machine without a GPU parity alone
    would pass even if nothing moved, so every offload cell also checks the tiers (and, for
    the disk tier, the sizes of ``swap_files`` on disk). Top-k residuals stay on the device."""
    host = stats["tier_host_pinned"] + stats["tier_host_pageable"]
    if stats["tier_device"] + host + stats["tier_disk"] != sum(stats[k] for k in KINDS):
        raise AssertionError(f"memory_stats tiers do not add up to the model state: {stats}")
    if c.offload == "none":
        if host or stats["tier_disk"]:
            raise AssertionError(f"nothing is offloaded, yet memory_stats counts host or disk bytes: {stats}")
        return
    if not stats["optimizer_state"] > 0:
        raise AssertionError(f"offload cell without optimizer state: {stats}")
    on_host = stats["grad_shards"] + stats["masters"] + stats["optimizer_state"]
    if c.offload in ("param_nvme", "all_nvme"):  # rows in files; between steps no row and no master view in memory
        on_disk = sum(os.path.getsize(f) for f in swap_files or [])
        want_device = stats["residuals"] + stats["params"] + stats["full_grads"]
        in_memory = stats["model_state"] - stats["tier_disk"] - want_device
        rows_only = c.offload == "param_nvme"
        want_host = on_host - (stats["tier_disk"] - stats["param_shards"])  # less the optimizer state on disk
        if not 0 < stats["param_shards"] <= stats["tier_disk"] == on_disk or stats["tier_device"] != want_device:
            raise AssertionError(f"offload {c.offload}: tier_disk {stats['tier_disk']}, files {on_disk} bytes, "
                                 f"device {stats['tier_device']} (want {want_device}): {stats}")  # fmt: skip
        if rows_only and not (stats["tier_disk"] == stats["param_shards"] and stats["masters"] > 0):
            raise AssertionError(f"offload param_nvme: only the rows on disk, fp32 masters on the host: {stats}")
        if not rows_only and not (stats["masters"] == 0 and in_memory <= stats["grad_shards"] + 0.1 * on_disk):
            raise AssertionError(f"offload all_nvme: in memory {in_memory}, masters {stats['masters']}: {stats}")
        if host != in_memory or host != want_host:
            raise AssertionError(f"offload {c.offload}: host bytes {host} (want {want_host}): {stats}")
        return
    if c.offload == "nvme":  # the state in files of that size; in memory only Adam's step scalars
        on_disk = sum(os.path.getsize(f) for f in swap_files or [])
        in_memory = stats["optimizer_state"] - stats["tier_disk"]
        want_device = stats["residuals"] + stats["params"] + stats["param_shards"] + stats["full_grads"]
        if not 0 < stats["tier_disk"] == on_disk or not 0 <= in_memory <= 0.1 * stats["tier_disk"]:
            raise AssertionError(f"offload nvme: tier_disk {stats['tier_disk']}, files {on_disk} bytes, "
                                 f"state in memory {in_memory}: {stats}")  # fmt: skip
        if stats["tier_device"] != want_device or host != on_host - stats["tier_disk"] or not stats["masters"] > 0:
            raise AssertionError(f"offload nvme: device bytes {stats['tier_device']} (want {want_device}): {stats}")
        return
    if c.offload == "cpu":  # the whole optimizer side on the host, the parameters on the device
        want_device = stats["residuals"] + stats["params"] + stats["param_shards"] + stats["full_grads"]
        if stats["tier_device"] != want_device or host != on_host:
            raise AssertionError(f"offload cpu: device bytes {stats['tier_device']} (want {want_device}), "
                                 f"host {host} (want {on_host}): {stats}")  # fmt: skip
        if not stats["masters"] > 0:
            raise AssertionError(f"offload cpu: the masters must be host copies, not views of the parameters: {stats}")
    elif c.offload == "cpu_half":  # at least half of the optimizer side on the host, not all of it
        # (the ratio counts elements; 0.45: a few scalar state entries such as Adam's step)
        if not 0.45 * on_host <= host < on_host:
            raise AssertionError(f"offload ratio 0.5: host bytes {host} of the optimizer side's {on_host}: {stats}")
    elif c.offload == "param":  # rows too: only gathered parameters and full gradients on the device
        want_device = stats["residuals"] + stats["params"] + stats["full_grads"]
        if stats["tier_device"] != want_device or host != on_host + stats["param_shards"]:
            raise AssertionError(f"offload param: device bytes {stats['tier_device']} (want {want_device}): {stats}")


def check_shard_groups(c: Cell, engine: Any, rank: int, world: int) -> None:
    """The layout the cell asked for: the shard group's ranks (contiguous), the replica group's
    (same index in every group), and every bucket's gradient shard cut over the shard group only,
    so a run that silently stayed flat cannot pass."""
    rows = mesh_rows(c, world)
    group = sorted(next(row for row in rows if rank in row))
    replica = sorted(next(col for col in zip(*rows) if rank in col))
    s = len(group)
    if list(engine.ctx.global_ranks) != group or list(engine.replica.global_ranks) != replica:
        raise AssertionError(f"rank {rank}: shard group {engine.ctx.global_ranks} (want {group}), replica group "
                             f"{engine.replica.global_ranks} (want {replica})")  # fmt: skip
    cut = {g.layout.world_size for g in engine.groups}
    if cut != {s}:
        raise AssertionError(f"rank {rank}: gradient shards cut over {cut} ranks, want {s}")


def check_hpz(c: Cell, engine: Any, rank: int, world: int) -> None:
    """The secondary partition the cell asked for (``zero_hpz_partition_size: k``): groups of
    ``k`` contiguous ranks inside the shard group, and the most secondary bytes held at once
    (after a forward) equal to ``1/k`` of the gathered rows of every unit freed after use; none
    where ``k`` is 1 or the shard group's size (a no-op), and none left after the last step."""
    if c.stage != 3:
        return
    s, k, sec = engine.ctx.world_size, c.hpz, engine.params.secondary  # the shard group's size
    if k in (1, s):
        if sec is not None:
            raise AssertionError(f"rank {rank}: zero_hpz_partition_size={k} at shard size {s} must be a no-op")
        return
    group = list(range(rank - rank % k, rank - rank % k + k))
    if sec is None or list(sec.ctx.global_ranks) != group:
        raise AssertionError(f"rank {rank}: secondary group {sec and sec.ctx.global_ranks} (want {group})")
    freed = [u for u in engine.zero3.all_units if not u.persistent and u is not engine.zero3.root]
    want = sum((s // k) * (u.layout.shard_numel + 2) * u.full[0].element_size() for u in freed)  # rows + tags
    if sec.peak != want or sec.live != 0:
        raise AssertionError(f"rank {rank}: secondary shards peaked at {sec.peak} bytes (want {want}), "
                             f"{sec.live} bytes left after the last step")  # fmt: skip


def mesh_rows(c: Cell, world: int) -> list[list[int]]:
    """The shard groups (rows; their columns are the replica groups) that cell ``c`` asks for."""
    if c.mesh:
        replicas, shard = (int(k) for k in c.mesh.rstrip("t").split("x"))
        grid = (
            torch.arange(world).view(shard, replicas).T
            if c.mesh.endswith("t")
            else torch.arange(world).view(replicas, shard)
        )
        return grid.tolist()
    s = int(os.environ["LOCAL_WORLD_SIZE"]) if c.shard_size == "node" else int(c.shard_size or world)
    return [list(range(g, g + s)) for g in range(0, world, s)]


def _device_mesh(c: Cell, world: int) -> Any:
    if not c.mesh:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(mesh_rows(c, world)), mesh_dim_names=("dp_replicate", "dp_shard"))


class Net(nn.Module):
    """A tiny GPT with the knobs the grid needs."""

    def __init__(self, c: Cell) -> None:
        super().__init__()
        cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=2, n_head=2, qkv_bias=False)
        self.ckpt = c.ckpt
        self.tok = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(SEQ, 16)
        blocks = [Block(cfg) for _ in range(c.n_blocks)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.BatchNorm1d(16) if c.buffers else nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        # a block that runs only on some steps or ranks; its own unit under policy "blocks"
        self.extra = None if c.unused == "none" else Block(cfg)
        self.reuse = c.reuse
        self.late = c.late
        if c.tied:
            self.head.weight = self.tok.weight
        if c.tied_units:
            blocks[1].mlp.fc.weight = blocks[0].mlp.fc.weight
        if c.frozen:
            self.pos.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        blocks = [self.blocks[0], *self.blocks] if self.reuse else list(self.blocks)
        for blk in blocks:
            if self.ckpt == "none":
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        if self.late:  # blocks[0].ln1.bias also runs outside its (checkpointed) block
            x = x + cast(Block, self.blocks[0]).ln1.bias
        if use_extra and self.extra is not None:
            x = self.extra(x)
        if isinstance(self.norm, nn.BatchNorm1d):
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        else:
            x = self.norm(x)
        return self.head(x)


def make_optimizer(c: Cell, model: Net, mode: str = "ddp") -> torch.optim.Optimizer:
    params = [p for p in model.parameters()]
    groups: list[dict[str, Any]]
    if c.groups:
        block_ids = {id(p) for p in model.blocks.parameters()}
        groups = [
            {"params": [p for p in params if id(p) in block_ids]},
            {"params": [p for p in params if id(p) not in block_ids], "lr": 3e-3, "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": params}]
    if c.optim == "adamw" and c.topk_adam:
        lr = 1e-2 if c.dtype == "float64" else 1e-3
        if mode == "zero":
            return torch.optim.SGD(groups, lr=lr, weight_decay=0.1)
        return FrozenAdamW(groups, lr=lr, weight_decay=0.1, freeze=c.topk_adam, refresh=c.topk_refresh)
    if c.optim == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2 if c.dtype == "float64" else 1e-3, weight_decay=0.1)
    if c.optim == "adam":
        return torch.optim.Adam(groups, lr=1e-2 if c.dtype == "float64" else 1e-3)
    if c.optim == "sgd" and c.topk_momentum:  # the engine owns the momentum; DDP's optimizer keeps it
        own = mode == "zero" or c.topk_masking
        return torch.optim.SGD(groups, lr=0.1, momentum=0.0 if own else c.topk_momentum)
    if c.optim == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if c.optim == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05)
    raise ValueError(c.optim)


def _adam_mode(c: Cell) -> dict[str, Any]:
    """The compression settings of the frozen-variance Adam mode (``topk_adam``), of
    ``region_indices`` (``topk_regions``) and of ``global_threshold`` (``topk_global``)."""
    extra: dict[str, Any] = {"region_indices": True} if c.topk_regions else {}
    if c.topk_global:
        extra.update(global_threshold=True)
    if c.topk_owner:
        extra.update(owner_momentum=True)
    if c.topk_adam:
        extra.update(optimizer="adam", warmup="dense", warmup_steps=c.topk_adam, variance_refresh=c.topk_refresh)
    return extra


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def use_extra(c: Cell, step: int, rank: int) -> bool:
    if c.unused == "some_steps":
        return step % 3 == 1
    if c.unused == "some_ranks":
        return rank == 0 and step % 2 == 0
    return False


def _compress_hook(dtype, bucket):
    """DDP's ``fp16_compress_hook``/``bf16_compress_hook`` (the bf16 one refuses CPUs): the bucket
    cast to ``dtype`` (the hook's state) and divided by the world size, all-reduced in it, cast
    back."""
    buf = bucket.buffer()
    compressed = buf.to(dtype).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def oracle_kind(c: Cell, world: int) -> str:
    if c.reduce != "fp32" and world < 2:
        raise ValueError("a reduce dtype needs the DDP oracle (world size 2 or more): there is nothing to reduce at 1")
    # DDP rejects unused parameters under reentrant checkpointing; use the local oracle there.
    # and DDP's static_graph (needed for reentrant checkpointing) does not support no_sync.
    if c.ckpt == "reentrant" and (
        c.unused != "none" or c.tied or c.tied_units or c.reuse or c.late or c.accum != "none"
    ):
        return "local"
    return "ddp" if world > 1 else "local"


def cache_cap(c: Cell, model: Net) -> int:
    """The cache cap in bytes that ``c.cache`` names, for ``model`` under the default policy
    (each block a unit, the rest the root unit; ``policy="blocks"`` makes ``extra`` one too)."""
    size = {"float64": 8, "float32": 4}[c.dtype]
    units = [*model.blocks] + ([model.extra] if c.policy == "blocks" and model.extra is not None else [])
    sizes = sorted(sum(p.numel() for p in u.parameters()) * size for u in units)
    total = sum(p.numel() for p in model.parameters()) * size
    root = total - sum(sizes)
    caps = {"zero": 0, "unit": root + sizes[-1], "half": root + sum(sizes[len(sizes) // 2 :]), "whole": total}
    return caps[c.cache]


class GatheredProbe:
    """An independent count of live gathered storage: at every module's forward (before and
    after) and every gradient accumulation, the bytes the ZeRO-3 units' full tensors hold
    (persistent units aside); ``peak`` is the most seen. ``step()`` after each optimizer step:
    ``most_gathers`` is the most all-gathers of one unit between two steps."""

    def __init__(self, model: nn.Module) -> None:
        engine = get_engine(model)
        self.units = list(engine.zero3.all_units) if engine.zero3 is not None else []
        self.peak = 0
        self.most_gathers = 0
        self._seen = [u.gathers for u in self.units]
        for m in model.modules():
            m.register_forward_pre_hook(lambda *a: self.look())
            m.register_forward_hook(lambda *a: self.look())
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda *a: self.look())

    def look(self) -> None:
        live = sum(f.untyped_storage().nbytes() for u in self.units if not u.persistent for f in u.full)
        self.peak = max(self.peak, live)

    def step(self) -> None:
        now = [u.gathers for u in self.units]
        self.most_gathers = max([self.most_gathers, *(b - a for a, b in zip(self._seen, now))])
        self._seen = now


LAST_STATS: dict[str, int] = {}  # memory_stats() of the last engine _train ran (cache cells)


def _check_cache(c: Cell, stats: dict[str, int], probe: GatheredProbe, cap: int, rank: int) -> None:
    """The cache cap holds (memory_stats' peak and the probe's), and the cache works."""
    if cap and not (0 < stats["cache_peak"] <= cap and 0 < probe.peak <= cap and stats["cache_overflows"] == 0):
        raise AssertionError(f"rank {rank}: cache cap {cap}: peak {stats['cache_peak']}, probe {probe.peak}: {stats}")
    if cap and not stats["cache_hits"] > 0:
        raise AssertionError(f"rank {rank}: cache cap {cap} but no hit: {stats}")
    if c.cache == "whole" and (probe.most_gathers != 1 or stats["cache_evictions"]):  # each unit once per step
        raise AssertionError(f"rank {rank}: whole-model cache: a unit gathered {probe.most_gathers} times in a step")


def _train(c: Cell, mode: str, rank: int, world: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    dtype = getattr(torch, c.dtype)
    torch.manual_seed(0)
    model = Net(c).to(dtype)
    cap = cache_cap(c, model) if c.cache != "none" else None
    probe: GatheredProbe | None = None
    opt = make_optimizer(c, model, mode)
    n_micro = 1 if c.accum == "none" else 2
    losses: list[float] = []
    norms: list[float] = []
    wrapped: nn.Module = model
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if mode == "ddp":
        static = c.ckpt == "reentrant"
        ddp = DDP(model, find_unused_parameters=c.unused != "none" and not static, static_graph=static)
        if c.reduce != "fp32":
            ddp.register_comm_hook(DTYPES[c.reduce], _compress_hook)
        wrapped, no_sync = ddp, ddp.no_sync
    elif mode == "zero":
        policy = {Block} if c.policy == "blocks" else None
        cfg = zs.ZeroConfig(
            stage=c.stage, reduce_bucket_size=c.bucket, prefetch=c.prefetch, stage3_param_persistence_threshold=c.persist,
            collective_impl=c.impl, overlap_comm=c.overlap, precision=PrecisionConfig(reduce_dtype=DTYPES[c.reduce]),
            compression=CompressionConfig(type="topk", ratio=c.topk, momentum=c.topk_momentum,
                                          momentum_masking=c.topk_masking, **_adam_mode(c)) if c.topk else CompressionConfig(),
            load_balance=LoadBalanceConfig(scores=c.scores) if c.scores else LoadBalanceConfig(),
            shard_size=c.shard_size, zero_hpz_partition_size=c.hpz,
            memory=MemoryConfig() if cap is None else MemoryConfig(budget=10**9, persistent=c.persistent, cache=cap,
                                                                   working=0.1),
            **(OFFLOADS[c.offload] if c.offload != "ratio" else {"offload_optimizer": {"device": "cpu", "ratio": c.ratio}}),
        )  # fmt: skip
        zero_model, zero_opt = zs.initialize(model, opt, config=cfg, policy=policy, mesh=_device_mesh(c, world))
        probe = GatheredProbe(zero_model) if cap is not None else None
        if zero_opt is None:
            raise AssertionError("initialize() returned no optimizer although it was given one")
        wrapped, opt = zero_model, zero_opt
        no_sync = cast(ZeroModule, zero_model).no_sync  # the model's class was swapped by initialize
    for step in range(c.steps):
        for micro in range(n_micro):
            if mode == "local":  # one process computes the mean over every rank's micro-batch
                total = 0.0
                for r in range(world):
                    x, y = batch(step, micro, r)
                    out = model(x, use_extra(c, step, r))
                    loss = F.cross_entropy(out.view(-1, VOCAB), y.reshape(-1))
                    (loss / (world * n_micro)).backward()
                    if r == rank:
                        total = loss.item()
                losses.append(total)
                continue
            x, y = batch(step, micro, rank)
            quiet = c.accum == "no_sync" and micro < n_micro - 1
            ctx = no_sync() if quiet else contextlib.nullcontext()
            with ctx:
                out = wrapped(x, use_extra(c, step, rank))
                loss = F.cross_entropy(out.view(-1, VOCAB), y.reshape(-1))
                (loss / n_micro).backward()
            losses.append(loss.item())
        if c.clip is not None and c.clip_with == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), c.clip)
        elif c.clip is not None:  # the returned norm is the global one, DDP's number
            if mode == "zero" and c.clip_with == "optimizer":
                norms.append(float(cast(ZeroOptimizer, opt).clip_grad_norm_(c.clip)))
            else:
                params = [p for g in opt.param_groups for p in g["params"]] if c.clip_with == "masters" else None
                norms.append(float(torch.nn.utils.clip_grad_norm_(params or model.parameters(), c.clip)))
        opt.step()
        opt.zero_grad(set_to_none=c.set_to_none)
        if probe is not None:
            probe.step()
        if c.evals:  # evaluation between steps: a forward without gradients
            with torch.no_grad():
                x, y = batch(step, 9, rank)
                losses.append(F.cross_entropy(wrapped(x).view(-1, VOCAB), y.reshape(-1)).item())
    if mode == "zero":
        engine = cast(ZeroModule, wrapped).zero_engine
        files = engine.disk.file_paths()
        check_tiers(c, engine.memory_stats(), files)
        check_shard_groups(c, engine, rank, world)
        check_hpz(c, engine, rank, world)
        if cap is not None and probe is not None:
            probe.step()
            LAST_STATS.clear()
            LAST_STATS.update(engine.memory_stats())
            _check_cache(c, LAST_STATS, probe, cap, rank)
    with zs.gathered_parameters(model) if mode == "zero" else contextlib.nullcontext():
        state = {k: v.detach().clone().to(torch.float64) for k, v in model.state_dict().items()}
    return losses, norms, state


def compare(c: Cell, rank: int, world: int) -> None:
    oracle = oracle_kind(c, world)
    ref_losses, ref_norms, ref_state = _train(c, oracle, rank, world)
    losses, norms, state = _train(c, "zero", rank, world)
    if len(losses) != len(ref_losses):
        raise AssertionError(f"{len(losses)} losses against {len(ref_losses)} from {oracle}")
    loss_tol = 1e-9 if c.dtype == "float64" else 1e-5
    assert_close(losses, ref_losses, rtol=loss_tol, what=f"rank {rank}: losses against {oracle}")
    if c.clip is not None and c.clip_with != "value":
        assert_close(norms, ref_norms, rtol=loss_tol, what=f"rank {rank}: clip_grad_norm_ results against {oracle}")
    if state.keys() != ref_state.keys():
        raise AssertionError(f"state_dict keys differ: {sorted(state)} vs {sorted(ref_state)}")
    for k, ref in ref_state.items():
        # float64: elementwise; fp32: relative to the tensor's largest element
        atol = 1e-12 if c.dtype == "float64" else 1e-5 * float(ref.abs().max())
        assert_close(
            state[k],
            ref,
            rtol=1e-6 if c.dtype == "float64" else 0.0,
            atol=atol,
            what=f"rank {rank}: {k} against {oracle}",
        )


def world_info() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def residuals_by_parameter(model: nn.Module) -> tuple[dict[str, torch.Tensor], float]:
    """This rank's top-k residual of every trainable parameter in parameter coordinates (flat,
    by name), read out of the per-destination padded rows through the bucket's layout, and the
    residual mass left in those rows' padding (zero when every residual is where it belongs)."""
    engine = get_engine(model)
    fb = engine.reducer.compression
    if fb is None:
        raise AssertionError("residuals_by_parameter(): the model runs without top-k compression")
    out: dict[str, torch.Tensor] = {}
    padding = 0.0
    for g in engine.groups:
        r, lay = fb.residuals[g.index], g.layout
        flats = [torch.zeros(n, dtype=r.dtype) for n in lay.numels]
        lay.unpack_full(r, flats)
        out.update(zip(g.fqns, flats))
        for i, b in enumerate(lay.bounds):
            for row in range(lay.world_size):
                padding += float(
                    r[row, lay.offsets[i] + b[row + 1] - b[row] : lay.offsets[i] + lay.chunks[i]].abs().sum()
                )
    return out, padding


def load_residuals_in_place(path: str, model: nn.Module, opt: torch.optim.Optimizer, want: dict[str, torch.Tensor],
                            what: str) -> None:  # fmt: skip
    """Load the checkpoint at ``path`` and check, without any warning, that every residual is
    ``want`` (:func:`residuals_by_parameter` of the saved run), element for element, with
    nothing in the padding."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # residuals that follow their elements: no warning
        zs.load_checkpoint(path, model, opt)
    got, padding = residuals_by_parameter(model)
    if got.keys() != want.keys() or padding != 0.0:
        raise AssertionError(f"{what}: residuals of {sorted(got)} loaded, mass {padding} in the padding")
    for k, v in want.items():
        assert_close(got[k], v, rtol=0.0, atol=0.0, what=f"{what}: residual of {k}")
