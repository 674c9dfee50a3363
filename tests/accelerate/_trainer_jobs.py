"""Runs ``examples/trainer_gpt2.py`` several times in one launch (one launch costs ~15 s).

``tests/accelerate/test_trainer.py`` launches this with ``ZERO_STRATEGY_CONFIG`` set (so the
start-up hook is installed); ``TRAINER_JOBS`` lists ``name=config`` pairs, run in order. For a job
whose config is ``ddp`` the variable is removed, so the ``Trainer`` takes its own DDP path (the
hook's wrappers hand every call to the ``Trainer``'s own methods); otherwise the variable names
the job's ZeRO config. Run the DDP job first: the ZeRO jobs' engines are destroyed after each
job, but nothing should depend on that. ``TRAINER_ARGS`` are the example's arguments (``{out}``
is the job's directory under ``TRAINER_OUT``, ``{src}`` the job's name without a ``resume-``
prefix: the run whose checkpoint it resumes); ``TRAINER_EXTRA`` (JSON) adds arguments for
single jobs.

Each rank writes ``$ACCEL_JOB_OUT/rank<r>.json`` (what ``run_launch`` collects): per job, which
wrapper the Trainer trained (the DDP class, or the engine's model), the stage and the world size;
then ``rank<r>.done`` after the final barrier, or ``rank<r>.error`` if it raised.

With ``TRAINER_EACH_NODE`` set it runs :func:`each_node` instead: ``save_model`` with
``save_on_each_node`` as on two nodes, every process made its node's local main
(``LOCAL_RANK=0``, set before accelerate reads it) with its own output directory (a node's
disk); each rank reports the files its ``save_model`` wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

EXAMPLE = Path(__file__).parents[2] / "examples" / "trainer_gpt2.py"
if os.environ.get("TRAINER_EACH_NODE"):
    os.environ["LOCAL_RANK"] = "0"  # every process is the first of its (simulated) node


def jobs(variable: str) -> Iterator[str]:
    """The job names of ``variable`` (``name=config`` pairs), each with ``ZERO_STRATEGY_CONFIG``
    set to its config, or removed for ``ddp`` (the Trainer's own DDP)."""
    for pair in os.environ[variable].split(","):
        name, config = pair.split("=")
        if config == "ddp":
            os.environ.pop("ZERO_STRATEGY_CONFIG", None)
        else:
            os.environ["ZERO_STRATEGY_CONFIG"] = config
        yield name


def report(results: dict) -> None:
    """Each rank's ``rank<r>.json`` for ``run_launch``, then ``rank<r>.done`` after a barrier."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(os.environ["ACCEL_JOB_OUT"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
    (out / f"rank{rank}.done").write_text("")


def run(main: Callable[[], None]) -> None:
    """``main()``; an exception is also written to ``rank<r>.error`` (what the test shows)."""
    try:
        main()
    except Exception as exc:
        with open(os.path.join(os.environ["ACCEL_JOB_OUT"], f"rank{os.environ.get('RANK', '0')}.error"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise


def main() -> None:
    spec = importlib.util.spec_from_file_location("trainer_gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    root = Path(os.environ["TRAINER_OUT"])
    results = {}
    for name in jobs("TRAINER_JOBS"):
        out = root / name
        src = name.removeprefix("resume-")
        line = os.environ["TRAINER_ARGS"] + " " + json.loads(os.environ.get("TRAINER_EXTRA", "{}")).get(name, "")
        argv = [a.replace("{out}", str(out)).replace("{src}", src) for a in shlex.split(line)]
        trainer = example.main(argv)
        engine = getattr(trainer.model, "_zero_engine", None)
        info = {
            "wrapped": type(trainer.model_wrapped).__name__,
            "engine": type(engine).__name__,
            "stage": None if engine is None else int(engine.config.stage),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "mixed_precision": str(trainer.accelerator.mixed_precision),
            "autocast": None if engine is None else str(engine.config.precision.autocast_dtype),
            "checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        }
        results[name] = info
        if engine is not None:
            import zero_strategy as zs

            zs.destroy(trainer.model)
        if dist.is_initialized():
            dist.barrier()
    if os.environ.get("TRAINER_REFUSE"):  # the Trainer's own FSDP together with ours
        results["refused"] = _refused(root)
    report(results)


def each_node() -> None:
    """``TRAINER_EACH_NODE``: ``save_model`` with ``save_on_each_node`` as on two nodes (see the top)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    node = Path(os.environ["TRAINER_OUT"]) / f"node{rank}"
    args = TrainingArguments(output_dir=str(node / "run"), save_on_each_node=True, use_cpu=True, report_to="none",
                             max_steps=1, per_device_train_batch_size=2, save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(node / "model"))
    wrote = sorted(p.name for p in (node / "model").glob("*")) if (node / "model").exists() else []
    info = {"should_save": bool(args.should_save), "wrote": wrote,
            "engine": type(getattr(trainer.model, "_zero_engine", None)).__name__}  # fmt: skip
    report(info)


def _refused(root: Path) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    os.environ["ZERO_STRATEGY_CONFIG"] = os.environ["TRAINER_REFUSE"]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    args = TrainingArguments(output_dir=str(root / "refused"), fsdp=True, use_cpu=True, report_to="none")
    try:
        Trainer(model=model, args=args)
    except ValueError as exc:
        return str(exc)
    return "not refused"


if __name__ == "__main__":
    run(each_node if os.environ.get("TRAINER_EACH_NODE") else main)
