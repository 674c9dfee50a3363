"""The test launcher's process-group start and stop (the engine itself never creates or
destroys a process group: it is handed one)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["barrier_default_group", "destroy_default_group", "init_default_group"]


def init_default_group(backend: str, timeout_s: float) -> None:
    """Start the default process group from the environment (RANK, WORLD_SIZE, MASTER_*)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def barrier_default_group() -> None:
    """A barrier over the default group (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_default_group(*, barrier: bool = True) -> None:
    """Barrier (unless ``barrier=False``), then destroy the default group (if any): gloo aborts
    less often at exit this way."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
