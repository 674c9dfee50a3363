"""``ZeroPlugin``: the settings of the ZeRO engine for a Hugging Face Accelerate loop.

Accelerate 1.x has no plugin registry and its config YAML refuses unknown keys, so this is
*not* an Accelerate ``*Plugin`` that ``Accelerator(...)`` accepts. It is built next to the
Accelerator and then prepares the model and optimizer for it::

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    plugin = ZeroPlugin.from_env()            # ZERO_STRATEGY_CONFIG=zero3.yaml, ZERO_STRATEGY_STAGE=...
    model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)

Only the public API of ``zero_strategy`` is used. This module does not import Accelerate:
``prepare`` hands the Accelerator to ``accelerate_zero.binding`` (imports point one way,
plugin -> binding).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
import yaml
from torch import nn

import zero_strategy as zs
from zero_strategy import resolve_overrides
from zero_strategy.config import frontend_precision
from zero_strategy.frontend import (
    apply_frontend_settings,
    format_precision_flags,
    parallelism_shard_size,
    split_shard_size,
)

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ZeroPlugin"]

ENV_PREFIX = "ZERO_STRATEGY_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
# ZeroConfig fields that an environment variable may set (nested blocks other than the
# precision name need a file).
_NESTED_ONLY = frozenset({"offload_optimizer", "offload_param", "loss_scale"})
_FIELDS = tuple(f.name for f in dataclasses.fields(zs.ZeroConfig) if not f.name.startswith("_"))
_ENV_FIELDS = tuple(n for n in _FIELDS if n not in _NESTED_ONLY)


def _env_value(name: str, raw: str) -> Any:
    """Read an environment string as YAML would (``true``, ``2``, ``1e9``, ``bf16``)."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if value is None or isinstance(value, (dict, list)):
        raise ValueError(
            f"{name}={raw!r}: expected a single value (a number, true/false or a name); "
            "nested settings go in the file named by " + CONFIG_ENV
        )
    return value


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        field = name[len(ENV_PREFIX) :].lower()
        if field not in _ENV_FIELDS:
            import difflib

            close = difflib.get_close_matches(field, _ENV_FIELDS, n=1)
            hint = (
                f"did you mean {ENV_PREFIX}{close[0].upper()}?"
                if close
                else (f"use {ENV_PREFIX}<FIELD> with a ZeroConfig field: {', '.join(f.upper() for f in _ENV_FIELDS)}")
            )
            raise ValueError(f"environment variable {name}={raw!r} is not a zero_strategy setting; {hint}")
        overrides[field] = _env_value(name, raw)
    return overrides


class ZeroPlugin:
    """ZeRO settings for an Accelerate loop; ``prepare`` hands the model to ``zero_strategy``.

    Args:
        config: a :class:`zero_strategy.ZeroConfig`, a dict (DeepSpeed key names), a path to a
            YAML/JSON file, or None for the defaults.
        policy: which modules form ZeRO-3 units, passed to ``zero_strategy.initialize``
            (a set of module classes such as ``{GPT2Block}``, or ``(module, name) -> bool``).
        **overrides: ZeroConfig fields given explicitly (``stage=3``); a different value for
            the same field in the file raises. ``shard_size`` also takes a 2-D
            ``DeviceMesh`` (dim 0 replicate, dim 1 shard), handed to ``zero_strategy.initialize``.

    ``Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=R, dp_shard_size=S))``
    is read as ``shard_size=S`` (tensor/context parallelism is refused).
    """

    def __init__(self, config: Any = None, *, policy: Any = None, **overrides: Any) -> None:
        cfg = zs.ZeroConfig.coerce(config)
        self.mesh: Any = None  # a DeviceMesh given as shard_size
        if "shard_size" in overrides:
            overrides["shard_size"], self.mesh = split_shard_size(overrides["shard_size"], "ZeroPlugin(shard_size=...)")
        if overrides:
            cfg = resolve_overrides(cfg, source="ZeroPlugin(...) keyword arguments", **overrides)
        self.config: zs.ZeroConfig = cfg
        self.policy = policy

    def __repr__(self) -> str:
        return f"ZeroPlugin(stage={self.config.stage}, policy={self.policy!r})"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, policy: Any = None, **overrides: Any) -> ZeroPlugin:
        """From a YAML/JSON file with DeepSpeed key names (``zero_optimization: {stage: 3}``)."""
        return cls(zs.ZeroConfig.from_file(path), policy=policy, **overrides)

    @classmethod
    def from_env(cls, *, policy: Any = None, environ: Mapping[str, str] | None = None) -> ZeroPlugin:
        """From the environment, as Accelerate reads its own ``FSDP_*`` variables:
        ``ZERO_STRATEGY_CONFIG`` names a config file or a built-in preset (``zero3``; optional) and ``ZERO_STRATEGY_<FIELD>``
        sets one ZeroConfig field (``ZERO_STRATEGY_STAGE=3``, ``ZERO_STRATEGY_PRECISION=bf16``,
        ``ZERO_STRATEGY_OVERLAP_COMM=false``). A missing file, an unknown key in it, an unknown
        variable or a bad value raises here, before any training starts."""
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_ENV)
        if path is not None and not path.strip():
            raise ValueError(f"{CONFIG_ENV} is set but empty; give the path of a .yaml/.json config file or unset it")
        try:
            config = zs.ZeroConfig.from_file(path) if path else None
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{CONFIG_ENV}={path!r}: the file does not exist; {exc}") from None
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{CONFIG_ENV}={path!r}: {exc}") from None
        overrides = _env_overrides(env)
        try:
            return cls(config, policy=policy, **overrides)
        except (ValueError, TypeError) as exc:
            names = ", ".join(f"{ENV_PREFIX}{k.upper()}" for k in overrides)
            raise type(exc)(f"{exc} (environment: {names})") from None

    # -- preparing -----------------------------------------------------------------------
    def resolved_config(self, accelerator: Any) -> zs.ZeroConfig:
        """The engine's config with the Accelerator's settings applied: its ``mixed_precision``
        keeps Accelerate's meaning, autocast over fp32 parameters ("bf16" is the engine's
        "bf16-mixed"; a precision Accelerate itself does not apply, fp16 on a CPU, is "not
        given"), and its ``gradient_accumulation_steps`` must agree with the file's (a
        different value raises). Accelerate's defaults ("no", 1) count as "not given", as
        Lightning's do: the file's values then apply. Its ``parallelism_config`` with
        ``dp_shard_size > 1`` gives ``shard_size`` (a different value in the file raises)."""
        mp = str(accelerator.mixed_precision)
        try:
            name = frontend_precision("accelerate", mp)
        except ValueError:
            raise ValueError(
                f"Accelerator(mixed_precision={mp!r}) is not supported by ZeroPlugin; "
                f"use {format_precision_flags('accelerate')}"
            ) from None
        if not getattr(accelerator, "native_amp", True):
            name = None  # Accelerate's DDP path runs this in fp32 here (fp16 needs a GPU): so does the engine
        gas = int(accelerator.gradient_accumulation_steps)
        source = f"Accelerator(mixed_precision={mp!r}, gradient_accumulation_steps={gas})"
        pc = getattr(accelerator, "parallelism_config", None)
        shard = parallelism_shard_size(pc, "ZeroPlugin.prepare()")
        if shard is not None:
            source = f"{source[:-1]}, parallelism_config=ParallelismConfig(dp_shard_size={shard}))"
        return apply_frontend_settings(self.config, source=source, precision=name, accumulation=gas, shard_size=shard)

    def prepare(self, accelerator: Any, *objects: Any) -> Any:
        """Like ``accelerator.prepare(*objects)``, with each model and its optimizer handed to
        ``zero_strategy.initialize`` instead of DDP. Returns the objects in the same order
        (a single object if one was given)."""
        from accelerate_zero.binding import check_accelerator, prepare_with_zero  # Accelerate: imported here

        check_accelerator(accelerator)
        pairs = pair_models_and_optimizers(objects)
        return prepare_with_zero(
            accelerator, objects, pairs, self.resolved_config(accelerator), self.policy, mesh=self.mesh
        )


def pair_models_and_optimizers(objects: tuple[Any, ...]) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
    """Every model among ``objects`` with the optimizers built on its parameters, in the order
    given (none: the model is prepared without one, for evaluation or for gradients read
    elsewhere; several: they step disjoint parameters of the model, a GAN's generator and
    discriminator, which ``zero_strategy.initialize`` checks). Models and optimizers that
    ``accelerator.prepare`` has already seen are refused."""
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if not models:
        raise ValueError(
            "ZeroPlugin.prepare(accelerator, *objects): no model among the objects; pass the model(s) with their "
            "optimizer(s) (prepare data loaders and schedulers alone with accelerator.prepare)"
        )
    owner: dict[int, int] = {}
    for k, m in enumerate(models):
        for p in m.parameters():
            if owner.setdefault(id(p), k) != k:
                raise ValueError(
                    f"ZeroPlugin.prepare(): {type(models[owner[id(p)]]).__name__} and {type(m).__name__} share a "
                    "parameter; two engines would reduce and step it twice. Prepare one module that holds both "
                    "(e.g. an nn.ModuleDict)"
                )
    paired: dict[int, list[torch.optim.Optimizer]] = {}
    no_model = -1  # the owner of a parameter that is in no model given here
    for opt in optimizers:
        ks = {owner.get(id(p), no_model) for g in opt.param_groups for p in g["params"]}
        if len(ks) != 1 or no_model in ks:
            raise ValueError(
                "ZeroPlugin.prepare(): an optimizer holds parameters of "
                + ("no model given here" if no_model in ks else f"{len(ks)} of the models given")
                + "; build each optimizer on the parameters of one model and pass that model too"
            )
        paired.setdefault(ks.pop(), []).append(opt)
    pairs = [(m, paired.get(k, [])) for k, m in enumerate(models)]
    for model, opts in pairs:
        if any(getattr(o, "_is_accelerate_prepared", False) for o in (model, *opts)):
            raise ValueError(
                "ZeroPlugin.prepare(): the model or optimizer was already passed to accelerator.prepare (DDP-wrapped); "
                "pass the plain model and optimizer to ZeroPlugin.prepare instead"
            )
    return pairs
