"""A Hugging Face model built in pieces and loaded row by row from its files: ``from_pretrained``.

Transformers' own ZeRO-3 hook (``is_deepspeed_zero3_enabled()``, set by ``HfDeepSpeedConfig``)
switches on ``deepspeed.zero.Init`` and has rank 0 read every file whole; it needs DeepSpeed
itself, and its loader (``_load_state_dict_into_zero3_model``) is private. This module uses only
public API instead:

1. the model is built on the meta device (``torch.device("meta")``), in the requested dtype,
   so construction allocates nothing and runs no initialisation on full tensors;
2. each parameter's piece (its ``torch.chunk`` range of the flattened tensor, as
   ``sharded_init`` cuts it) is read from the checkpoint's files, memory-mapped: a safetensors
   slice of just the rows that hold the piece (several files with an index as well). The
   parameter becomes a placeholder with its piece recorded, exactly as if it had been built
   under ``sharded_init``, so ``initialize`` (or ``accelerator.prepare``, or Lightning) takes
   the pieces over and no rank ever holds the whole model;
3. persistent buffers are read whole (they are small); non-persistent ones (rotary
   ``inv_freq``) and parameters the files lack get real memory and Transformers' own
   ``initialize_weights``, which skips every tensor that was loaded (``_is_hf_initialized``,
   the flag its own loader sets); parameters it initialised are then cut. Tied weights are one
   parameter under several names and load from whichever name the files hold.

:func:`sharded_from_pretrained` is the context for unmodified code: inside it,
``AutoModel*.from_pretrained`` (any ``PreTrainedModel.from_pretrained``) comes here, and
``from_config`` or any other construction runs under ``sharded_init``. Lightning's
``configure_model`` and the ``zero-strategy launch`` start-up hook at stage 3 use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zero_strategy.checkpoint.multi_file import open_ranges
from zero_strategy.comm import collectives as C
from zero_strategy.sharding.construction import active_context, sharded_init, suspended_sharded_init
from zero_strategy.sharding.pieces import local_range, placeholder, record_piece, recorded
from zero_strategy.sharding.setup_checks import persistent_buffers
from zero_strategy.storage.host_memory import HostPeak

__all__ = ["PLACING_ARGUMENTS", "from_pretrained", "sharded_from_pretrained"]

# from_pretrained arguments that place, convert or quantize the weights themselves: no sharded load
PLACING_ARGUMENTS = ("device_map", "quantization_config", "tp_plan", "device_mesh", "state_dict", "gguf_file", "load_in_8bit",
            "load_in_4bit", "from_tf", "from_flax")  # fmt: skip
# arguments of the download and the config, which a local directory does not need
_HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "trust_remote_code",
        "use_safetensors", "weights_only", "variant", "_from_auto", "_from_pipeline", "_commit_hash", "proxies",
        "user_agent", "adapter_kwargs", "low_cpu_mem_usage", "key_mapping", "offload_folder", "offload_state_dict",
        "offload_buffers", "max_memory", "use_kernels", "kernel_config")  # fmt: skip


def _resolve_dir(path: str | os.PathLike[str], hub: dict[str, Any]) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        return os.path.join(path, hub["subfolder"]) if hub.get("subfolder") else path
    from huggingface_hub import snapshot_download

    return snapshot_download(
        path, revision=hub.get("revision"), cache_dir=hub.get("cache_dir"), token=hub.get("token"),
        local_files_only=bool(hub.get("local_files_only")),
        allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"],
    )  # fmt: skip


def _dtype(dtype: Any, config: Any, meta: dict[str, tuple[torch.Size, torch.dtype]]) -> torch.dtype:
    """``from_pretrained``'s rule: ``"auto"`` (the default) is the config's dtype, else the files'."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if getattr(config, "dtype", None) is not None:
            d = config.dtype
            return getattr(torch, d) if isinstance(d, str) else d
        return next((d for _, d in meta.values() if d.is_floating_point), torch.get_default_dtype())
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"from_pretrained(dtype={dtype!r}): give a torch.dtype, its name ('bfloat16') or 'auto'")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _file_key(name: str, keys: set[str], prefix: str) -> str | None:
    """The name ``name`` has in the files: the same, or without/with the base model's prefix
    (a base model's checkpoint loaded into a model with a head, and the other way round)."""
    if name in keys:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in keys:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}" in keys:
        return f"{prefix}.{name}"
    return None


def _set(model: nn.Module, name: str, value: torch.Tensor, *, buffer: bool) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if buffer:
        module._buffers[attr] = value
    else:
        module._parameters[attr] = value  # type: ignore[assignment]  # a Parameter (the callers make one)


def _cut(p: nn.Parameter, piece: torch.Tensor, ctx: C.CommContext) -> nn.Parameter:
    """A new parameter for meta ``p``: a placeholder with ``piece`` recorded, as ``sharded_init`` leaves one."""
    device = ctx.device if ctx.device.type != "cpu" else torch.device("cpu")
    new = nn.Parameter(placeholder(p.shape, p.dtype, device), requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # flags Transformers set on it
    record_piece(new, piece.to(device=device, dtype=p.dtype).contiguous(), ctx)
    return new


def _unexpected(model: Any, unused: set[str]) -> list[str]:
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}  # old buffers that Transformers ignores too
    rx = re.compile("|".join(f"({p})" for p in patterns))
    return sorted(k for k in unused if rx.search(k) is None)


def from_pretrained(
    model_class: Any,
    pretrained_model_name_or_path: str | os.PathLike[str],
    *model_args: Any,
    process_group: Any = None,
    comm_timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """``model_class.from_pretrained(path, ...)`` with every parameter cut to this rank's piece,
    read from the files row by row (collective only in that every rank calls it; no rank
    reads another's rows). ``model_class``: an ``AutoModel*`` class or a ``PreTrainedModel``
    subclass. Takes ``config``, ``dtype`` (or ``torch_dtype``; ``"auto"`` by default),
    ``output_loading_info``, ``ignore_mismatched_sizes``, the download arguments, and config
    overrides as ``from_pretrained`` does. The model comes back in eval mode, ready for
    ``initialize`` with the same process group (``process_group``; inside a ``sharded_init``
    block, that block's): it must be ZeRO-3 over those ranks, without shard groups."""
    call = f"zero_strategy.from_pretrained({getattr(model_class, '__name__', model_class)})"
    refused = [k for k in PLACING_ARGUMENTS if kwargs.get(k) is not None]
    if refused or model_args:
        what = refused or ["positional model arguments"]
        raise ValueError(
            f"{call}: {', '.join(what)} cannot be combined with a sharded load (they place or build the weights "
            "themselves); drop them, or load outside zero_strategy.sharded_from_pretrained() and the launcher's stage 3"
        )
    from transformers import AutoConfig, GenerationConfig

    hub = {k: kwargs.pop(k) for k in _HUB if k in kwargs}
    dtype = kwargs.pop("dtype", None)
    dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    ignore_mismatched = bool(kwargs.pop("ignore_mismatched_sizes", False))
    attn = kwargs.pop("attn_implementation", None)
    root = _resolve_dir(pretrained_model_name_or_path, hub)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config, kwargs = AutoConfig.from_pretrained(
            root if config is None else config, return_unused_kwargs=True,
            trust_remote_code=hub.get("trust_remote_code"), **kwargs,
        )  # fmt: skip
    for key, value in kwargs.items():  # what from_pretrained does with the remaining arguments
        if not hasattr(config, key):
            raise TypeError(
                f"{call}: unexpected argument {key!r} (neither a from_pretrained argument nor a config field)"
            )
        setattr(config, key, value)
    read, meta = open_ranges(root, call)
    dtype = _dtype(dtype, config, meta)
    config.dtype = dtype
    ctx = active_context() or C.make_context(process_group, comm_timeout, device=torch.empty(0).device)
    with suspended_sharded_init(), torch.device("meta"), _default_dtype(dtype):
        if hasattr(model_class, "from_config"):  # an Auto class
            model = model_class.from_config(config, dtype=dtype, **({"attn_implementation": attn} if attn else {}))
        else:
            if attn:
                config._attn_implementation = attn
            model = model_class(config)
    with suspended_sharded_init(), torch.no_grad():
        info = _load(model, read, meta, ctx, call, ignore_mismatched)
    model.eval()
    if getattr(model, "can_generate", lambda: False)():
        with contextlib.suppress(OSError, ValueError):
            model.generation_config = GenerationConfig.from_pretrained(root)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        warnings.warn(
            f"{call}: {type(model).__name__} loaded from {root!r} with missing keys {info['missing_keys'][:5]} "
            f"(initialised), unexpected keys {info['unexpected_keys'][:5]} (ignored), mismatched "
            f"{info['mismatched_keys'][:5]} (initialised); pass output_loading_info=True for the whole lists",
            stacklevel=2,
        )
    return (model, info) if output_loading_info else model


def _load(model: Any, read: Any, meta: dict, ctx: C.CommContext, call: str, ignore_mismatched: bool) -> dict:
    """Cut every meta parameter into its piece read from the files; buffers and what the files
    lack get Transformers' own initialisation (then cut)."""
    keys, used = set(meta), set[str]()
    trim = HostPeak()  # freed host memory is returned to the OS every few MB (malloc_trim)
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    missing: list[str] = []
    mismatched: list[str] = []
    fresh: list[tuple[nn.Parameter, list[str]]] = []  # parameters the files lack: initialised, then cut
    for pid, p in params.items():
        found = [(n, k) for n in names[pid] if (k := _file_key(n, keys, prefix)) is not None]
        if found and tuple(meta[found[0][1]][0]) != tuple(p.shape):
            if not ignore_mismatched:
                raise ValueError(
                    f"{call}: '{found[0][0]}' has shape {tuple(meta[found[0][1]][0])} in the files but "
                    f"{tuple(p.shape)} in the model; load weights of the same architecture or pass "
                    "ignore_mismatched_sizes=True"
                )
            mismatched.append(found[0][0])
            found = []
        if not found:
            missing.extend(names[pid])
            full = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
            full.__dict__.update(p.__dict__)
            for n in names[pid]:
                _set(model, n, full, buffer=False)
            fresh.append((full, names[pid]))
            continue
        used.update(k for _, k in found)
        lo, hi = local_range(p.numel(), ctx)
        rows = read(found[0][1], lo, hi)
        new = _cut(p, rows, ctx)
        if recorded(new).piece.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr():  # type: ignore[union-attr]
            trim.released(rows.untyped_storage().nbytes())  # converted (dtype): the read rows go back to the OS
        del rows
        new._is_hf_initialized = True  # type: ignore[attr-defined]  # Transformers' mark: its init skips it
        for n in names[pid]:
            _set(model, n, new, buffer=False)
    persistent = persistent_buffers(model)
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        k = _file_key(name, keys, prefix) if name in persistent else None
        value = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        if k is not None:
            used.add(k)
            value.copy_(read(k, 0, b.numel()).view(b.shape))
            value._is_hf_initialized = True  # type: ignore[attr-defined]  # Transformers' mark
        elif name in persistent:
            missing.append(name)
        _set(model, name, value, buffer=True)
    if hasattr(model, "initialize_weights"):  # what the files did not give: Transformers' own init
        model.initialize_weights()
    for full, pnames in fresh:  # every rank initialised it alike (seed them alike): keep the piece
        lo, hi = local_range(full.numel(), ctx)
        new = _cut(full, full.detach().reshape(-1)[lo:hi].clone(), ctx)
        for n in pnames:
            _set(model, n, new, buffer=False)
    return {"missing_keys": sorted(missing), "unexpected_keys": _unexpected(model, keys - used),
            "mismatched_keys": sorted(mismatched), "error_msgs": []}  # fmt: skip


@contextlib.contextmanager
def sharded_from_pretrained(*, process_group: Any = None, comm_timeout: float | None = None) -> Iterator[None]:
    """Inside, ``X.from_pretrained(path, ...)`` for any Transformers model class (``AutoModel*``
    included) is :func:`from_pretrained`: built in pieces, read row by row; and every other
    construction (``from_config``, ``MyModel()``) runs under ``sharded_init``. Collective as
    ``sharded_init`` is. Initialise the engine on the result at ZeRO-3 with the same group."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]

    def routed(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        return from_pretrained(cls, path, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(routed)  # type: ignore[method-assign,assignment]  # restored on exit
    try:
        with sharded_init(process_group=process_group, comm_timeout=comm_timeout):
            yield
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]  # restored on exit
