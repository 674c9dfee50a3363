"""The Hugging Face ``Trainer`` on the ZeRO engine, with no change to the script.

The ``Trainer`` (transformers 5.x) builds its own Accelerator and, on its DDP path, prepares
the model with its optimizer in one ``accelerator.prepare(model, optimizer)`` call: the start-up
hook already routes that call to the engine (``accelerate_zero._routing``). What the hook
cannot reach through Accelerate is the ``Trainer``'s own checkpointing, which on the DDP path
is written for full replicas: rank 0 alone calls ``model.state_dict()`` and
``optimizer.state_dict()`` and never calls ``accelerator.save_state``. On the engine a rank
holds only shards, so rank 0 alone would save a marker for the optimizer (resuming would then
silently restart the optimizer) and, at ZeRO-3, refuse the model's placeholders while the other
ranks wait in the next barrier.

So when ``transformers.trainer`` is imported with ``ZERO_STRATEGY_CONFIG`` set, the start-up
hook wraps these ``Trainer`` methods (``wrap_trainer``); each one acts only on a model that the
engine prepared and calls the ``Trainer``'s own method otherwise::

    create_accelerator_and_postprocess   refuses TrainingArguments(deepspeed=..., fsdp=...) and
                                         an Accelerate config with DeepSpeed or FSDP: two engines
    save_model                           ZeRO-3: full weights gathered on every rank (a
                                         collective), written by the saving rank with
                                         save_pretrained; ZeRO-1/2: the Trainer's own (weights are whole)
    _save_optimizer_and_scheduler        checkpoint-N/zero_strategy/: the sharded fp32 masters and
                                         optimizer state (zero_strategy.save_checkpoint, every rank),
                                         loadable at any number of processes; scheduler.pt as before
    _load_from_checkpoint                a checkpoint with zero_strategy/ or DeepSpeed's global_step*/:
                                         nothing before prepare (the shards are loaded once the
                                         model is on the engine)
    _load_optimizer_and_scheduler        the shards (masters, optimizer state, lr) and scheduler.pt;
                                         a checkpoint DeepSpeed wrote is converted into zero_strategy/
                                         first, once (``_deepspeed_resume.py``)
    _load_best_model                     the best checkpoint's shards (masters only)

Checkpoints keep the ``Trainer``'s layout (``config.json``, ``model.safetensors`` with the full
weights, ``trainer_state.json``, ``scheduler.pt``, ``rng_state_<rank>.pth``), so rotation by
``save_total_limit``, ``from_pretrained`` on a checkpoint and ``get_last_checkpoint`` work as
before; ``optimizer.pt`` is replaced by ``zero_strategy/``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from accelerate_zero._deepspeed_resume import (
    continue_scheduler,
    deepspeed_scheduler_state,
    describe,
    import_deepspeed,
    is_deepspeed_checkpoint,
)
from accelerate_zero._routing import TRAINER_ATTR
from accelerate_zero.plugin import CONFIG_ENV
from zero_strategy.runtime.module import get_engine

__all__ = ["ZERO_DIR", "refuse_other_engines", "wrap_trainer"]

ZERO_DIR = "zero_strategy"  # inside checkpoint-N: the sharded model and optimizer state
_MARK = "_zero_strategy_trainer"
_SAFE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def _requested() -> bool:
    return bool(os.environ.get(CONFIG_ENV))


def refuse_other_engines(args: Any, *, deepspeed_enabled: bool = False, fsdp_enabled: bool = False) -> None:
    """Raise if the ``Trainer`` would also run DeepSpeed or FSDP: ``TrainingArguments(deepspeed=...)``,
    ``TrainingArguments(fsdp=...)``, or an Accelerate config that enables either."""
    asked = []
    if getattr(args, "deepspeed", None):
        asked.append(("DeepSpeed", f"TrainingArguments(deepspeed={args.deepspeed!r})"))
    elif deepspeed_enabled:
        asked.append(("DeepSpeed", "the Accelerate config (distributed_type: DEEPSPEED)"))
    if getattr(args, "fsdp", None):
        asked.append(("FSDP", f"TrainingArguments(fsdp={args.fsdp!r})"))
    elif fsdp_enabled:
        asked.append(("FSDP", "the Accelerate config (distributed_type: FSDP)"))
    if asked:
        engine, where = asked[0]
        raise ValueError(
            f"Trainer: {CONFIG_ENV}={os.environ.get(CONFIG_ENV)!r} asks for the zero_strategy ZeRO engine and "
            f"{where} asks for {engine}; both shard the same model, so use one of them: drop the {engine} settings "
            f"to train on zero_strategy, or unset {CONFIG_ENV} (launch without --zero-config) to train with {engine}"
        )


def _ours(trainer: Any) -> tuple[nn.Module, torch.optim.Optimizer | None] | None:
    """The Trainer's model and the engine's optimizer, if the engine prepared the model."""
    binding = getattr(getattr(trainer, "accelerator", None), "_zero_binding", None)
    if binding is None or getattr(trainer, "model", None) is None:
        return None
    found = binding.entry_of(trainer.model)
    return None if found is None else (found[1], found[2])


def _sharded_parameters(model: nn.Module) -> bool:
    return int(get_engine(model).config.stage) == 3


def _shards(checkpoint: str, model: nn.Module, call: str, logger: Any) -> tuple[str, dict[str, Any] | None]:
    """``checkpoint/zero_strategy``, converted from DeepSpeed's files first if the ``Trainer`` wrote
    ``checkpoint`` under DeepSpeed (collective then), and the conversion's report (None: not DeepSpeed's)."""
    shards = os.path.join(checkpoint, ZERO_DIR)
    if not is_deepspeed_checkpoint(checkpoint):
        return shards, None
    report = import_deepspeed(checkpoint, shards, model, call)
    if report is not None and get_engine(model).world.rank == 0:
        logger.warning(describe(report, checkpoint, shards))
    return shards, report


@contextlib.contextmanager
def _every_node_writes(model: nn.Module, each_node: bool) -> Iterator[None]:
    """With ``save_on_each_node``, ``save_pretrained(is_main_process=should_save)`` writes on each
    node's first process: transformers' ``should_save_on_this_rank`` would also require global
    rank 0 whenever torch.distributed is initialized, so the other nodes wrote nothing."""
    if not each_node or not hasattr(model, "should_save_on_this_rank"):
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process  # type: ignore[assignment]  # this instance
    try:
        yield
    finally:
        delattr(model, "should_save_on_this_rank")


def wrap_trainer(module: ModuleType) -> None:
    """Wrap ``module.Trainer``'s checkpoint methods (``module`` is ``transformers.trainer``). Idempotent."""
    cls = module.Trainer
    if getattr(cls, _MARK, False):
        return
    names = {"optimizer": module.OPTIMIZER_NAME, "scheduler": module.SCHEDULER_NAME}
    reissue = module.reissue_pt_warnings
    logger = module.logger

    def wrap(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        original = getattr(cls, name)

        def decorate(new: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                return new(self, original, *args, **kwargs)

            setattr(cls, name, method)
            return method

        return decorate

    @wrap("create_accelerator_and_postprocess")
    def _create(self: Any, original: Callable[..., Any]) -> None:
        if _requested():
            refuse_other_engines(self.args)
        original(self)
        if _requested():
            # prepare_model(evaluation_mode=True) shards a second model (TRL's ref_model), not this one
            self.accelerator.__dict__[TRAINER_ATTR] = weakref.ref(self)
            refuse_other_engines(self.args, deepspeed_enabled=self.is_deepspeed_enabled,
                                 fsdp_enabled=self.is_fsdp_enabled)  # fmt: skip

    @wrap("save_model")
    def _save_model(self: Any, original: Callable[..., Any], output_dir: str | None = None,
                    _internal_call: bool = False) -> None:  # fmt: skip
        ours = _ours(self)
        each_node = bool(getattr(self.args, "save_on_each_node", False))
        if ours is None or not (_sharded_parameters(ours[0]) or each_node):
            return original(self, output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # a collective: every rank gathers each tensor; the ranks that save (should_save) keep them
        state_dict = zs.full_state_dict(ours[0], rank0_only=not each_node) if _sharded_parameters(ours[0]) else None
        with _every_node_writes(self.accelerator.unwrap_model(self.model, keep_torch_compile=False), each_node):
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    @wrap("_save_optimizer_and_scheduler")
    def _save_opt(self: Any, original: Callable[..., Any], output_dir: str) -> None:
        ours = _ours(self)
        if ours is None:
            return original(self, output_dir)
        model, optimizer = ours
        zs.save_checkpoint(os.path.join(output_dir, ZERO_DIR), model, optimizer,
                           extra={"global_step": int(self.state.global_step)}, keep_last=1)  # fmt: skip
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, names["scheduler"]))
            reissue(caught)
        return None

    @wrap("_load_from_checkpoint")
    def _load_weights(self: Any, original: Callable[..., Any], resume_from_checkpoint: str,
                      model: nn.Module | None = None) -> None:  # fmt: skip
        if _requested() and (os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_DIR))
                             or is_deepspeed_checkpoint(resume_from_checkpoint)):  # fmt: skip
            target = self.model if model is None else model
            if getattr(target, "_zero_engine", None) is not None:
                call = f"Trainer._load_from_checkpoint({resume_from_checkpoint!r})"
                zs.load_checkpoint(_shards(resume_from_checkpoint, target, call, logger)[0], target, None)
            # else: before prepare; the shards are loaded with the optimizer's once the model is on the engine
            return None
        return original(self, resume_from_checkpoint, model)

    @wrap("_load_optimizer_and_scheduler")
    def _load_opt(self: Any, original: Callable[..., Any], checkpoint: str | None) -> None:
        if checkpoint is None:
            return original(self, checkpoint)
        ours = _ours(self)
        shards = os.path.join(checkpoint, ZERO_DIR)
        if ours is None:
            if os.path.isdir(shards) and not is_deepspeed_checkpoint(checkpoint):  # DeepSpeed's own resume
                raise ValueError(
                    f"Trainer.train(resume_from_checkpoint={checkpoint!r}): the checkpoint holds zero_strategy shards "
                    f"({ZERO_DIR}/) and no optimizer.pt, but this run's model is not on the ZeRO engine; resume it "
                    f"with {CONFIG_ENV} set (zero-strategy launch --zero-config FILE)"
                )
            return original(self, checkpoint)
        model, optimizer = ours
        call = f"Trainer.train(resume_from_checkpoint={checkpoint!r})"
        shards, imported = _shards(checkpoint, model, call, logger)
        if not os.path.isdir(shards):
            if os.path.isfile(os.path.join(checkpoint, names["optimizer"])):
                raise ValueError(
                    f"Trainer.train(resume_from_checkpoint={checkpoint!r}): the checkpoint was written without the "
                    f"ZeRO engine (a full optimizer.pt, no {ZERO_DIR}/); the ZeRO optimizer loads sharded state only. "
                    f"Resume it without {CONFIG_ENV}, or start from its weights (from_pretrained) with a fresh optimizer"
                )
            return original(self, checkpoint)  # a model-only checkpoint: nothing to load, as the Trainer does
        with warnings.catch_warnings():
            if imported is not None:  # its LR scheduler's state, if any, is restored below
                warnings.filterwarnings("ignore", message=".*is another engine's checkpoint")
            zs.load_checkpoint(shards, model, optimizer)  # masters, optimizer state and lr, at any number of processes
        scheduler_file = os.path.join(checkpoint, names["scheduler"])
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            reissue(caught)
        elif imported is not None:  # DeepSpeed kept it (no scheduler.pt)
            saved = deepspeed_scheduler_state(shards, call)
            line = continue_scheduler(self.lr_scheduler, saved, int(imported.get("step") or 0), call)
            if line is not None and self.args.process_index == 0:
                logger.warning(line)
        return None

    @wrap("_load_best_model")
    def _load_best(self: Any, original: Callable[..., Any]) -> None:
        ours = _ours(self)
        best = self.state.best_model_checkpoint
        if ours is None:
            return original(self)
        model = ours[0]
        shards, _ = _shards(best, model, f"Trainer._load_best_model({best!r})", logger)
        if os.path.isdir(shards):
            logger.info(f"Loading best model from {best} (score: {self.state.best_metric}), zero_strategy shards.")
            zs.load_checkpoint(shards, model, None)  # the masters; the optimizer is kept
            return None
        for name in _SAFE_WEIGHTS:  # a model-only checkpoint (save_only_model=True): its full weights
            if os.path.isfile(os.path.join(best, name)):
                zs.load_full_state_dict(model, os.path.join(best, name))  # strict: a tied weight may come once
                return None
        return original(self)

    setattr(cls, _MARK, True)
