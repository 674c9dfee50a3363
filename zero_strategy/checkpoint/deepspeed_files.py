"""DeepSpeed ZeRO-1/2/3 checkpoints, read from their ``global_step*/`` partitions.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``: per data-parallel
rank ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (``bf16_zero_pp_rank_...`` with bf16 on) with
that rank's partition of the fp32 masters and of the optimizer's moments, and the module's file(s)
(``mp_rank_00_model_states.pt`` at stages 1/2, one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
per rank at stage 3) with the names and shapes of the parameters the optimizer owns, in order
(``param_shapes``), the buffers, the step and the LR scheduler's state. The partitions are laid out
as DeepSpeed's own ``zero_to_fp32.py`` reads them:

- stages 1 and 2: per param group, the group's parameters flattened one after the other, each
  followed by ``param_alignment_paddings`` elements (0 unless ``parameter_alignment`` is on), padded
  at the end and cut into equal partitions (``single_partition_of_fp32_groups``); the moments
  (``base_optimizer_state``) are cut the same way. bf16 runs write the same layout: stages 1 and 2
  through the ZeRO optimizer, and stage 1 with fp32 gradient accumulation
  (``data_types.grad_accum_dtype``) through ``BF16_Optimizer``, whose files have no ``zero_stage``;
- stage 3: each parameter cut into ``ceil(numel / world)`` pieces, rank ``r`` holding piece ``r``
  of every parameter one after the other (``fp32_flat_groups``, and the moments likewise).

Parameters the optimizer does not own (frozen ones, as in a LoRA run, and those without elements)
have no master and no moments; their value is kept in the parameters' own dtype (bf16 in a bf16
run): whole in the model-states file's ``frozen_param_fragments`` at stage 2, as rank ``r``'s piece
(cut as at stage 3) in rank ``r``'s model-states file at stage 3, and only among the module's
entries at stage 1 (DeepSpeed saves the fragments only when gradients are partitioned). They come
out as ``model.<name>`` values alone.

The optimizer state is read as torch's Adam and AdamW keep it, whichever Adam DeepSpeed ran: a
client ``torch.optim.AdamW``, or its own ``FusedAdam`` (the default with a config ``optimizer``
block) and ``DeepSpeedCPUAdam`` (``offload_optimizer``), which keep each state's ``step`` as a
Python int (read as a float32 0-d tensor) and group keys torch's optimizers lack (FusedAdam's
group ``step``, ``bias_correction``: not carried). Whether that Adam decoupled its weight decay
(``adam_w_mode``) is not in the groups but in the config saved beside them (``ds_config``):
``false`` is L2-regularised Adam, ``torch.optim.Adam``'s update, and is warned about when a weight
decay makes the two differ. ``elastic_checkpoint`` saves the state as a list of group states, read
the same way. Each group's parameter names come from ``param_shapes`` (at stage 3 one entry per
sub-group, joined through the group's sub-group indices) as ``optim.param_groups.<i>.params``.

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
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["is_deepspeed_checkpoint", "read_deepspeed"]

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL_PARALLEL = re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_(?!00_)\d+_optim_states\.pt$")
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


def _mismatch(held: int, wanted: int) -> None:
    raise ValueError(
        f"import-checkpoint: the partitions hold {held} elements, the parameter shapes (param_shapes) need {wanted}: "
        "the rank files are from different saves or runs; copy every zero_pp_rank_*_optim_states.pt and the model "
        "states file(s) of one tag (global_step*/) again"
    )


def _walk(
    shapes: Sequence[tuple[str, torch.Size]],
    ranks: list[torch.Tensor],
    stage: int,
    world: int,
    paddings: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """The full tensors of ``shapes`` (in order) from every rank's flat partition; ``paddings``:
    the elements after each parameter at stages 1/2 (``param_alignment_paddings``), else none."""
    out: dict[str, torch.Tensor] = {}
    if stage <= 2:
        flat = torch.cat(ranks)
        offset = 0
        for i, (name, shape) in enumerate(shapes):
            n = shape.numel()
            if offset + n > flat.numel():
                break  # named below
            out[name] = flat[offset : offset + n].clone().view(shape)
            offset += n + (paddings[i] if paddings else 0)
        if offset > flat.numel() or len(out) < len(shapes):
            _mismatch(flat.numel(), sum(s.numel() for _, s in shapes) + sum(paddings or ()))
        return out
    offset = 0
    for name, shape in shapes:
        n = shape.numel()
        piece = -(-n // world)
        whole = torch.cat([r[offset : offset + piece] for r in ranks])
        if whole.numel() < n:
            _mismatch(sum(r.numel() for r in ranks), sum(-(-s.numel() // world) * world for _, s in shapes))
        out[name] = whole[:n].clone().view(shape)
        offset += piece
    return out


def _kind(optim: dict[str, Any], tag: str) -> tuple[int, str]:
    """(ZeRO stage, DeepSpeed optimizer class) of a rank's ``optimizer_state_dict``."""
    enum = optim.get("zero_stage")
    named = int(enum.args[0]) if isinstance(enum, _Inert) and enum.args and isinstance(enum.args[0], int) else None
    if "fp32_flat_groups" in optim:
        return 3, "DeepSpeedZeroOptimizer_Stage3"
    if "single_partition_of_fp32_groups" in optim and "base_optimizer_state" in optim:
        if enum is None:  # ZeRO-1 with bf16 parameters and fp32 gradient accumulation: the same flat layout
            return 1, "BF16_Optimizer"
        return named or 2, "DeepSpeedZeroOptimizer"
    raise ValueError(
        f"import-checkpoint: {tag}: the optimizer files hold neither ZeRO-1/2's single_partition_of_fp32_groups nor "
        f"ZeRO-3's fp32_flat_groups (keys {sorted(optim)[:8]}): not a ZeRO optimizer partition; convert the weights "
        "with DeepSpeed's zero_to_fp32.py and load them with zs.load_full_state_dict"
    )


def _frozen(tag: str, model: dict[str, Any], stage: int, world: int, trained: set[str]) -> dict[str, torch.Tensor]:
    """The values of the parameters the optimizer does not own (frozen, or without elements), as
    saved: stage 2 keeps each whole in ``frozen_param_fragments``, stage 3 rank ``r``'s piece of
    each in its own model-states file (``ceil(numel / world)`` elements, padded at the end), and
    stage 1 (and BF16_Optimizer) keeps none: they are the module's entries that are neither in
    ``param_shapes``, nor buffers, nor tied names (``shared_params``)."""
    shapes = model.get("frozen_param_shapes")
    if not shapes:
        skip = trained | set(model.get("buffer_names") or []) | set(model.get("shared_params") or {})
        module = model.get("module") or {}
        return {n: t.clone() for n, t in module.items() if n not in skip and isinstance(t, torch.Tensor)}
    if stage <= 2:
        frags = [model["frozen_param_fragments"]]
    else:
        names = [os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)]
        missing = [os.path.basename(n) for n in names if not os.path.isfile(n)]
        if missing:
            raise ValueError(
                f"import-checkpoint: {tag}: ZeRO-3 keeps each rank's piece of the frozen parameters in its own "
                f"model states file; {', '.join(missing)} missing: copy every rank's file"
            )
        frags = [model["frozen_param_fragments"]] + [_load(n)["frozen_param_fragments"] for n in names[1:]]
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        flat = torch.cat([f[name].reshape(-1) for f in frags])
        if flat.numel() < n:
            raise ValueError(f"import-checkpoint: {tag}: the frozen {name} has {flat.numel()} elements of {n}")
        out[name] = flat[:n].clone().view(shape)
    return out


def _refuse_model_parallel(tag: str, model: dict[str, Any]) -> None:
    """A run with tensor or pipeline parallelism keeps a slice of each parameter per model-parallel
    rank (``mp_rank_01``...), which this reader does not join: refuse it, naming what says so."""
    dims = model.get("checkpoint_parallel_dimensions") or {}
    said = [f"mp_world_size {model['mp_world_size']}"] if (model.get("mp_world_size") or 1) > 1 else []
    said += [f"{key} {dims[key]}" for key in ("tp_degree", "pp_degree") if (dims.get(key) or 1) > 1]
    files = sorted(n for n in os.listdir(tag) if _MODEL_PARALLEL.match(n))
    said += [f"{len(files)} files such as {files[0]}"] if files else []
    if said:
        raise ValueError(
            f"import-checkpoint: {tag} is a tensor- or pipeline-parallel run ({', '.join(said)}): each "
            "model-parallel rank holds a slice of the parameters, which this reader does not join; convert it with "
            "DeepSpeed's ds_to_universal.py, or take the weights with zero_to_fp32.py and zs.load_full_state_dict "
            "(the optimizer state then starts fresh)"
        )


# Param-group keys of DeepSpeed's own Adams (FusedAdam, DeepSpeedCPUAdam) that torch's Adam and
# AdamW do not have: FusedAdam's group counter (never advanced; the step is each state's ``step``),
# the bias-correction switch (torch's always corrects) and the L2/decoupled switch, which DeepSpeed
# keeps on the optimizer object and only a hand-made group could hold.
_DEEPSPEED_GROUP_KEYS = ("step", "bias_correction", "adam_w_mode")


def _base_state(optim: dict[str, Any], stage: int, tag: str) -> dict[str, Any]:
    """The wrapped optimizer's ``{"state", "param_groups"}``. ZeRO-1/2 with ``elastic_checkpoint``
    saves a list instead, one state per param group (no group settings), cut like the masters."""
    state = optim["base_optimizer_state"] if stage <= 2 else optim["optimizer_state_dict"]
    if isinstance(state, list) and stage <= 2:
        return {"state": dict(enumerate(state)), "param_groups": []}
    if isinstance(state, dict) and isinstance(state.get("state"), dict):
        return {"state": state["state"], "param_groups": list(state.get("param_groups") or [])}
    field = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    raise ValueError(
        f"import-checkpoint: {tag}: the optimizer files' {field} is a {type(state).__name__}, neither a torch "
        "optimizer state_dict nor elastic_checkpoint's list of group states; save the run again with "
        'DeepSpeed\'s default "elastic_checkpoint": false, or convert it with ds_to_universal.py'
    )


def _moments_of_every_sub_group(state: dict[Any, Any], count: int, tag: str) -> list[str]:
    """The Adam moments ZeRO-3 saved for all ``count`` sub-groups; one saved for some sub-groups
    only is refused (a fresh Adam for some parameters would not continue the run)."""
    keys = []
    for key in ("exp_avg", "exp_avg_sq"):
        missing = [i for i in range(count) if key not in (state.get(i) or {})]
        if len(missing) == count:
            continue
        if missing:
            raise ValueError(
                f"import-checkpoint: {tag}: ZeRO-3 saved {key} for {count - len(missing)} of the {count} sub-groups "
                f"(optimizer_state_dict.state; missing for sub-groups {missing[:8]}): the checkpoint was saved before "
                "every sub-group had stepped, or is damaged; save it again after a full step, or load the weights "
                "alone (zero_to_fp32.py and zs.load_full_state_dict)"
            )
        keys.append(key)
    return keys


def _step(value: Any) -> torch.Tensor | None:
    """An Adam state's ``step`` as torch's Adam and AdamW keep it (a float32 0-d tensor): torch's
    optimizers save a tensor, FusedAdam and DeepSpeedCPUAdam a Python int."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).to(torch.float32).clone()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    return None


def _adam_w_mode(config: Any, groups: list[dict[str, Any]]) -> bool | None:
    """Whether DeepSpeed's Adam decayed the weights AdamW's way (None: not an Adam it built, or not
    said). Its config's ``optimizer`` block (saved as ``ds_config``) decides: type ``AdamW``, or
    ``Adam`` with ``params.adam_w_mode`` (default true); false is Adam with L2 regularisation."""
    for group in groups:
        if "adam_w_mode" in group:
            return bool(group["adam_w_mode"])
    block = config.get("optimizer") if isinstance(config, dict) else None
    kind = str(block.get("type", "")).lower() if isinstance(block, dict) else ""
    if kind not in ("adam", "adamw") or not isinstance(block, dict):
        return None
    return kind == "adamw" or bool((block.get("params") or {}).get("adam_w_mode", True))


def _warn_about_adam_semantics(tag: str, groups: list[dict[str, Any]], adam_w_mode: bool | None) -> None:
    """Warn where torch's AdamW would not continue the same updates: L2-regularised Adam with a
    weight decay (``adam_w_mode`` false), or Adam without bias correction."""
    decays = sorted({float(g.get("weight_decay") or 0.0) for g in groups} - {0.0})
    if adam_w_mode is False and decays:
        warnings.warn(
            f"import-checkpoint: {tag}: the DeepSpeed run's Adam had adam_w_mode false (weight_decay {decays[0]:g} "
            "added to the gradient, L2 regularisation), torch.optim.AdamW decays the weights apart from it: to "
            "continue the same updates load into torch.optim.Adam with the same weight_decay, not AdamW",
            UserWarning,
            stacklevel=3,
        )
    if any(g.get("bias_correction") is False for g in groups):
        warnings.warn(
            f"import-checkpoint: {tag}: the DeepSpeed run's Adam had bias_correction false; torch's Adam and AdamW "
            "always correct the bias, so the updates differ slightly (most in the first steps)",
            UserWarning,
            stacklevel=3,
        )


def read_deepspeed(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DeepSpeed checkpoint as a flat state dict in FSDP2's layout (``model.<name>`` full fp32
    masters, frozen parameters as saved and buffers, ``optim.state.<name>.<key>``,
    ``optim.param_groups.<i>.<setting>``, ``lr_scheduler.<key>``) and a report of what was read."""
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
    _refuse_model_parallel(tag, model)
    files = [_load(os.path.join(tag, n)) for _, n in optim_files]
    optims = [f["optimizer_state_dict"] for f in files]
    stage, optimizer = _kind(optims[0], tag)
    groups = [list(g.items()) for g in model["param_shapes"]]
    sd: dict[str, Any] = {}
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    base = [_base_state(o, stage, tag) for o in optims]
    if stage <= 2:
        paddings = optims[0].get("param_alignment_paddings") or [None] * len(groups)
        for g, shapes in enumerate(groups):
            flat = [o["single_partition_of_fp32_groups"][g] for o in optims]
            masters.update(_walk(shapes, flat, stage, world, paddings[g]))
            for key in ("exp_avg", "exp_avg_sq"):
                if key in base[0]["state"].get(g, {}):
                    for name, t in _walk(shapes, [b["state"][g][key] for b in base], stage, world, paddings[g]).items():
                        moments.setdefault(name, {})[key] = t
    else:
        shapes = [s for g in groups for s in g]
        masters = _walk(shapes, [torch.cat(list(o["fp32_flat_groups"])) for o in optims], stage, world)
        for key in _moments_of_every_sub_group(base[0]["state"], len(groups), tag):
            flat = [torch.cat([b["state"][i][key] for i in range(len(groups))]) for b in base]
            for name, t in _walk(shapes, flat, stage, world).items():
                moments.setdefault(name, {})[key] = t
    frozen = _frozen(tag, model, stage, world, set(masters))
    steps = [st for s in base[0]["state"].values() if (st := _step(s.get("step"))) is not None]
    for name, t in masters.items():
        sd[f"model.{name}"] = t
        for key, value in moments.get(name, {}).items():
            sd[f"optim.state.{name}.{key}"] = value
        if steps and name in moments:
            sd[f"optim.state.{name}.step"] = steps[0].clone()
    for name, t in frozen.items():
        sd[f"model.{name}"] = t
    for name in model.get("buffer_names") or []:
        sd[f"model.{name}"] = model["module"][name]
    saved_groups = base[0]["param_groups"] or [{"params": [g]} for g in range(len(groups))]  # elastic: none saved
    adam_w_mode = _adam_w_mode(files[0].get("ds_config"), saved_groups)
    for i, group in enumerate(saved_groups):
        members = group.get("params") or []
        sd[f"optim.param_groups.{i}.params"] = [n for m in members if m < len(groups) for n, _ in groups[m]]
        for key, value in group.items():
            if key not in ("params", *_DEEPSPEED_GROUP_KEYS):
                sd[f"optim.param_groups.{i}.{key}"] = value
    _warn_about_adam_semantics(tag, saved_groups, adam_w_mode)
    for key, value in (model.get("lr_scheduler") or {}).items():
        sd[f"lr_scheduler.{key}"] = value
    report = {"deepspeed_stage": stage, "deepspeed_optimizer": optimizer, "deepspeed_world_size": world,
              "frozen": sorted(frozen), "global_steps": model.get("global_steps"), "tag": os.path.basename(tag),
              "ds_version": model.get("ds_version"), "deepspeed_adam_w_mode": adam_w_mode}  # fmt: skip
    return sd, report
