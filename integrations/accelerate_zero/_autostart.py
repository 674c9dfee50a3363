"""The start-up hook: an unmodified Accelerate script trains on the ZeRO engine.

Accelerate's own DeepSpeed and FSDP plugins switch engines through the launch config alone;
Accelerate 1.x has no registry through which a third engine could do the same. So the package
installs one line into ``site-packages`` (``zero_strategy_accelerate.pth``), which Python runs at
every interpreter start::

    ZERO_STRATEGY_CONFIG unset -> nothing (one dictionary lookup; no import)
    ZERO_STRATEGY_CONFIG set   -> install(): when ``accelerate.accelerator`` is imported, its
                                  ``Accelerator.prepare`` and ``prepare_model`` are wrapped

``zero-strategy launch --zero-config FILE`` sets the variable for the processes it starts, and
``ZERO_STRATEGY_CONFIG=FILE accelerate launch train.py`` does the same by hand. With the
variable set:

- ``accelerator.prepare(model, optimizer, loader, scheduler)`` hands every model that has not
  been prepared yet, with its optimizer, to ``ZeroPlugin.from_env().prepare`` (the same path as
  the explicit plugin; loaders and schedulers go to Accelerate as usual). One plugin is read per
  Accelerator, so a bad file or variable fails at the first ``prepare``.
- An optimizer prepared in a later call than its model is refused: the engine shards the
  optimizer as it takes the model, so both must come in one call.
- ``accelerator.prepare_model(model, evaluation_mode=True)`` at ZeRO-3 (how TRL's trainers
  prepare a ``ref_model`` or reward model outside DeepSpeed and FSDP) hands a fresh model to the
  engine without an optimizer, so its memory is sharded too, as DeepSpeed's inference ZeRO-3
  engine does (TRL's ``prepare_deepspeed``); a ``Trainer``'s own model (its ``evaluate()``
  before ``train()``) and every model below ZeRO-3 keep Accelerate's plain evaluation prepare.
- **Never silently DDP**: a model that Accelerate still wraps in ``DistributedDataParallel``
  (``accelerator.prepare_model(model)`` called directly, for example) raises, naming the call.

The explicit ``ZeroPlugin(...).prepare(accelerator, ...)`` keeps working with the variable set:
the models it hands back to ``accelerator.prepare`` are already prepared and pass through.

The same hook wraps the Hugging Face ``Trainer`` when ``transformers.trainer`` is imported: its
``accelerator.prepare(model, optimizer)`` is routed as above, and its checkpoint methods are
replaced by ones that every rank runs (``accelerate_zero.trainer``). At ZeRO-3 it also wraps
``PreTrainedModel.from_pretrained`` when ``transformers.modeling_utils`` is imported, so the
model is built in pieces read from its files (``accelerate_zero._pretrained``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["PTH_NAME", "REQUEST_ENV", "install", "installed", "requested"]

REQUEST_ENV = "ZERO_STRATEGY_CONFIG"  # the same variable ZeroPlugin.from_env reads
PTH_NAME = "zero_strategy_accelerate.pth"  # the start-up line, installed beside the packages
_TARGET = "accelerate.accelerator"
_TRAINER = "transformers.trainer"  # wrapped by accelerate_zero.trainer.wrap_trainer
_MODELING = "transformers.modeling_utils"  # from_pretrained, by accelerate_zero._pretrained
_MARK = "_zero_strategy_autostart"


def requested(environ: Any = None) -> bool:
    """Whether the environment asks for the ZeRO engine (``ZERO_STRATEGY_CONFIG`` is set)."""
    return bool((os.environ if environ is None else environ).get(REQUEST_ENV))


def installed() -> bool:
    """Whether this process's ``Accelerator`` class is wrapped (false before accelerate is imported)."""
    module = sys.modules.get(_TARGET)
    return bool(module is not None and getattr(getattr(module, "Accelerator", None), _MARK, False))


def install() -> None:
    """Wrap ``Accelerator.prepare``/``prepare_model`` now if accelerate is imported, else when it
    is. Idempotent (a venv's ``lib64`` link makes Python read the ``.pth`` twice)."""
    pending = False
    for name, attr in ((_TARGET, "Accelerator"), (_TRAINER, "Trainer"), (_MODELING, "PreTrainedModel")):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, attr):
            _patch(name, module)
        else:
            pending = True
    if pending and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _patch(name: str, module: ModuleType) -> None:
    if name == _TARGET:
        _wrap(module)
    elif name == _MODELING:  # at ZeRO-3 the model is built in pieces (accelerate_zero._pretrained)
        from accelerate_zero._pretrained import wrap_from_pretrained

        wrap_from_pretrained(module)
    else:  # the Trainer's wrappers import torch and the engine: loaded only when transformers.trainer is
        from accelerate_zero.trainer import wrap_trainer

        wrap_trainer(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``accelerate.accelerator`` (and ``transformers.trainer``) through the other finders
    and wraps its loader, so the class is patched right after its module runs (before the
    package's ``__init__`` re-exports it)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (_TARGET, _TRAINER, _MODELING):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module.__name__, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


def _wrap(module: ModuleType) -> None:
    cls = module.Accelerator
    if getattr(cls, _MARK, False):
        return
    original_prepare = cls.prepare
    original_prepare_model = cls.prepare_model

    @functools.wraps(original_prepare)
    def prepare(self: Any, *args: Any, device_placement: Any = None) -> Any:
        if not requested():  # the variable was unset after start-up: Accelerate's own prepare
            return original_prepare(self, *args, device_placement=device_placement)
        from accelerate_zero._routing import prepare_routed

        return prepare_routed(self, args, device_placement, original_prepare)

    @functools.wraps(original_prepare_model)
    def prepare_model(self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        from accelerate_zero._pretrained import built_in_pieces
        from accelerate_zero._routing import prepare_for_evaluation, prepare_routed, refuse_ddp

        if evaluation_mode and requested() and prepare_for_evaluation(self, model):
            return model  # sharded by the engine without an optimizer (a ZeRO-3 reference model)
        if requested() and built_in_pieces(model):  # pieces cannot run as a plain module: the engine takes it
            return prepare_routed(self, (model,), device_placement, original_prepare)
        result = original_prepare_model(self, model, device_placement, evaluation_mode)
        if requested():
            refuse_ddp(result, "accelerator.prepare_model(model)")
        return result

    cls.prepare = prepare
    cls.prepare_model = prepare_model
    setattr(cls, _MARK, True)
