"""A ``Trainer`` run DeepSpeed started, resumed on the ZeRO engine (issue 47).

A team moves an unmodified ``HfArgumentParser`` script from ``--deepspeed ds_config.json`` to
``zero-strategy launch --zero-config ds_config.json`` in the middle of a run and passes
``--resume_from_checkpoint out/checkpoint-K``: a checkpoint the ``Trainer`` wrote under DeepSpeed
(``global_stepK/``, ``latest``, ``trainer_state.json``, the rng states; ``model.safetensors`` at
stages 1/2 only; the LR scheduler's state inside DeepSpeed's files, no ``scheduler.pt``).

Launch 1 (DeepSpeed 0.19.8 on 2 CPU processes, ``DS_ACCELERATOR=cpu``, gloo) trains
``_trainer_ds_jobs.py`` with ``--deepspeed`` at stages 2 and 3 (and stage 2 with Hugging Face's
``WarmupDecayLR`` block, DeepSpeed running the schedule), saving at step K and continuing to the
end. Launch 2 (zero_strategy, 2 processes) resumes each from checkpoint-K with the same file
as ``ZERO_STRATEGY_CONFIG`` (stage 2 at stage 2, stage 3 at stage 3, stage 2's at stage 3, the scheduler block's at stage 2),
and once from a copy of stage 2's checkpoint-K without ``global_stepK/`` (the weights only: a
fresh Adam and scheduler), which must miss DeepSpeed's continuation: the comparison catches a
resume that drops the optimizer state. A last job resumes a copy of stage 3's checkpoint where
the conversion cannot be written (a file named ``zero_strategy``): every rank must raise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.accelerate.test_accelerate_launch import rel_diff, run_launch
from zero_strategy.checkpoint.deepspeed_files import read_deepspeed
from zero_strategy.testing import assert_close

JOBS = Path(__file__).with_name("_trainer_ds_jobs.py")
K, STEPS = 3, 6
ARGS = ("--output_dir {out} --max_steps 6 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 "
        "--learning_rate 3e-3 --weight_decay 0.1 --max_grad_norm 0.5 --lr_scheduler_type linear --warmup_steps 2 "
        "--logging_steps 1 --save_strategy steps --save_steps 3 --report_to none --disable_tqdm true --seed 0 "
        "--dataloader_drop_last true")  # fmt: skip
# measured (steps 4-6, fp32, 2 CPU processes): the losses and learning rates equal, the gradient norms within
# 1.0e-7; the weights alone (a fresh Adam, the schedule restarted): 1.8e-2 on the losses, 2.6e-2 on the norms
REL = 1e-6


# Hugging Face's documented WarmupDecayLR block: DeepSpeed runs the schedule, no scheduler.pt
SCHEDULER = {"type": "WarmupDecayLR", "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr",
                                                                   "warmup_num_steps", "total_num_steps")}}  # fmt: skip
# Hugging Face's documented optimizer block: DeepSpeed builds it over one param group (the Trainer's
# decay/no-decay split is not made), so every parameter decays; torch's AdamW (FusedAdam needs a build)
OPTIMIZER = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}, "torch_adam": True}
RUNS = {"2": 2, "3": 3, "2s": 2, "2o": 2}  # DeepSpeed run -> stage; "s": with SCHEDULER, "o": with OPTIMIZER


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    """A Hugging Face DeepSpeed config file as users write it ("auto": the Trainer fills it in)."""
    return {**extra, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip


def _launch(tmp: Path, name: str, jobs: dict[str, str], extra: dict[str, str], **env: str) -> dict[str, Any]:
    spec = ",".join(f"{k}={v}" for k, v in jobs.items())
    ranks = run_launch(tmp, name, 2, script=JOBS, env={"TRAINER_JOBS": spec, "TRAINER_ARGS": ARGS,
                                                       "TRAINER_EXTRA": json.dumps(extra),
                                                       "TRAINER_OUT": str(tmp / name), **env})  # fmt: skip

    def same(rank: dict[str, Any]) -> dict[str, Any]:  # what every rank reports alike
        return {k: {**v, "resumed": {}} for k, v in rank.items() if not k.startswith("refused-")}

    assert all(same(r) == same(ranks[0]) for r in ranks)
    return {
        **ranks[0],
        **{f"{k}@{i}": v for i, r in enumerate(ranks) for k, v in r.items() if k.startswith("refused-")},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trainer_ds")
    cfg = {}
    for run, stage in RUNS.items():
        cfg[run] = tmp / f"ds_config_{run}.json"
        extra = {"scheduler": SCHEDULER} if "s" in run else {"optimizer": OPTIMIZER} if "o" in run else {}
        cfg[run].write_text(json.dumps(_config(stage, **extra)))
    ds = _launch(tmp, "ds", {f"ds{r}": "ddp" for r in RUNS}, {f"ds{r}": f"--deepspeed {cfg[r]}" for r in RUNS},
                 DS_ACCELERATOR="cpu", ACCELERATE_USE_CPU="false")  # fmt: skip
    ckpt = {r: tmp / "ds" / f"ds{r}" / f"checkpoint-{K}" for r in RUNS}
    weights_only, blocked = tmp / "weights-only", tmp / "blocked"
    shutil.copytree(ckpt["2"], weights_only, ignore=shutil.ignore_patterns("global_step*", "latest"))
    shutil.copytree(ckpt["3"], blocked)
    (blocked / "zero_strategy").write_text("")  # where the conversion goes cannot be made a directory
    jobs = {"zs2": cfg["2"], "zs3": cfg["3"], "zs3-from-ds2": cfg["3"], "zs2s": cfg["2s"], "zs2o": cfg["2o"],
            "fresh-adam": cfg["2"], "refused-blocked": cfg["3"]}  # fmt: skip
    src = {"zs2": ckpt["2"], "zs3": ckpt["3"], "zs3-from-ds2": ckpt["2"], "zs2s": ckpt["2s"], "zs2o": ckpt["2o"],
           "fresh-adam": weights_only, "refused-blocked": blocked}  # fmt: skip
    zs = _launch(tmp, "zs", {k: str(v) for k, v in jobs.items()},
                 {k: f"--use_cpu --resume_from_checkpoint {src[k]}" for k in jobs}, ZERO_STRATEGY_CONFIG=str(cfg["2"]))  # fmt: skip
    return {"tmp": tmp, "ds": ds, "zs": zs, "ckpt": ckpt, "blocked": blocked}


def _after_k(run: Path) -> dict[str, dict[int, float]]:
    history = json.loads((run / "log_history.json").read_text())
    return {key: {e["step"]: e[key] for e in history if key in e and e["step"] > K}
            for key in ("loss", "grad_norm", "learning_rate")}  # fmt: skip


def _gaps(ours: Path, ref: Path) -> dict[str, float]:
    """Per logged value, the largest relative difference at steps K+1..STEPS (NaN-strict)."""
    got, want = _after_k(ours), _after_k(ref)
    gaps = {}
    for key in ("loss", "grad_norm", "learning_rate"):
        assert sorted(got[key]) == sorted(want[key]) == list(range(K + 1, STEPS + 1)), (key, got[key], want[key])
        gaps[key] = rel_diff([got[key][s] for s in sorted(want[key])], [want[key][s] for s in sorted(want[key])])
    return gaps


def _deepspeed_moments(ckpt: Path) -> list[float]:
    """The norms of DeepSpeed's saved Adam moments over every parameter (read from its partitions)."""
    sd, _ = read_deepspeed(ckpt)
    sq = [
        sum(float(v.double().pow(2).sum()) for k, v in sd.items() if k.endswith(f".{key}"))
        for key in ("exp_avg", "exp_avg_sq")
    ]
    return [x**0.5 for x in sq]


def test_deepspeed_trained_the_reference(runs: dict[str, Any]) -> None:
    for run, stage in RUNS.items():
        assert runs["ds"][f"ds{run}"]["deepspeed"] and runs["ds"][f"ds{run}"]["engine"] == "NoneType"
        names = {p.name for p in runs["ckpt"][run].iterdir()}
        assert {f"global_step{K}", "latest", "trainer_state.json"} <= names, names
        # scheduler.pt: the Trainer's own LR scheduler, which DeepSpeed stepped; none with a scheduler block, and
        # none with an optimizer block (DeepSpeed's engine then holds the Trainer's scheduler and saves it itself)
        assert ("scheduler.pt" in names) == (run in ("2", "3")), names
        assert "optimizer.pt" not in names and ("model.safetensors" in names) == (stage == 2), names


@pytest.mark.parametrize(
    ("job", "src", "stage"),
    [("zs2", "2", 2), ("zs3", "3", 3), ("zs3-from-ds2", "2", 3), ("zs2s", "2s", 2), ("zs2o", "2o", 2)],
)
def test_the_engine_continues_a_deepspeed_checkpoint_as_deepspeed_does(
    runs: dict[str, Any], job: str, src: str, stage: int
) -> None:
    """``zs2s``: DeepSpeed ran the config's WarmupDecayLR; the ``Trainer``'s linear schedule, the
    same function, continues at DeepSpeed's counter (one behind the step). The ``Trainer`` logs
    DeepSpeed's scheduler after it stepped (the next step's rate) and its own before: the logged
    rates are one step apart while the losses, which follow the applied rates, are equal. ``zs2o``:
    DeepSpeed built the config's optimizer over one group; the ``Trainer``'s decay and no-decay
    groups on the engine each lie within it and take its settings (the biases decay, as under
    DeepSpeed), and the Trainer's own scheduler, which DeepSpeed's engine held and saved, loads
    as it was (logged as in ``zs2s``)."""
    info = runs["zs"][job]
    assert info["engine"] == "ZeroEngine" and info["stage"] == stage and info["world"] == 2 and not info["deepspeed"]
    resumed = info["resumed"]
    counter = K - 1 if "s" in src else K
    assert resumed["global_step"] == K and resumed["step"] == K and resumed["last_epoch"] == counter, resumed
    assert_close([resumed["exp_avg"], resumed["exp_avg_sq"]], _deepspeed_moments(runs["ckpt"][src]), rtol=1e-6,
                 what=f"{job}: Adam moments' norms after the resume, against DeepSpeed's saved ones")  # fmt: skip
    ours, ref = runs["tmp"] / "zs" / job, runs["tmp"] / "ds" / f"ds{src}"
    gaps = _gaps(ours, ref)
    if "s" in src or "o" in src:  # DeepSpeed's engine stepped the scheduler: logged after its step
        got, want = _after_k(ours)["learning_rate"], _after_k(ref)["learning_rate"]
        gaps["learning_rate"] = rel_diff(
            [got[k + 1] for k in range(K + 1, STEPS)], [want[k] for k in range(K + 1, STEPS)]
        )
    assert max(gaps.values()) < REL, gaps


def test_a_fresh_adam_misses_deepspeeds_continuation(runs: dict[str, Any]) -> None:
    """The weights alone (no ``global_stepK/``): the comparison above would catch a resume that
    dropped the optimizer and scheduler state."""
    resumed = runs["zs"]["fresh-adam"]["resumed"]
    assert resumed["step"] == 0 and resumed["last_epoch"] == 0 and resumed["exp_avg"] == 0, resumed
    gaps = _gaps(runs["tmp"] / "zs" / "fresh-adam", runs["tmp"] / "ds" / "ds2")  # measured: 1.8e-2, 2.6e-2, 3.0
    assert gaps["loss"] > 100 * REL and gaps["grad_norm"] > 100 * REL and gaps["learning_rate"] > 0.5, gaps


def test_an_unwritable_conversion_is_refused_on_every_rank_naming_the_command(runs: dict[str, Any]) -> None:
    """Rank 0 converts; a failure reaches the other rank through the agreement collective instead
    of leaving it in the next one."""
    ckpt = runs["blocked"]
    for rank in (0, 1):
        error = runs["zs"][f"refused-blocked@{rank}"]["error"]
        assert f"zero-strategy import-checkpoint {ckpt} {ckpt / 'zero_strategy'}" in error, error
        assert "could not be written" in error and f"resume_from_checkpoint={str(ckpt)!r}" in error, error
        assert error.startswith("FileExistsError") if rank == 0 else "rank 0 failed" in error, error


def test_the_trainers_scheduler_continues_from_deepspeeds_state() -> None:
    """Without ``scheduler.pt`` the LR scheduler's state is DeepSpeed's: the same kind loads as it
    is; DeepSpeed's own (a config ``scheduler`` block, ``last_batch_iteration``) leaves the
    ``Trainer``'s schedule to continue at the checkpoint's step; anything else is refused."""
    from transformers import get_linear_schedule_with_warmup

    from accelerate_zero._deepspeed_resume import continue_scheduler

    def linear() -> Any:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
        return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)

    ref = linear()
    for _ in range(K):
        ref.optimizer.step()
        ref.step()
    same = linear()
    assert continue_scheduler(same, ref.state_dict(), K, "call") is None
    assert same.state_dict()["last_epoch"] == K and same.get_last_lr() == ref.get_last_lr()  # the lr: the optimizer's
    own = linear()
    line = continue_scheduler(own, {"last_batch_iteration": K}, K + 1, "call")  # DeepSpeed's counter lags by one
    assert line is not None and "continues at 3" in line, line
    assert own.get_last_lr() == ref.get_last_lr() and own.optimizer.param_groups[0]["lr"] == ref.get_last_lr()[0]
    own.optimizer.step()
    own.step()
    ref.optimizer.step()
    ref.step()
    assert own.get_last_lr() == ref.get_last_lr()  # and goes on as the uninterrupted schedule
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(linear().optimizer)
    with pytest.raises(ValueError, match=r"call: DeepSpeed's checkpoint holds its LR scheduler's state"):
        continue_scheduler(plateau, {"last_batch_iteration": 2}, K, "call")


def test_a_conversion_failing_with_a_base_exception_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP wraps a write failure in ``CheckpointException``, a ``BaseException``: it still goes
    through the agreement (every rank raises) and names the command (review finding: it skipped
    the agreement, leaving the other ranks in the collective)."""
    import accelerate_zero._deepspeed_resume as resume
    import zero_strategy as zs

    class Wrapped(BaseException):
        pass

    def fail(src: str, dst: str) -> dict[str, Any]:
        raise Wrapped("CheckpointException ranks:dict_keys([0])")

    monkeypatch.setattr(resume, "import_checkpoint", fail)
    model = torch.nn.Linear(3, 3)
    model, _ = zs.initialize(model, torch.optim.AdamW(model.parameters()), config=zs.ZeroConfig(stage=2))
    ckpt = str(tmp_path / "checkpoint-3")
    with pytest.raises(
        RuntimeError,
        match=r"call: converting the DeepSpeed checkpoint .*\(Wrapped: CheckpointException.*zero-strategy import-checkpoint",
    ):
        resume.import_deepspeed(ckpt, ckpt + "/zero_strategy", model, "call")
    model.zero_engine.close()
