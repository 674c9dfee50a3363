"""The bench's DeepSpeed rows: DeepSpeed ZeRO stage 1, 2 and 3 on the same model, data and
optimizer as this engine's rows (fp32 ``torch.optim.AdamW``, CPU/gloo).

DeepSpeed is not a dependency of the package (``pip install zero-strategy[bench]`` brings it;
``DS_BUILD_OPS=0`` keeps the install to Python only, and ``DS_ACCELERATOR=cpu`` is set for the
rows' ranks). DeepSpeed joins the process group the launcher already made
(``deepspeed.initialize`` sees it initialized) and uses its own ``backward`` and ``step``
(which also zeroes the gradients).

Model states of a DeepSpeed row are counted as every tensor the engine keeps between steps:
the module's parameters (with stage 3's partitions, ``ds_tensor``), their ``.grad``, and the
tensors its ZeRO optimizer holds in its attributes (flat fp32 partitions, gradient partitions,
the wrapped AdamW's state), each storage once. Its reduce buckets (``ipg_buckets``: at stage 3
``reduce_bucket_size`` elements, 2 GB of fp32 by default, allocated though never touched on CPU)
are communication buffers, not model states, and are left out. Exposed
communication is **n/a**: DeepSpeed's collectives do not go through this engine's timed
collectives, and its comms logger times the launch of asynchronous operations, not the wait,
so it is not the same measure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["DEEPSPEED_ROWS", "build_deepspeed", "deepspeed_config", "deepspeed_state"]

DEEPSPEED_ROWS = {"deepspeed1": 1, "deepspeed2": 2, "deepspeed3": 3}
_WALK_DEPTH = 3


def _tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through lists, tuples, dicts and object attributes,
    ``depth`` levels down (not into modules: the parameters are counted from the module)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, (nn.Module, str, bytes, int, float, bool)) or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    elif isinstance(obj, torch.optim.Optimizer):
        items = [obj.state, obj.param_groups]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
        items = [v for k, v in vars(obj).items() if "bucket" not in k]  # communication buffers
    else:
        return
    for item in items:
        yield from _tensors(item, depth - 1, seen)


def deepspeed_state(engine: Any) -> dict[str, int]:
    """Bytes of the tensors a DeepSpeed engine keeps (see the module's docstring), in the same
    keys as the other rows' counts."""
    params = list(engine.module.parameters())
    parts = [getattr(p, "ds_tensor", None) for p in params]
    found: dict[int, int] = {}

    def add(ts: Iterable[torch.Tensor | None], key: str, out: dict[str, int]) -> None:
        for t in ts:
            if t is None or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in found:
                found[st.data_ptr()] = st.nbytes()
                out[key] = out.get(key, 0) + st.nbytes()

    out: dict[str, int] = {"params": 0, "full_grads": 0, "optimizer_state": 0}
    add(params, "params", out)
    add(parts, "params", out)
    add((p.grad for p in params), "full_grads", out)
    add(_tensors(engine.optimizer, _WALK_DEPTH + 2, set()), "optimizer_state", out)
    out["model_state"] = out["params"] + out["full_grads"] + out["optimizer_state"]
    out.update(tier_device=out["model_state"], tier_host_pinned=0, tier_host_pageable=0, tier_disk=0)
    return out


class _Step:
    """``opt.step()`` / ``opt.zero_grad()`` for the bench's loop: DeepSpeed's ``engine.step()``
    steps and zeroes the gradients itself."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def deepspeed_config(micro_batch: int, zero_optimization: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The bench's DeepSpeed config: ``micro_batch`` samples a rank, no accumulation, fp32 (no
    fp16/bf16), no clipping, no periodic prints or timers, with ``zero_optimization`` as given;
    ``extra`` adds top-level keys (``optimizer`` for DeepSpeed's own optimizer)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero_optimization,
        **extra,
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(
    row: str, gpt: nn.Module, lr: float, micro_batch: int
) -> tuple[Any, _Step, Callable[[torch.Tensor], None], Callable[[], dict[str, int]]]:
    """(engine, stepper, backward, state counter) for ``row`` in :data:`DEEPSPEED_ROWS`."""
    import deepspeed

    stage = DEEPSPEED_ROWS[row]
    opt = torch.optim.AdamW(gpt.parameters(), lr=lr)
    config = deepspeed_config(micro_batch, {"stage": stage})
    engine, _, _, _ = deepspeed.initialize(model=gpt, optimizer=opt, config=config)
    return engine, _Step(engine), engine.backward, lambda: deepspeed_state(engine)
