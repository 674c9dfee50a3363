"""Another engine's DCP checkpoint: resuming a run that FSDP2 or torchtitan started.

FSDP2's documentation and torchtitan save through ``torch.distributed.checkpoint`` (DCP) a
state dict built by ``torch.distributed.checkpoint.state_dict``: every tensor in its own shape
(a DTensor sharded on dim 0, or plain), with no ``zero_meta.json`` beside the ``.metadata``
file. The layouts read here, told apart by their keys:

- FSDP2's docs: ``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``:
  ``model.<fqn>``, ``optim.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``) and
  ``optim.param_groups.<i>.<setting>``;
- torchtitan: the model's keys at the top level (``<fqn>``), the optimizer under ``optimizer``
  (``optimizer.state.<fqn>.<key>``, settings per parameter ``optimizer.param_groups.<fqn>.<setting>``),
  beside ``train_state`` (its ``step``), ``lr_scheduler`` and ``dataloader``, which are reported
  and not loaded (an LR scheduler or a data loader is the caller's own object;
  :func:`read_foreign` returns their plain values, see ``docs/migrating_fsdp.md``).

Loading (:func:`load_foreign`): each rank reads, for every parameter, the whole rows that cover
its flat piece (:class:`~zero_strategy.checkpoint.dcp_pieces.RowsPiece`; DCP reshards from any
world size), and cuts them to the piece: the fp32 masters, and every optimizer state value the
checkpoint holds for the parameter (per element, or a scalar such as ``step``). The engine's step
counter is the optimizer's ``step`` (or ``train_state.step``). Non-tensor entries are read
without running code (``torch.load(weights_only=True)`` of their bytes), never through DCP.

Names: a tied weight (an embedding shared with the head) is one parameter, named by
``named_parameters()`` with its first name, but ``get_model_state_dict`` saves it under every
name; it loads from whichever the checkpoint holds (its first name if there), and the other saved
names are read to compare (a warning names any that differ). Param groups: FSDP2 saves each
group's parameter names (``optim.param_groups.<i>.params``), and each of the optimizer's groups
takes the settings of the saved group holding the same parameters, in whatever order the groups
were built (only parameters the engine owns count: a frozen one has no state); a group within one
saved group takes its settings, with a warning. Only a checkpoint that names no parameters is
matched by group index. Optimizers that step whole parameters (Muon) are refused: their state
lives on the owner rank's whole matrix, which this loader does not place.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from zero_strategy.checkpoint.dcp_pieces import RowsPiece, covering_rows
from zero_strategy.checkpoint.deepspeed_files import is_deepspeed_checkpoint, read_deepspeed
from zero_strategy.checkpoint.files import (
    SafeFileSystemReader,
    checksumming_writer,
    inside,
    single_process_quiet,
    verify_checksums,
    write_atomic,
)
from zero_strategy.checkpoint.optim_state import fresh_state, restore_group_settings
from zero_strategy.checkpoint.versions import (
    LATEST,
    META,
    _create_version_dir,
    _file_records,
    read_meta,
)
from zero_strategy.comm import collectives as C
from zero_strategy.runtime.engine import ZeroEngine
from zero_strategy.sharding.setup_checks import persistent_buffers

__all__ = ["ForeignCheckpoint", "import_checkpoint", "is_foreign_dcp", "is_imported", "load_foreign", "read_foreign"]

DCP_METADATA = ".metadata"
IMPORTED = "imported_from"  # the zero_meta.json key of a checkpoint import_checkpoint wrote
# top-level entries that are neither the model nor the optimizer (torchtitan's names)
_OTHER_TOPS = ("train_state", "lr_scheduler", "lr_schedulers", "dataloader", "extra", "engine", "compression")
_OPTIM_TOPS = ("optim", "optimizer", "optimizers")


def is_foreign_dcp(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP directory that zero_strategy did not write (a ``.metadata``
    file and no ``zero_meta.json``)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, DCP_METADATA)) and not os.path.exists(os.path.join(path, META))


@dataclass
class ForeignCheckpoint:
    """What a foreign DCP checkpoint holds, by kind. ``model``: fqn -> DCP metadata;
    ``optim``: fqn -> state key -> metadata; ``optim_prefix``: where the optimizer is
    (``optim.state.``); ``groups``: the optimizer's param-group settings (``params``: the group's
    parameter names, where saved), by group index (or
    ``{fqn: settings}`` per parameter, torchtitan's flattened form); ``objects``: the other top-level
    entries (``train_state``, ``lr_scheduler``, ...) as key -> value read without code, or the
    metadata where that fails."""

    path: str
    metadata: Metadata
    model_prefix: str = "model."
    model: dict[str, TensorStorageMetadata] = field(default_factory=dict)
    optim_prefix: str = "optim.state."
    optim: dict[str, dict[str, TensorStorageMetadata]] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)

    @property
    def train_step(self) -> int | None:
        """A trainer's own step count (torchtitan's ``train_state.step``), if saved as a value."""
        train = self.objects.get("train_state.step")
        if isinstance(train, (int, torch.Tensor)) and not isinstance(train, bool):
            return int(train)
        return None

    def summary(self) -> dict[str, Any]:
        """What was read, for a report: counts, the step, the scheduler's state if present."""
        numel = sum(_numel(md.size) for md in self.model.values())
        keys = sorted({k for state in self.optim.values() for k in state})
        return {
            "path": self.path,
            "layout": "torchtitan" if self.model_prefix == "" else "fsdp2",
            "model_tensors": len(self.model),
            "model_elements": numel,
            "optimizer_state": {"parameters": len(self.optim), "keys": keys},
            "param_groups": len(self.groups),
            "objects": sorted(self.objects),
        }


def _numel(size: Sequence[int]) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def read_bytes_entry(reader: SafeFileSystemReader, metadata: Metadata, key: str) -> Any:
    """A non-tensor entry's value, unpickled with ``weights_only=True`` (plain values, tensors);
    ``None`` when the bytes are transformed or hold anything else."""
    info = (metadata.storage_data or {}).get(MetadataIndex(key))
    if info is None or getattr(info, "transform_descriptors", None):
        return None
    file = inside(reader.path, info.relative_path, f"{reader.path}: data file")
    with open(file, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:  # an object weights_only refuses (a dataloader's state): reported, not loaded
        return None


def read_foreign(path: str | os.PathLike[str], names: Sequence[str] | None = None) -> ForeignCheckpoint:
    """Classify the entries of a foreign DCP checkpoint. ``names``: the model's parameter and
    buffer names, which decide where the model's keys are (``model.<fqn>`` or ``<fqn>``)."""
    path = os.fspath(path)
    reader = SafeFileSystemReader(path, bytes_entries=True)
    metadata = reader.read_metadata()
    entries = metadata.state_dict_metadata
    out = ForeignCheckpoint(path, metadata)
    has_model_top = any(k.startswith("model.") for k in entries)
    if names is not None and not any(f"model.{n}" in entries for n in names) and any(n in entries for n in names):
        has_model_top = False
    out.model_prefix = "model." if has_model_top else ""
    for key, md in entries.items():
        top = key.split(".", 1)[0]
        if top in _OPTIM_TOPS and key.startswith(f"{top}.state."):
            out.optim_prefix = f"{top}.state."
            fqn, _, what = key[len(out.optim_prefix) :].rpartition(".")
            if isinstance(md, TensorStorageMetadata):
                out.optim.setdefault(fqn, {})[what] = md
        elif top in _OPTIM_TOPS and key.startswith(f"{top}.param_groups."):
            where, _, setting = key[len(top) + 14 :].rpartition(".")  # setting "params": the group's names
            out.groups.setdefault(where, {})[setting] = read_bytes_entry(reader, metadata, key)
        elif has_model_top and top == "model":
            if isinstance(md, TensorStorageMetadata):
                out.model[key[len("model.") :]] = md
        elif not has_model_top and top not in _OTHER_TOPS and top not in _OPTIM_TOPS:
            if isinstance(md, TensorStorageMetadata):
                out.model[key] = md
        else:
            out.objects[key] = (
                read_bytes_entry(reader, metadata, key) if not isinstance(md, TensorStorageMetadata) else md
            )
    return out


def is_imported(path: str | os.PathLike[str], pointer: str = LATEST) -> bool:
    """Whether ``path`` (a root, through its pointer, or a versioned directory) holds a checkpoint
    that :func:`import_checkpoint` wrote (the peer's layout, with zero_strategy's metadata)."""
    try:
        return IMPORTED in read_meta(path, "", pointer)[1]
    except (ValueError, OSError):
        return False


def load_foreign(
    path: str,
    engine: ZeroEngine,
    optimizers: list[torch.optim.Optimizer],
    caller: str = "load_checkpoint()",
    pointer: str = LATEST,
) -> dict[str, Any]:
    """Load a foreign DCP checkpoint (or one :func:`import_checkpoint` wrote) into ``engine`` (and
    its ``optimizers``) at this world size and stage. Returns ``{"foreign": what was read, "step":
    the step}``. Collective: every rank checks first, and all raise the same error if one refuses."""
    names = engine.param_names()
    params = dict(engine.module.named_parameters())
    aliases = _aliases(engine.module, params)
    buffers = persistent_buffers(engine.module)
    failure: Exception | None = None
    ckpt: ForeignCheckpoint | None = None
    source: dict[str, str] = {}  # a parameter's name -> the checkpoint's name it loads from (a tied alias)
    settings: list[dict[str, Any]] | None = None  # the saved settings for each optimizer group, in order
    try:
        if not is_foreign_dcp(path):  # written by import_checkpoint: follow `latest`, check the files
            path, meta = read_meta(path, caller, pointer)
            files = _file_records(meta.get("files", {}))
            verify_checksums(path, files, sorted(files)[engine.world.rank :: engine.world.world_size])
        if optimizers and engine.whole.entries:
            raise ValueError(
                f"{caller}: {path!r} is another engine's checkpoint, and the optimizer steps whole parameters "
                f"({len(engine.whole.entries)} matrices, e.g. Muon), whose state this loader does not place on "
                "their owner ranks; load the model alone (load_checkpoint(path, model)) and keep the optimizer fresh"
            )
        ckpt = read_foreign(path, list(params) + list(aliases) + list(buffers))
        source = _check_names(ckpt, params, buffers, bool(optimizers), aliases)
        settings = _match_groups(ckpt, engine, optimizers, caller, aliases)
    except Exception as exc:
        failure = exc
    errors = C.all_gather_objects(
        engine.world, None if failure is None else (type(failure).__name__, str(failure)), what=f"{caller} checks"
    )
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if failure is not None:
            raise failure
        raise ValueError(f"{caller}: another rank refused the checkpoint: {first[1]}")
    if ckpt is None:  # for mypy: a failure above raised
        raise RuntimeError(f"{caller}: reading {path!r} failed")
    engine.wait_for_reductions()
    sd: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, str, int, int]] = []  # (target, key, skip, count)
    group_of = {id(m): group for opt in optimizers for group in opt.param_groups for m in group["params"]}
    opt_of = {id(m): opt for opt in optimizers for group in opt.param_groups for m in group["params"]}
    optim_steps: list[torch.Tensor] = []
    setters: list[tuple[dict[Any, Any], str, torch.Tensor]] = []
    tied: dict[str, list[str]] = {}  # a parameter's name -> its other names the checkpoint holds
    for alias, fqn in aliases.items():
        if alias in ckpt.model and alias != source[fqn]:
            tied.setdefault(fqn, []).append(alias)
    differing: list[tuple[torch.Tensor, torch.Tensor, str]] = []  # (loaded, an alias's saved value, the alias)

    def request(key: str, md: TensorStorageMetadata, target: torch.Tensor, lo: int) -> None:
        hi = lo + target.numel()
        first, last, skip = covering_rows(md.size, lo, hi)
        if target.numel() == 0:
            return
        sd[key] = RowsPiece(md.size, first, last, md.properties.dtype)
        copies.append((target, key, skip, target.numel()))

    def request_param(fqn: str, target: torch.Tensor, lo: int) -> None:
        """A parameter from the name it was saved under; a tied weight's other saved names are
        read too, to compare (the same tensor, saved twice by ``get_model_state_dict``)."""
        request(f"{ckpt.model_prefix}{source[fqn]}", ckpt.model[source[fqn]], target, lo)
        for alias in tied.get(fqn, []):
            scratch = torch.empty_like(target)
            request(f"{ckpt.model_prefix}{alias}", ckpt.model[alias], scratch, lo)
            differing.append((target, scratch, alias))

    with engine.swapped_state(writable=True) as swapped:
        for g in engine.groups:
            for i, (p, m) in enumerate(zip(g.params, g.masters)):
                fqn = names[id(p)]
                lo, hi = g.layout.local_range(i)
                if hi - lo != m.numel():
                    raise RuntimeError(f"{caller}: {fqn}: piece of {m.numel()} elements for range {lo}:{hi}")
                request_param(fqn, m.data.view(-1), lo)
                optimizer = opt_of.get(id(m), optimizers[0] if len(optimizers) == 1 else None)
                if optimizer is None:
                    continue
                state = optimizer.state[m]
                on_disk = swapped.get(id(m), {})
                saved = _saved_name(fqn, aliases, ckpt.optim)
                for key, md in ckpt.optim.get(saved, {}).items():
                    full = key != "step" and list(md.size) == list(p.shape)
                    if full:
                        if key in on_disk:
                            target = on_disk[key]
                        else:
                            if key not in state:
                                state[key] = torch.zeros_like(m.data)
                            target = state[key]
                        request(f"{ckpt.optim_prefix}{saved}.{key}", md, target.view(-1), lo)
                    else:  # a scalar (step), or state in its own shape: loaded whole
                        value = fresh_state(key, m, md, group_of.get(id(m), {}), -1)
                        sd[f"{ckpt.optim_prefix}{saved}.{key}"] = value
                        setters.append((state, key, value))
                        if key == "step":
                            optim_steps.append(value)
        for fqn, p in params.items():
            if engine.master_of(p) is not None:
                continue
            flat = engine.flat_value(p)
            if engine.config.stage == 3:
                offset = engine.flat_offset(p)
                if offset is None:
                    chunk = -(-p.numel() // engine.ctx.world_size)
                    offset = min(chunk * engine.ctx.rank, p.numel())
                request_param(fqn, flat[: max(0, min(flat.numel(), p.numel() - offset))], offset)
            else:
                request_param(fqn, flat, 0)
        for fqn, b in buffers.items():
            sd[f"{ckpt.model_prefix}{fqn}"] = b
        reader = SafeFileSystemReader(path, bytes_entries=True)
        with single_process_quiet():
            dcp.load(sd, storage_reader=reader, process_group=C.bounded_group(engine.world))
        with torch.no_grad():
            for target, key, skip, count in copies:
                rows = sd[key].as_subclass(torch.Tensor).reshape(-1)
                target.copy_(rows[skip : skip + count])
    unequal = sorted({alias for loaded, value, alias in differing if not torch.equal(loaded, value)})
    if unequal:
        warnings.warn(
            f"{caller}: {path!r} holds tied weights under several names with different values: "
            f"{_short([f'{a} (loaded from {source[aliases[a]]})' for a in unequal])}; the model holds one tensor for "
            "all its names, loaded from the first name (save the checkpoint from a model whose weights are tied)",
            UserWarning,
            stacklevel=3,
        )
    for state, key, value in setters:
        state[key] = value
    step = max((int(s.item()) for s in optim_steps), default=None)
    if step is None:
        step = ckpt.train_step
    engine.load_progress(
        {"engine.step_count": torch.tensor(step or 0), "engine.loss_scale": torch.tensor(engine.scaler.scale)}
    )
    _restore_groups(settings, optimizers)
    if engine.world.rank == 0:
        skipped = sorted(k for k in ckpt.objects if not k.startswith("train_state.step"))
        if skipped:
            warnings.warn(
                f"{caller}: {path!r} is another engine's checkpoint; loaded the model, the optimizer state and the step "
                f"({step}); not loaded: {_short(skipped)} (an LR scheduler or data loader is your own object: restore "
                "it from these entries yourself, see docs/migrating_fsdp.md)",
                UserWarning,
                stacklevel=3,
            )
    return {"foreign": ckpt.summary(), "step": step}


def _short(keys: Sequence[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def _aliases(module: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A tied parameter's other names (``head.weight`` for an embedding the head shares) -> the
    name ``named_parameters()`` gives it (the first), which the engine uses."""
    first = {id(p): n for n, p in params.items()}
    return {
        n: first[id(p)]
        for n, p in module.named_parameters(remove_duplicate=False)
        if id(p) in first and first[id(p)] != n
    }


def _saved_name(fqn: str, aliases: Mapping[str, str], held: Mapping[str, Any]) -> str:
    """The name ``held`` (the checkpoint's model or optimizer entries) keeps parameter ``fqn``
    under: its own, else one of a tied weight's other names; ``fqn`` when none is held."""
    return next((n for n in [fqn, *(a for a, primary in aliases.items() if primary == fqn)] if n in held), fqn)


def _check_names(
    ckpt: ForeignCheckpoint,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    optim: bool,
    aliases: Mapping[str, str],
) -> dict[str, str]:
    """Every parameter and persistent buffer of the model has a tensor of its shape in the
    checkpoint, and nothing in the checkpoint's model is left over; else a ValueError naming both.
    A tied parameter is found under any of its names (``get_model_state_dict`` saves each name).
    Returns each parameter's name -> the checkpoint's name to load it from (its own first)."""
    wanted = {**{n: p.shape for n, p in params.items()}, **{n: b.shape for n, b in buffers.items()}}
    source = {n: _saved_name(n, aliases, ckpt.model) for n in params}
    missing = sorted(n for n in wanted if source.get(n, n) not in ckpt.model)
    extra = sorted(n for n in ckpt.model if n not in wanted and n not in aliases)
    if missing or extra:
        hint = ""
        for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
            if any(prefix in n for n in extra):
                hint = (
                    f" The checkpoint's names hold {prefix!r}: save with get_model_state_dict(model), which removes "
                    "wrapper prefixes, or load into the model the names came from."
                )
        raise ValueError(
            f"load_checkpoint(): the model's names do not match the checkpoint {ckpt.path!r} (read as "
            f"{'model.<name>' if ckpt.model_prefix else '<name> at the top level'}): in the model but not the "
            f"checkpoint: [{_short(missing)}]; in the checkpoint but not the model: [{_short(extra)}]. Build the same "
            f"model as the saved run (same module names), or rename the keys before saving.{hint}"
        )
    saved_shapes = {**{n: wanted[aliases[n]] for n in ckpt.model if n in aliases}, **wanted}
    for name, shape in saved_shapes.items():
        if name not in ckpt.model and name in params:
            continue  # a tied parameter saved under another of its names
        saved = list(ckpt.model[name].size)
        if saved != list(shape):
            raise ValueError(
                f"load_checkpoint(): '{name}' has shape {list(shape)} in the model but {saved} in the checkpoint "
                f"{ckpt.path!r}; load a checkpoint of this model"
            )
    if optim:
        for fqn in ckpt.optim:
            if fqn not in params and fqn not in aliases:
                raise ValueError(
                    f"load_checkpoint(): the checkpoint {ckpt.path!r} has optimizer state for '{fqn}', which is not a "
                    "parameter of the model; build the same model as the saved run"
                )
    return source


def _match_groups(
    ckpt: ForeignCheckpoint,
    engine: ZeroEngine,
    optimizers: list[torch.optim.Optimizer],
    caller: str,
    aliases: Mapping[str, str],
) -> list[dict[str, Any]] | None:
    """The saved param-group settings (lr, betas, weight decay, ...) for each of the optimizers'
    groups, in order: the saved group holding the same parameters (FSDP2's ``param_groups.<i>.params``
    names them; any order of groups), by group index where the checkpoint names none, or by a
    group's first parameter (torchtitan's per-parameter form). Only the parameters the engine owns
    count (a frozen one has no settings to take). A group that is no saved group but lies within
    one (the ``Trainer``'s decay and no-decay groups, saved as DeepSpeed's one group) takes that
    group's settings, as the saved run applied them, with a warning (rank 0); one spread over
    saved groups whose settings differ keeps its own. ``{}``: a group keeps its own settings;
    None: the checkpoint saved none."""
    if not optimizers or not ckpt.groups:
        return None
    names = engine.param_names()
    of_master = {id(m): names[id(p)] for g in engine.groups for p, m in zip(g.params, g.masters)}
    groups = [group for opt in optimizers for group in opt.param_groups]
    if not all(k.isdigit() for k in ckpt.groups):
        out: list[dict[str, Any]] = []
        for group in groups:
            first = next((of_master[id(m)] for m in group["params"] if id(m) in of_master), None)
            out.append(ckpt.groups.get(first or "", {}))
        return out
    saved = [ckpt.groups[k] for k in sorted(ckpt.groups, key=int)]
    members = [s.get("params") for s in saved]
    if not all(isinstance(m, (list, tuple)) and all(isinstance(n, str) for n in m) for m in members):
        if len(saved) != len(groups):  # no membership saved: by index, when the counts agree
            if engine.world.rank != 0:
                return None
            warnings.warn(
                f"{caller}: the checkpoint has {len(saved)} optimizer parameter groups and the optimizer(s) "
                f"{len(groups)}; the settings (lr, ...) were not restored: the optimizer keeps its own",
                UserWarning,
                stacklevel=4,
            )
            return None
        return saved
    owned = set(of_master.values())  # a frozen parameter has no master: FSDP2 lists it in its group
    saved_names = [[n for n in (aliases.get(n, n) for n in m or ()) if n in owned] for m in members]
    index = {frozenset(m): i for i, m in enumerate(saved_names) if m}
    holder = {n: i for i, m in enumerate(saved_names) for n in m}
    empty = [i for i, m in enumerate(saved_names) if not m]  # matched by their order among the empty ones
    out = []
    regrouped: list[str] = []
    for j, group in enumerate(groups):
        own = [of_master[id(m)] for m in group["params"] if id(m) in of_master]
        i = index.get(frozenset(own)) if own else (empty.pop(0) if empty else None)
        if i is not None or not own:
            out.append(saved[i] if i is not None else {})
            continue
        covering = sorted({holder[n] for n in own if n in holder})
        unsaved = [n for n in own if n not in holder]
        settings = [{k: v for k, v in saved[k].items() if k != "params"} for k in covering]
        same = bool(settings) and not unsaved and all(s == settings[0] for s in settings)
        out.append(saved[covering[0]] if same else {})
        where = ", ".join(f"saved group {k} (first '{saved_names[k][0]}')" for k in covering) or "no saved group"
        regrouped.append(
            f"group {j} (first '{own[0]}', {len(own)} parameters) is within {where}"
            + (f", [{_short(unsaved)}] in none" if unsaved else "")
            + (": it takes that group's settings" if same else ": it keeps its own settings")
        )
    if regrouped and engine.world.rank == 0:
        warnings.warn(
            f"{caller}: the optimizer's parameter groups differ from the checkpoint's {ckpt.path!r} "
            f"({len(groups)} groups, {len(saved)} saved; e.g. DeepSpeed with a config optimizer block saves one group, "
            f"the Trainer builds decay and no-decay ones): {'; '.join(regrouped)}. Each parameter's optimizer state "
            "(moments, step) is loaded as saved; a group within one saved group takes its settings (lr, weight "
            "decay, ...) as the saved run used them. Set a group's settings after the load to change them",
            UserWarning,
            stacklevel=4,
        )
    return out


def _restore_groups(settings: list[dict[str, Any]] | None, optimizers: list[torch.optim.Optimizer]) -> None:
    """``settings`` (from :func:`_match_groups`) over the optimizers' groups, in order."""
    if settings is None:
        return
    k = 0
    for optimizer in optimizers:
        n = len(optimizer.param_groups)
        chosen = [{a: b for a, b in s.items() if b is not None and a != "params"} for s in settings[k : k + n]]
        restore_group_settings(optimizer, chosen)
        k += n


def import_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> dict[str, Any]:
    """Copy another engine's checkpoint ``src`` into a zero_strategy checkpoint root ``dst``: a
    versioned directory ``dst/step-<n>`` holding it in FSDP2's DCP layout (read back by
    :func:`load_foreign` at any world size and stage), zero_strategy's metadata (each file's size
    and CRC32; what was read) and the ``latest`` pointer. ``src``: a DCP directory (FSDP2's,
    torchtitan's: every tensor and plain value is copied) or a DeepSpeed ZeRO-1/2/3 checkpoint
    (``deepspeed_files.py``). One process, also when a process group exists (no collective); it
    holds the whole checkpoint in host memory. Entries
    whose values cannot be read without running code (a data loader's pickled state) are left
    out and named. Returns the report."""
    src, dst = os.fspath(src), os.fspath(dst)
    left_out: list[str] = []
    origin: dict[str, Any] = {}
    if is_foreign_dcp(src):
        sd = _read_whole(src, left_out)
    elif is_deepspeed_checkpoint(src):
        sd, origin = read_deepspeed(src)
    else:
        raise ValueError(
            f"import-checkpoint: {src!r} is neither another engine's DCP checkpoint (a {DCP_METADATA} file and no "
            f"{META}) nor a DeepSpeed one (latest and global_step*/ with *_optim_states.pt); pass the directory the "
            "other engine saved (a zero_strategy checkpoint loads as it is)"
        )
    # the Adam states' step (optim.state.<name>.step), not a param group's (FusedAdam keeps an int 0 there)
    steps = [int(v.item()) if isinstance(v, torch.Tensor) else int(v) for k, v in sd.items()
             if k.split(".")[0] in _OPTIM_TOPS and k.split(".")[1:2] == ["state"] and k.endswith(".step")
             and isinstance(v, (torch.Tensor, int, float))]  # fmt: skip
    train = sd.get("train_state.step", origin.get("global_steps"))
    step = max(steps) if steps else (int(train) if isinstance(train, (int, torch.Tensor)) else None)
    name = _create_version_dir(dst, f"step-{step if step is not None else 0}", False)
    path = os.path.join(dst, name)
    writer, sums, _ = checksumming_writer(path)
    with single_process_quiet():  # no_dist: one process writes, also beside a process group (the Trainer's resume)
        dcp.save(sd, storage_writer=writer, no_dist=True)
    written = read_foreign(path)
    report = written.summary()
    report.update(
        path=src,
        step=step,
        scheduler={k: v for k, v in written.objects.items() if k.split(".", 1)[0] in ("lr_scheduler", "lr_schedulers")},
        left_out=left_out,
        **origin,
    )
    if origin:
        report["layout"] = "deepspeed"
    files = {n: {"size": os.path.getsize(os.path.join(path, n)), "crc32": sums[n]} for n in sorted(sums)}
    meta = {IMPORTED: os.path.abspath(src), "import_report": report, "files": files, "extra": {}}
    write_atomic(os.path.join(path, META), json.dumps(meta, indent=1, default=str))
    write_atomic(os.path.join(dst, LATEST), name + "\n")
    report["written"] = path
    return report


def _read_whole(src: str, left_out: list[str]) -> dict[str, Any]:
    """Every entry of a DCP directory, in full (``left_out``: those not readable without code)."""
    ckpt = read_foreign(src)
    entries = ckpt.metadata.state_dict_metadata
    sd: dict[str, Any] = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in entries.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with single_process_quiet():
        dcp.load(sd, storage_reader=SafeFileSystemReader(src, bytes_entries=True), no_dist=True)
    reader = SafeFileSystemReader(src, bytes_entries=True)
    for key, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            value = read_bytes_entry(reader, ckpt.metadata, key)
            if value is None:
                left_out.append(key)
            else:
                sd[key] = value
    return sd
