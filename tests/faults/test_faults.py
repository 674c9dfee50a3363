"""Failures across ranks: a rank killed in forward, backward, the optimizer step or a save makes
the others exit with an error naming the collective (and, for point-to-point exchanges, the
missing rank) within comm_timeout + 30 s, and the last checkpoint still loads; ranks that
disagree at initialize or about a checkpoint all raise the same error instead of hanging."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

COMM_TIMEOUT = 5


def _dying_worker(rank: int, world: int, root: str, stage: int, phase: str) -> dict | None:
    import os
    import signal

    import torch

    import zero_strategy as zs
    import zero_strategy.checkpoint.state as ckpt

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)), torch.nn.Linear(16, 4)
    )
    model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2), stage=stage, comm_timeout=COMM_TIMEOUT,
                               stage3_param_persistence_threshold=0, reduce_bucket_size=200)  # fmt: skip
    armed = [False]
    if rank == 1:
        if phase == "forward":
            model[2].register_forward_pre_hook(lambda m, a: die() if armed[0] else None)
        elif phase == "backward":
            model[1][0].weight.register_hook(lambda g: die() if armed[0] else g)
        elif phase == "step":
            opt.register_step_pre_hook(lambda o, a, k: die() if armed[0] else None)  # after the engine's own
        elif phase == "save":
            ckpt.FAULT_HOOK = lambda where, r: die() if armed[0] and where == "after_shards" else None
    t0 = time.monotonic()
    try:
        for step in range(4):
            armed[0] = step == 3
            t0 = time.monotonic()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1 or (phase == "save" and step == 3):
                zs.save_checkpoint(root, model, opt, extra={"step": step})
    except Exception as e:
        return {"message": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t0}
    return {"message": "no error", "elapsed": 0.0}


@pytest.mark.parametrize(
    ("stage", "phase", "collective"),
    [(3, "forward", "reduce_scatter of gradients"), (3, "backward", "gradients of unit"), (2, "step", "all_gather of parameters"),
     (2, "save", "checkpoint")],
)  # fmt: skip
def test_a_killed_rank_makes_the_others_fail_fast_and_the_last_checkpoint_loads(
    launch, tmp_path: Path, stage, phase, collective
) -> None:
    import torch

    import zero_strategy as zs

    root = tmp_path / "ck"
    t0 = time.monotonic()
    results = launch(_dying_worker, 2, args=(str(root), stage, phase), timeout=180, pg_timeout=20, may_die={1})
    assert time.monotonic() - t0 < COMM_TIMEOUT + 60
    assert results[1] is None, results  # rank 1 was killed
    r = results[0]
    msg = r["message"]
    assert r["elapsed"] <= COMM_TIMEOUT + 30, r
    assert collective in msg and ("step 3" in msg or phase == "save"), msg
    if phase != "save":  # a point-to-point exchange knows its peer
        assert "Rank 1 of the group (global rank 1) did not complete its part" in msg, msg
    assert (root / "latest").read_text().strip() == "step-2"  # saved after 2 optimizer steps, before the kill
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)), torch.nn.Linear(16, 4)
    )
    model, opt = zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2), stage=1)
    assert zs.load_checkpoint(root, model, opt) == {"step": 1}


def _disagree_worker(rank: int, world: int, root: str) -> dict:
    import os

    import torch

    import zero_strategy as zs

    out = {}
    # a different config on one rank: every rank raises, naming the field
    try:
        zs.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), stage=2, prefetch=1 + rank)
        out["config"] = "accepted"
    except ValueError as e:
        out["config"] = str(e)
    # comm_timeout only on rank 1 (the group's timeout on rank 0): still one agreement, no hang
    try:
        zs.initialize(
            torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), stage=2, comm_timeout=45 if rank else None
        )
        out["timeout"] = "accepted"
    except ValueError as e:
        out["timeout"] = str(e)
    # a different model on one rank
    try:
        zs.initialize(torch.nn.Linear(4, 4 + rank), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
        out["model"] = "accepted"
    except ValueError as e:
        out["model"] = str(e)
    # a checkpoint one rank sees damaged: all ranks raise the same error, at once
    # comm_timeout unlike the group's: DCP runs on a gloo group made with it, on first use
    model, opt = zs.initialize(torch.nn.Linear(64, 64), lambda p: torch.optim.SGD(p, lr=0.1), stage=2, comm_timeout=45)
    try:  # ranks that ask for different tags
        zs.save_checkpoint(root + "-tags", model, opt, tag=f"t{rank}")
        out["tag"] = "saved"
    except ValueError as e:
        out["tag"] = str(e)
    path = zs.save_checkpoint(root, model, opt)
    torch.distributed.barrier()
    if rank == 1:  # only rank 1's view is damaged (a node-local copy, say): rank 1 checks this file
        files = sorted(n for n in os.listdir(path) if n.endswith(".distcp") or n == ".metadata")
        with open(os.path.join(path, files[1]), "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 1]))
    torch.distributed.barrier()
    t0 = time.monotonic()
    try:
        zs.load_checkpoint(root, model, opt)
        out["load"] = "loaded"
    except Exception as e:
        out["load"] = f"{type(e).__name__}: {e}"
    out["load_s"] = time.monotonic() - t0
    return out


def test_ranks_that_disagree_all_raise_the_same_error_at_once(launch, tmp_path: Path) -> None:
    results = launch(_disagree_worker, 2, args=(str(tmp_path / "ck"),), timeout=120)
    for r in results:
        assert "config field 'prefetch' is 1 on rank 0 but 2 on rank 1" in r["config"], r
        assert "config field 'comm_timeout' is None on rank 0 but 45" in r["timeout"], r
        assert (
            "parameter #0 is 'weight (4, 4) float32' on rank 0 but 'weight (5, 4) float32' on rank 1" in r["model"]
        ), r
        assert "does not match the checksum" in r["load"] and r["load_s"] < 20, r
        assert "the ranks asked for different tags ['t0', 't1']" in r["tag"], r
    assert results[0]["load"].startswith("CheckpointFileError: load_checkpoint(): another rank refused the checkpoint")
