"""One row of the bench on one rank: build the engine, train the bundled GPT on the bundled
text, and measure.

Every row starts from the same weights (``torch.manual_seed(0)`` before ``GPT(cfg)``) and sees
the same batches (:func:`zero_strategy.models.text_batch` by step and rank), so each row's
losses must equal DDP's. Per measured step (after ``warmup`` unmeasured ones), timed after a
barrier:

- the forward + backward and the optimizer step + ``zero_grad`` as two wall-clock phases, and
  the exposed (waited-on) communication inside each from :func:`zs.comm_stats` (this engine's
  rows; "n/a" for peers, whose collectives are not ours to time), and the time waited on the
  disk tier's swap-file reads and writes inside each (``io_clock()['waited_s']``);
- model-state bytes after the backward and after the step (the larger is the step's peak):
  ``memory_stats()`` for this engine, by tier; for DDP and FSDP2 the unique storages of the
  parameters, their gradients and the optimizer state (a DTensor counts its local shard);
- at the end, the peak RSS since the row started (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``; it includes the interpreter and torch, and, when several rows share
  the processes (:func:`run_rows`), what earlier rows left to the allocator) and
  ``zs.comm_report()`` over the measured steps.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from zero_strategy.bench.presets import gpt_config
from zero_strategy.models import GPT, stdlib_corpus, text_batch
from zero_strategy.storage.disk import io_clock
from zero_strategy.testing._pg import barrier_default_group

__all__ = ["ROWS", "run_row", "run_rows"]

# row -> (stage, offload device for optimizer and parameters); "ddp"/"fsdp2"/"deepspeed" are peers
ROWS: dict[str, tuple[int, str]] = {
    "ddp": (0, "none"),
    "zero1": (1, "none"),
    "zero2": (2, "none"),
    "zero3": (3, "none"),
    "zero3_cpu": (3, "cpu"),
    "zero3_nvme": (3, "nvme"),
    "fsdp2": (3, "none"),
    "deepspeed1": (1, "none"),
    "deepspeed2": (2, "none"),
    "deepspeed3": (3, "none"),
}
LR = 1e-3
CORPUS_BYTES = 1_000_000


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
        st = local.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _torch_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"params": _storage_bytes(params), "full_grads": _storage_bytes(p.grad for p in params),
           "optimizer_state": _storage_bytes(states)}  # fmt: skip
    out["model_state"] = sum(out.values())
    out.update(tier_device=out["model_state"], tier_host_pinned=0, tier_host_pageable=0, tier_disk=0)
    return out


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # since the process started


def _exposed() -> float:
    return sum(c["exposed_seconds"] for c in zs.comm_stats().values())


def _io_waited() -> float:
    return io_clock()["waited_s"]


Built = tuple[nn.Module, Any, Callable[[torch.Tensor], None], Callable[[], dict[str, int]]]


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _build(row: str, cfg: Any, nvme_path: str, batch: int) -> Built:
    """(model, optimizer, backward, model-state counter) for ``row``."""
    torch.manual_seed(0)
    gpt = GPT(cfg)
    stage, offload = ROWS[row]
    if row == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(gpt, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
        return ddp, opt, _plain_backward, lambda: _torch_state(ddp, opt)
    if row == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        for blk in gpt.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(gpt, mesh=mesh)
        opt = torch.optim.AdamW(gpt.parameters(), lr=LR)
        return gpt, opt, _plain_backward, lambda: _torch_state(gpt, opt)
    if row.startswith("deepspeed"):
        from zero_strategy.bench.peers import build_deepspeed

        return build_deepspeed(row, gpt, LR, batch)
    zo: dict[str, Any] = {"stage": stage}
    if offload != "none":
        block = {"device": offload, **({"nvme_path": nvme_path} if offload == "nvme" else {})}
        zo.update(offload_optimizer=block, offload_param=block)
    model, zopt = zs.initialize(gpt, lambda p: torch.optim.AdamW(p, lr=LR), config={"zero_optimization": zo})
    if zopt is None:  # initialize returns the optimizer it built from the factory
        raise RuntimeError("zero_strategy.initialize returned no optimizer")
    return model, zopt, _plain_backward, lambda: dict(zs.memory_stats(model))


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    inner = getattr(model, "module", model)  # DDP: call through the wrapper so its hooks run
    if inner is not model:
        logits = model(x)
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    return model.loss(x, y)  # type: ignore[operator]


def run_row(rank: int, world: int, row: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec['steps']`` measured steps of row ``row``; return this rank's measurements."""
    torch.set_num_threads(1)
    cfg = gpt_config(spec["model"])
    corpus = stdlib_corpus(CORPUS_BYTES)
    gc.collect()
    _reset_peak_rss()
    model, opt, backward, state = _build(row, cfg, spec.get("nvme_path") or "", spec["batch"])
    warmup, steps, batch = spec["warmup"], spec["steps"], spec["batch"]
    progress = Path(spec["progress"]) if rank == 0 and spec.get("progress") else None
    losses, fb, op, fb_exp, op_exp, fb_io, op_io = [], [], [], [], [], [], []
    peak: dict[str, int] = {}
    for i in range(warmup + steps):
        if i == warmup:
            zs.reset_comm_stats()
        x, y = text_batch(corpus, batch, cfg.seq_len, step=i, rank=rank)
        barrier_default_group()
        e0, io0, t0 = _exposed(), _io_waited(), time.perf_counter()
        loss = _forward(model, x, y)
        backward(loss)
        e1, io1, t1 = _exposed(), _io_waited(), time.perf_counter()
        after_backward = state()
        e1b, io1b, t1b = _exposed(), _io_waited(), time.perf_counter()  # the counting is not part of the step
        opt.step()
        after_step = state()
        opt.zero_grad(set_to_none=True)
        e2, io2, t2 = _exposed(), _io_waited(), time.perf_counter()
        losses.append(float(loss.detach()))
        if i >= warmup:
            fb.append(t1 - t0)
            op.append(t2 - t1b)
            fb_exp.append(e1 - e0)
            op_exp.append(e2 - e1b)
            fb_io.append(io1 - io0)
            op_io.append(io2 - io1b)
        for sample in (after_backward, after_step):
            if sample["model_state"] >= peak.get("model_state", -1):
                peak = sample
        if progress is not None:
            progress.write_text(f"{spec.get('progress_offset', 0) + i + 1}")
    report = zs.comm_report() if row.startswith("zero") else None
    engine = getattr(model, "zero_engine", None)
    units = getattr(getattr(engine, "params", None), "units", [])
    if engine is not None:
        engine.close()  # the disk tier's swap files go
    step_s = [a + b for a, b in zip(fb, op)]
    return {
        "row": row,
        "rank": rank,
        "losses": losses,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "forward_backward_s": statistics.median(fb),
        "optimizer_s": statistics.median(op),
        "exposed_forward_backward_s": statistics.median(fb_exp) if report else None,
        "exposed_optimizer_s": statistics.median(op_exp) if report else None,
        "io_forward_backward_s": statistics.median(fb_io),
        "io_optimizer_s": statistics.median(op_io),
        "exposed_pct": 100.0 * (sum(fb_exp) + sum(op_exp)) / sum(step_s) if report else None,
        "comm_report": report,
        "model_state": peak,
        "peak_rss_bytes": _peak_rss_bytes(),
        "persistent_params": sum(u.numel for u in units if u.persistent),
    }


def run_rows(rank: int, world: int, rows: list[str], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Several rows one after the other in the same ranks (quicker: one start for all)."""
    out = []
    for k, row in enumerate(rows):
        out.append(run_row(rank, world, row, {**spec, "progress_offset": k * (spec["warmup"] + spec["steps"])}))
        gc.collect()
    return out
