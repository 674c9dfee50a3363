"""DeepSpeed ZeRO-1/2/3 checkpoints, read from their ``global_step*/`` partitions.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``: per data-parallel
rank ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` with that rank's partition of the fp32 masters
and of the optimizer's moments, and the module's file(s) (``mp_rank_00_model_states.pt`` at stages
1/2, one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank at stage 3) with the parameter
names and shapes in order (``param_shapes``), the buffers, the step and the LR scheduler's state.
The partitions are laid out as DeepSpeed's own ``zero_to_fp32.py`` reads them:

- stages 1 and 2: per param group, the group's parameters flattened one after the other (padding at
  the end only), cut into equal partitions (``single_partition_of_fp32_groups``); the moments
  (``base_optimizer_state``) are cut the same way;
- stage 3: each parameter cut into ``ceil(numel / world)`` pieces, rank ``r`` holding piece ``r``
  of every parameter one after the other (``fp32_flat_groups``, and the moments likewise).

These files are read directly rather than through DeepSpeed's universal checkpoint
(``ds_to_universal.py``): they are what every DeepSpeed run already has, reading them needs no
DeepSpeed install and no conversion step, and the result is resharded by zero_strategy's own
loader to any world size and stage, which is what the universal format exists for. Pickled
DeepSpeed objects in them (the loss scaler, the stage enum) are read as inert stubs with
``torch.load(weights_only=True)``: no code of the file runs. One process reads every rank's
files, so it holds the whole model and its moments in host memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["is_deepspeed_checkpoint", "read_deepspeed"]

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
# DeepSpeed classes pickled into its files; loaded as stubs that keep their arguments
_DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.constants.PARAM_SLICE_MAPPINGS",
)


class _Inert:
    """A DeepSpeed object read from a checkpoint: its arguments and state, nothing run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _stubs() -> list[Any]:
    return [(type(name.rsplit(".", 1)[1], (_Inert,), {}), name) for name in _DEEPSPEED_GLOBALS]


def _load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_stubs()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"import-checkpoint: {path} could not be read with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}): the file is truncated, or holds an "
            "object this reader does not know (no code of the file is run); copy it again, or convert with "
            "DeepSpeed's zero_to_fp32.py"
        ) from exc


def _tag_dir(path: str) -> str | None:
    """The ``global_step*`` directory ``path`` is or names through its ``latest`` file."""
    if os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            tag = f.read().strip()
        if tag and "/" not in tag and os.path.isdir(os.path.join(path, tag)):
            path = os.path.join(path, tag)
    if os.path.isdir(path) and any(_OPTIM.match(n) for n in os.listdir(path)):
        return path
    return None


def is_deepspeed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed ZeRO checkpoint (its root with ``latest``, or a tag directory)."""
    return _tag_dir(os.fspath(path)) is not None


def _walk(
    shapes: Sequence[tuple[str, torch.Size]], ranks: list[torch.Tensor], stage: int, world: int
) -> dict[str, torch.Tensor]:
    """The full tensors of ``shapes`` (in order) from every rank's flat partition."""
    out: dict[str, torch.Tensor] = {}
    if stage <= 2:
        flat = torch.cat(ranks)
        offset = 0
        for name, shape in shapes:
            n = shape.numel()
            out[name] = flat[offset : offset + n].clone().view(shape)
            offset += n
        if offset > flat.numel():
            raise ValueError(f"import-checkpoint: the partitions hold {flat.numel()} elements, the shapes {offset}")
        return out
    offset = 0
    for name, shape in shapes:
        n = shape.numel()
        piece = -(-n // world)
        out[name] = torch.cat([r[offset : offset + piece] for r in ranks])[:n].clone().view(shape)
        offset += piece
    return out


def read_deepspeed(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DeepSpeed checkpoint as a flat state dict in FSDP2's layout (``model.<name>`` full fp32
    masters and buffers, ``optim.state.<name>.<key>``, ``optim.param_groups.<i>.<setting>``,
    ``lr_scheduler.<key>``) and a report of what was read."""
    tag = _tag_dir(os.fspath(path))
    if tag is None:
        raise ValueError(f"import-checkpoint: {os.fspath(path)!r} holds no DeepSpeed *_optim_states.pt files")
    optim_files = sorted((int(m.group(1)), n) for n in os.listdir(tag) if (m := _OPTIM.match(n)))
    world = len(optim_files)
    if [r for r, _ in optim_files] != list(range(world)):
        raise ValueError(f"import-checkpoint: {tag}: the optimizer files of ranks {[r for r, _ in optim_files]}; "
                         "copy every rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt")  # fmt: skip
    model_file = next(
        (os.path.join(tag, n) for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
         if os.path.isfile(os.path.join(tag, n))), None)  # fmt: skip
    if model_file is None:
        raise ValueError(f"import-checkpoint: {tag} has no mp_rank_00_model_states.pt (nor stage 3's per-rank one)")
    model = _load(model_file)
    if model.get("frozen_param_shapes"):
        raise ValueError(
            f"import-checkpoint: {tag} has frozen parameters ({', '.join(list(model['frozen_param_shapes'][0])[:3])} "
            "...), which this reader does not read yet; convert with DeepSpeed's zero_to_fp32.py"
        )
    optims = [_load(os.path.join(tag, n))["optimizer_state_dict"] for _, n in optim_files]
    stage = 3 if "fp32_flat_groups" in optims[0] else 2 if "single_partition_of_fp32_groups" in optims[0] else 0
    if stage == 0:
        raise ValueError(f"import-checkpoint: {tag}: not a ZeRO-1/2/3 optimizer partition (bf16 or other optimizer)")
    groups = [list(g.items()) for g in model["param_shapes"]]
    sd: dict[str, Any] = {}
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    base = [o["base_optimizer_state"] if stage <= 2 else o["optimizer_state_dict"] for o in optims]
    if stage <= 2:
        for g, shapes in enumerate(groups):
            masters.update(_walk(shapes, [o["single_partition_of_fp32_groups"][g] for o in optims], stage, world))
            for key in ("exp_avg", "exp_avg_sq"):
                if key in base[0]["state"].get(g, {}):
                    for name, t in _walk(shapes, [b["state"][g][key] for b in base], stage, world).items():
                        moments.setdefault(name, {})[key] = t
    else:
        shapes = [s for g in groups for s in g]
        masters = _walk(shapes, [torch.cat(list(o["fp32_flat_groups"])) for o in optims], stage, world)
        for key in ("exp_avg", "exp_avg_sq"):
            if all(key in s for s in base[0]["state"].values()):
                flat = [torch.cat([b["state"][i][key] for i in sorted(b["state"])]) for b in base]
                for name, t in _walk(shapes, flat, stage, world).items():
                    moments.setdefault(name, {})[key] = t
    steps = [s["step"] for s in base[0]["state"].values() if isinstance(s.get("step"), torch.Tensor)]
    for name, t in masters.items():
        sd[f"model.{name}"] = t
        for key, value in moments.get(name, {}).items():
            sd[f"optim.state.{name}.{key}"] = value
        if steps and name in moments:
            sd[f"optim.state.{name}.step"] = steps[0].clone()
    for name in model.get("buffer_names") or []:
        sd[f"model.{name}"] = model["module"][name]
    for i, group in enumerate(base[0]["param_groups"]):
        for key, value in group.items():
            if key != "params":
                sd[f"optim.param_groups.{i}.{key}"] = value
    for key, value in (model.get("lr_scheduler") or {}).items():
        sd[f"lr_scheduler.{key}"] = value
    enum = optims[0].get("zero_stage")
    stage = int(enum.args[0]) if isinstance(enum, _Inert) and enum.args and isinstance(enum.args[0], int) else stage
    report = {"deepspeed_stage": stage, "deepspeed_world_size": world, "global_steps": model.get("global_steps"),
              "tag": os.path.basename(tag), "ds_version": model.get("ds_version")}  # fmt: skip
    return sd, report
