"""Resuming a ``Trainer`` checkpoint that DeepSpeed wrote, on the ZeRO engine.

A run that started as ``train.py --deepspeed ds_config.json`` and moves to ``zero-strategy launch
--zero-config ds_config.json train.py`` passes ``--resume_from_checkpoint out/checkpoint-N``: a
directory the ``Trainer`` wrote under DeepSpeed. It holds the ``Trainer``'s own files
(``trainer_state.json``, the rng states, which the ``Trainer`` reads itself; ``scheduler.pt`` when
the LR scheduler is the ``Trainer``'s, as with a config without a ``scheduler`` block; the full
weights at stages 1/2 only) and DeepSpeed's ``latest`` and ``global_stepN/``: the fp32 master
partitions, the Adam moments and step, the param-group settings (and the state of DeepSpeed's own
scheduler, if the config had one). None of it is an ``optimizer.pt``, so the ``Trainer``'s own
code would resume on the engine with the weights alone (a fresh Adam, the schedule restarted from
warm-up) at stages 1/2 and find no weights at all at stage 3.

So the first resume converts it once: rank 0 runs ``zero_strategy.checkpoint.import_checkpoint``
(``deepspeed_files.py`` reads the partitions) into ``checkpoint-N/zero_strategy/``, beside
DeepSpeed's files and in the place where the engine's own checkpoints keep their shards, while the
other ranks wait in a collective that also tells them if it failed; then every rank loads it as
any zero_strategy checkpoint, at any number of processes and stage. A later resume of the same
checkpoint finds the converted shards and reads them directly. DeepSpeed's files are not changed,
so the directory still resumes under DeepSpeed.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from zero_strategy.checkpoint.deepspeed_files import is_deepspeed_checkpoint
from zero_strategy.checkpoint.foreign import import_checkpoint, read_foreign
from zero_strategy.checkpoint.versions import LATEST, read_meta
from zero_strategy.comm import collectives as C
from zero_strategy.runtime.module import get_engine

__all__ = ["continue_scheduler", "deepspeed_scheduler_state", "describe", "import_deepspeed", "is_deepspeed_checkpoint"]

_IMPORT = "zero-strategy import-checkpoint"


def _converted(shards: str) -> bool:
    """Whether ``shards`` is a finished conversion or save (its ``latest`` pointer is written last)."""
    return os.path.isfile(os.path.join(shards, LATEST))


def describe(report: dict[str, Any], checkpoint: str, shards: str) -> str:
    """The log line: what was read from DeepSpeed's files."""
    optim = report.get("optimizer_state") or {}
    return (
        f"zero-strategy: {checkpoint!r} is a DeepSpeed checkpoint (ZeRO-{report.get('deepspeed_stage')}, "
        f"{report.get('deepspeed_world_size')} ranks, {report.get('tag')}, DeepSpeed {report.get('ds_version')}); "
        f"resuming from its conversion {shards!r}: {report.get('model_tensors')} fp32 master tensors "
        f"({report.get('model_elements')} elements), optimizer state {optim.get('keys')} of "
        f"{optim.get('parameters')} parameters at step {report.get('step')}, {report.get('param_groups')} param "
        "groups' settings"
    )


def import_deepspeed(checkpoint: str, shards: str, model: nn.Module, call: str) -> dict[str, Any] | None:
    """Convert ``checkpoint`` (DeepSpeed's ``latest`` and ``global_step*/``) into ``shards`` once:
    rank 0 writes, every rank learns whether it worked (a collective on the engine's group of
    ``model``). Returns the conversion's report (what was read), or None if ``shards`` is the
    engine's own save (a zero_strategy run wrote into the same directory)."""
    world = get_engine(model).world
    error: BaseException | None = None
    report: dict[str, Any] = {}
    if world.rank == 0 and not _converted(shards):
        try:
            report = import_checkpoint(checkpoint, shards)
        except OSError as exc:
            error = type(exc)(  # PermissionError, FileExistsError (a file where the directory goes), ...
                f"{call}: the checkpoint is DeepSpeed's (latest, global_step*/); the ZeRO engine reads it once "
                f"converted into {shards!r}, which could not be written ({exc}). Copy the checkpoint directory "
                f"somewhere writable and resume from the copy (it is converted there), or convert it in place as a "
                f"user who can write it: `{_IMPORT} {checkpoint} {shards}`"
            )
        except ValueError as exc:  # what deepspeed_files.py cannot read, named there
            error = ValueError(f"{call}: {exc}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException (a BaseException), a file laid out otherwise
            first = (str(exc).splitlines() or [""])[0][:300]
            error = RuntimeError(
                f"{call}: converting the DeepSpeed checkpoint {checkpoint!r} into {shards!r} failed "
                f"({type(exc).__name__}: {first}). Run the conversion alone before relaunching, to see the whole "
                f"error: `{_IMPORT} {checkpoint} {shards}`"
            )
            error.__cause__ = exc
    C.agree_on_failure(world, error, what="converting the DeepSpeed checkpoint", call=call)
    if not report:
        report = read_meta(shards, call)[1].get("import_report") or {}
    return report or None


def deepspeed_scheduler_state(shards: str, call: str) -> dict[str, Any]:
    """The LR scheduler's state DeepSpeed kept in its model states file (its engine's scheduler:
    the config's ``scheduler`` block, or a client scheduler), by key; empty if it kept none."""
    path, _ = read_meta(shards, call)
    prefix = "lr_scheduler."
    return {k[len(prefix) :]: v for k, v in read_foreign(path).objects.items() if k.startswith(prefix)}


def continue_scheduler(scheduler: Any, saved: dict[str, Any], step: int, call: str) -> str | None:
    """Restore the ``Trainer``'s LR ``scheduler`` from the state DeepSpeed's engine kept (``saved``),
    at optimizer step ``step``. The same kind of scheduler (a client scheduler DeepSpeed stepped)
    loads as it is. DeepSpeed's own (the config's ``scheduler`` block, which the ZeRO engine does
    not run: the ``Trainer`` builds its own from ``--lr_scheduler_type``) cannot; the ``Trainer``'s
    schedule continues at DeepSpeed's counter instead (``last_batch_iteration``: it starts at -1,
    so after N steps it is N - 1 and the next learning rate is the schedule's at N - 1; the
    ``Trainer``'s "auto" ``WarmupDecayLR`` and ``linear`` are the same function of it). Returns a
    line to log for the latter."""
    if not saved or scheduler is None:
        return None
    scheduler = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps it
    own = scheduler.state_dict()
    if set(saved) == set(own):
        scheduler.load_state_dict(saved)
        return None
    if not isinstance(scheduler, LambdaLR):  # the Trainer's own schedules: a closed form at last_epoch
        raise ValueError(
            f"{call}: DeepSpeed's checkpoint holds its LR scheduler's state ({sorted(saved)}), which the Trainer's "
            f"{type(scheduler).__name__} (state {sorted(own)}) cannot continue from; resume under DeepSpeed, or load "
            "the weights alone (from_pretrained on the checkpoint) and start a new schedule"
        )
    counter = saved.get("last_batch_iteration")
    at = counter if isinstance(counter, int) and not isinstance(counter, bool) else step
    deepspeeds = [group["lr"] for group in scheduler.optimizer.param_groups]  # restored from its checkpoint
    own.update(last_epoch=at, _step_count=at + 1)
    scheduler.load_state_dict(own)
    lrs = [base * f(at) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)
    return (
        f"zero-strategy: {call}: DeepSpeed ran its own LR scheduler (the config's scheduler block; state "
        f"{saved}), which the ZeRO engine leaves to the Trainer: its {type(scheduler).__name__} "
        f"(--lr_scheduler_type) continues at {at}, next lr {lrs} (DeepSpeed's next: {deepspeeds})"
    )
