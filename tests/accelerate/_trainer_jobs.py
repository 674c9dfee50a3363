"""Runs ``examples/trainer_gpt2.py`` several times in one launch (one launch costs ~15 s).

``tests/accelerate/test_trainer.py`` launches this with ``ZERO_STRATEGY_CONFIG`` set (so the
start-up hook is installed); ``TRAINER_JOBS`` lists ``name=config`` pairs, run in order. For a job
whose config is ``ddp`` the variable is removed, so the ``Trainer`` takes its own DDP path (the
hook's wrappers hand every call to the ``Trainer``'s own methods); otherwise the variable names
the job's ZeRO config. Run the DDP job first: the ZeRO jobs' engines are destroyed after each
job, but nothing should depend on that. ``TRAINER_ARGS`` are the example's arguments (``{out}``
is the job's directory under ``TRAINER_OUT``).

Each rank writes ``$ACCEL_JOB_OUT/rank<r>.json`` (what ``run_launch`` collects): per job, which
wrapper the Trainer trained (the DDP class, or the engine's model), the stage and the world size;
then ``rank<r>.done`` after the final barrier, or ``rank<r>.error`` if it raised.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from pathlib import Path

import torch.distributed as dist

EXAMPLE = Path(__file__).parents[2] / "examples" / "trainer_gpt2.py"


def main() -> None:
    spec = importlib.util.spec_from_file_location("trainer_gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    root = Path(os.environ["TRAINER_OUT"])
    results = {}
    for pair in os.environ["TRAINER_JOBS"].split(","):
        name, config = pair.split("=")
        if config == "ddp":
            os.environ.pop("ZERO_STRATEGY_CONFIG", None)
        else:
            os.environ["ZERO_STRATEGY_CONFIG"] = config
        out = root / name
        argv = [a.replace("{out}", str(out)) for a in shlex.split(os.environ["TRAINER_ARGS"])]
        trainer = example.main(argv)
        engine = getattr(trainer.model, "_zero_engine", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        info = {
            "wrapped": type(trainer.model_wrapped).__name__,
            "engine": type(engine).__name__,
            "stage": None if engine is None else int(engine.config.stage),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
        }
        results[name] = info
        if engine is not None:
            import zero_strategy as zs

            zs.destroy(trainer.model)
        if dist.is_initialized():
            dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    report = Path(os.environ["ACCEL_JOB_OUT"])
    (report / f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
    (report / f"rank{rank}.done").write_text("")


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        with open(os.path.join(os.environ["ACCEL_JOB_OUT"], f"rank{os.environ.get('RANK', '0')}.error"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
