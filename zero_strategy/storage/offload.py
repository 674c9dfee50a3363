"""Offload: which memory tier holds the optimizer's side of training and, at ZeRO-3, the
parameters' persistent shards.

Three tiers, as DeepSpeed's ZeRO-Offload and ZeRO-Infinity have them: the *device* (the
accelerator the model computes on), the *host* (CPU memory, pinned when a GPU is present so
that copies run without the CPU in the way) and *disk* (NVMe, for the optimizer state).

Each placement is a small frozen policy chosen by type, built once from the config
(:func:`optimizer_offload` and :func:`param_offload`):

- :class:`OnDevice`: nothing moves (the default).
- :class:`OnHost`: ``offload_optimizer: {device: cpu}``. Each group's fp32 master pieces, their
  reduced gradients and the optimizer state live in host memory; the optimizer steps there,
  on the user's optimizer as given. Gradient shards are copied down as each reduction
  finishes; the updated pieces are copied up when the parameters follow the step. ``ratio``
  offloads the first groups (in the order their gradients arrive) until at least that
  fraction of the trainable elements is on the host; the rest stays on the device
  (ZeRO-Offload++'s partial offload). ``ratio: auto`` (with a memory budget) picks the smallest
  fraction that fits the budget's persistent tier (``runtime/placement.py``).
- :class:`OnDisk`: ``offload_optimizer: {device: nvme}``. As :class:`OnHost`, and the optimizer
  state itself lives in swap files, in memory only while its group steps (``swapped_state.py``).
- At ZeRO-3, ``offload_param: {device: cpu}`` puts each unit's persistent row on the host; a
  gather copies the row up into its send buffer. The masters are then views of that host row
  (no second copy), so the optimizer state is on the host too. ``ratio`` (set by ``ratio: auto``
  only) offloads the first units' rows in the same way as the optimizer's ratio.
- At ZeRO-3, ``offload_param: {device: nvme}`` (:class:`OnDisk` for the parameters) keeps each
  unit's rows in a swap file, in memory only while a gather, a load or a step uses them
  (``disk_rows.py``). With the optimizer on the host (or the device) the fp32 masters and the
  optimizer state are host tensors and the rows on disk are in the compute dtype, as in
  DeepSpeed; with ``offload_optimizer: {device: nvme}`` too, the masters are views of the row
  on disk and only the gradient shards stay in memory between steps.

On a machine without a GPU, "device" and "host" are the same memory; the engine still keeps
the offloaded tensors apart (their own storages, counted under ``host_*`` by
``memory_stats()``), so a test can see where every byte was placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from zero_strategy.config import OffloadConfig

__all__ = [
    "HOST", "OffloadPolicy", "OffloadSettings", "OnDevice", "OnDisk", "OnHost", "StoragePolicy", "host_empty",
    "optimizer_offload", "param_offload", "storage_policy",
]  # fmt: skip

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where one kind of state lives between uses: a small frozen policy, chosen by type."""

    tier: ClassVar[str] = "device"

    def offloads(self, done: int, total: int) -> bool:
        """Whether the next group goes to this policy's tier, when ``done`` of ``total``
        trainable elements were already placed there."""
        return False

    def pinned(self, compute: torch.device) -> bool:
        return False


@dataclass(frozen=True)
class OnDevice(OffloadPolicy):
    """No offload: the state stays on the compute device."""


@dataclass(frozen=True)
class OnHost(OffloadPolicy):
    """CPU memory; pinned when the compute device is a GPU and ``pin_memory`` is set."""

    tier: ClassVar[str] = "host"
    pin_memory: bool = True
    ratio: float = 1.0

    def offloads(self, done: int, total: int) -> bool:
        return self.ratio >= 1.0 or done < self.ratio * total

    def pinned(self, compute: torch.device) -> bool:
        return self.pin_memory and compute.type == "cuda"


@dataclass(frozen=True)
class OnDisk(OnHost):
    """NVMe: the optimizer state in swap files under ``nvme_path`` (a fresh directory under the
    temp dir when None), read and written through at most ``buffer_count`` aligned host buffers
    (``disk.py``, ``swapped_state.py``). The master pieces and their gradients stay on the host."""

    tier: ClassVar[str] = "disk"
    nvme_path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 100_000_000  # elements per read or write of ZeRO-3 rows (offload_param)


def _from_block(block: OffloadConfig, what: str) -> OffloadPolicy:
    if block.device == "none":
        return OnDevice()
    if block.device == "cpu":
        return OnHost(pin_memory=block.pin_memory, ratio=1.0 if block.ratio == "auto" else float(block.ratio))
    if block.device == "nvme":
        return OnDisk(pin_memory=block.pin_memory, ratio=float(block.ratio), nvme_path=block.nvme_path,
                      buffer_count=block.buffer_count, buffer_size=block.buffer_size)  # fmt: skip
    raise ValueError(f"initialize(): zero_optimization.{what}.device={block.device!r}: use 'none', 'cpu' or 'nvme'")


class OffloadSettings(Protocol):
    """What the offload policies are built from (``ZeroConfig`` has these sections)."""

    @property
    def offload_optimizer(self) -> OffloadConfig: ...
    @property
    def offload_param(self) -> OffloadConfig: ...


@dataclass(frozen=True)
class StoragePolicy:
    """The storage layer's policy: where the optimizer's side (``optimizer``) and ZeRO-3's
    persistent rows (``params``) live, with their pinning, paths, buffer sizes and ratios.
    ``ratio: auto`` resolves later, once the units' sizes are known (``runtime/placement.py``:
    ``auto_optimizer``/``auto_params`` say which)."""

    optimizer: OffloadPolicy
    params: OffloadPolicy
    auto_optimizer: bool = False
    auto_params: bool = False


def storage_policy(config: OffloadSettings) -> StoragePolicy:
    return StoragePolicy(
        optimizer_offload(config),
        param_offload(config),
        auto_optimizer=config.offload_optimizer.ratio == "auto",
        auto_params=config.offload_param.ratio == "auto",
    )


def optimizer_offload(config: OffloadSettings) -> OffloadPolicy:
    """The placement of the optimizer's side (masters, their gradients, optimizer state)."""
    return _from_block(config.offload_optimizer, "offload_optimizer")


def param_offload(config: OffloadSettings) -> OffloadPolicy:
    """The placement of ZeRO-3's persistent parameter rows. The config's own rules
    (``ZeroConfig.conflicts``, run first) refuse it at ZeRO-1/2, as DeepSpeed does: there
    every rank holds the full parameters on the device anyway."""
    return _from_block(config.offload_param, "offload_param")


def host_empty(numel: int, dtype: torch.dtype, policy: OffloadPolicy, compute: torch.device) -> torch.Tensor:
    """A zeroed host tensor for ``policy`` (pinned when it asks for that on a GPU machine)."""
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=policy.pinned(compute))
