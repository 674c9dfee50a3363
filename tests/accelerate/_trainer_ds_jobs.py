"""An ordinary ``HfArgumentParser`` Trainer script, run by ``test_trainer_deepspeed_resume.py``.

:func:`train` is what a DeepSpeed user's ``train.py`` is: ``TrainingArguments`` from the command
line (``--deepspeed ds_config.json`` among them, or not), a small GPT-2 from a config, byte-level
text from the standard library (``examples/trainer_gpt2.py``'s ``ByteWindows``), ``trainer.train(
resume_from_checkpoint=args.resume_from_checkpoint)``, and ``trainer.state.log_history`` written
to ``<output_dir>/log_history.json``.

The launch runs several such scripts one after the other (a launch costs ~10 s): ``TRAINER_JOBS``
lists ``name=config`` pairs (``_trainer_jobs.jobs``: ``ddp`` removes ``ZERO_STRATEGY_CONFIG``,
any other value sets it), ``TRAINER_ARGS`` the command line (``{out}``: the job's directory under
``TRAINER_OUT``), ``TRAINER_EXTRA`` (JSON) more arguments per job. DeepSpeed's launch runs with
``DS_ACCELERATOR=cpu`` and without ``ACCELERATE_USE_CPU`` (Accelerate starts no DeepSpeed on
``use_cpu``); the zero_strategy launch passes ``--use_cpu``.

A job named ``refused-*`` is expected to raise: each rank reports its error. Each rank reports
per job the engine that trained (DeepSpeed's, zero_strategy's and its stage,
or neither) and, for a resumed job, the optimizer's state right after the resume (its step and
the norms of both Adam moments, over all ranks) and the scheduler's ``last_epoch``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_jobs import jobs, report, run  # the sibling helper, run as a script

EXAMPLE = Path(__file__).parents[2] / "examples" / "trainer_gpt2.py"


def _byte_windows() -> Any:
    spec = importlib.util.spec_from_file_location("trainer_gpt2", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.ByteWindows


def _optimizer_state(trainer: Any) -> dict[str, Any]:
    """The step and the moments' squared norms summed over every rank's state (shards or whole)."""
    step, sq = 0.0, torch.zeros(2, dtype=torch.float64)
    for state in trainer.optimizer.state.values():
        if "exp_avg" in state:
            step = max(step, float(state["step"]))
            sq += torch.stack([state[k].double().pow(2).sum() for k in ("exp_avg", "exp_avg_sq")])
    if dist.is_initialized() and getattr(trainer.model, "_zero_engine", None) is not None:
        dist.all_reduce(sq)  # shards: every rank holds a part
    return {"step": step, "exp_avg": float(sq[0].sqrt()), "exp_avg_sq": float(sq[1].sqrt()),
            "last_epoch": int(trainer.lr_scheduler.state_dict()["last_epoch"])}  # fmt: skip


def train(argv: list[str], probe: dict[str, Any]) -> Any:
    """The user's script: ``TrainingArguments`` from ``argv``; ``probe`` gets the state after resume."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        HfArgumentParser,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    windows = _byte_windows()

    class Probe(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args.resume_from_checkpoint:  # after the optimizer, the scheduler and the Trainer's state
                probe.update(_optimizer_state(trainer), global_step=int(state.global_step))

    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=windows(64, 32, offset=0),
                      callbacks=[Probe()])  # fmt: skip
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    return trainer


def _gloo_for_deepspeed() -> None:
    """Accelerate finds no distributed backend on a machine without GPUs unless ``cpu=True``, and
    starts no DeepSpeed with ``cpu=True``: DeepSpeed then runs on 2 processes (its CPU accelerator,
    gloo) while Accelerate and the ``Trainer`` count one, so each process would read the same
    batches. Name gloo, the backend DeepSpeed's CPU accelerator uses, as the backend found."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    found = PartialState._prepare_backend

    def prepare(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        name, kind = found(self, cpu, sagemaker_dp, backend)
        if name is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return name, kind

    PartialState._prepare_backend = prepare  # type: ignore[method-assign]


def main() -> None:
    if os.environ.get("DS_ACCELERATOR") == "cpu":  # the DeepSpeed launch
        import deepspeed.comm.torch

        # DeepSpeed would JIT-build its shared-memory collective op at init (a C++ compile per machine)
        deepspeed.comm.torch.build_shm_op = lambda: None  # type: ignore[attr-defined]
        _gloo_for_deepspeed()
    root = Path(os.environ["TRAINER_OUT"])
    results = {}
    for name in jobs("TRAINER_JOBS"):
        line = os.environ["TRAINER_ARGS"] + " " + json.loads(os.environ.get("TRAINER_EXTRA", "{}")).get(name, "")
        probe: dict[str, Any] = {}
        try:
            trainer = train([a.replace("{out}", str(root / name)) for a in shlex.split(line)], probe)
        except Exception as exc:  # a job named refused-*: the error every rank raised
            if not name.startswith("refused-"):
                raise
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        engine = getattr(trainer.model, "_zero_engine", None)
        results[name] = {
            "deepspeed": bool(trainer.is_deepspeed_enabled),
            "engine": type(engine).__name__,
            "stage": None if engine is None else int(engine.config.stage),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "resumed": probe,
        }
        if engine is not None:
            import zero_strategy as zs

            zs.destroy(trainer.model)
        if dist.is_initialized():
            dist.barrier()
    report(results)


if __name__ == "__main__":
    run(main)
