"""Overlap you can see (issue 13, part 1): ``zs.profile`` writes a Chrome trace whose ranges name
each unit's compute, each gather and reduce-scatter and every wait; ``zs.comm_report`` gives
the communication the host waited on against the step time; ``stage3_prefetch_bucket_size``
bounds what ZeRO-3 gathers ahead. At world size 2."""

from __future__ import annotations

import json
import os

from zero_strategy.testing import run_subtests


def _run(
    stage: int, rank: int, world: int, trace_dir: str, prefetch_bucket: int | None = None, max_live: int | None = None
) -> dict:
    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch
    from zero_strategy.models.gpt import Block

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=3, n_head=2)
    torch.manual_seed(0)
    zero: dict = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
    if prefetch_bucket is not None:
        zero["stage3_prefetch_bucket_size"] = prefetch_bucket
    if max_live is not None:
        zero["stage3_max_live_parameters"] = max_live
    model, opt = zs.initialize(
        GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3), config={"zero_optimization": zero}, policy={Block}
    )
    seen: list[tuple[str, str, str]] = []  # (hook, unit, its state as its hook runs), once per unit and hook
    sched = model.zero_engine.zero3

    def probe(hook: str, real):
        def recorded(u) -> None:
            if (hook, u.name) not in {s[:2] for s in seen}:
                seen.append((hook, u.name, u.state.name))
            real(u)

        return recorded

    if sched is not None:
        for hook in ("pre_forward", "pre_backward"):
            setattr(sched, hook, probe(hook, getattr(sched, hook)))

    def step(k: int) -> float:
        x, y = synthetic_batch(cfg, 2, k, seed=rank)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    losses = [step(0)]  # the unit order is recorded in the first step
    seen.clear()  # from here each pre-hook finds the unit sharded, or its gather issued by a prefetch
    zs.reset_comm_stats()
    trace = os.path.join(trace_dir, f"stage{stage}-rank{rank}-{prefetch_bucket}-{max_live}.json")
    with zs.profile(trace):
        losses += [step(k) for k in (1, 2, 3)]
    report = zs.comm_report()
    names = {e["name"] for e in json.load(open(trace))["traceEvents"] if str(e.get("name", "")).startswith("zero: ")}
    peak = model.zero_engine.memory_stats().get("gathered_peak", 0)
    model.zero_engine.close()
    return {"report": report, "names": sorted(names), "losses": losses, "peak": peak, "seen": seen}


def _check_trace(stage: int, rank: int, world: int, trace_dir: str) -> None:
    out = _run(stage, rank, world, trace_dir)
    names, report = set(out["names"]), out["report"]
    want = [f"zero: wait all_reduce gradient flags (step {k})" for k in (1, 2, 3)]
    if stage == 3:
        want += [
            "zero: forward unit 'blocks.1'",
            "zero: backward unit 'blocks.1'",
            "zero: all_gather parameters of unit 'blocks.2' (step 2)",
            "zero: reduce_scatter gradients of unit 'blocks.0' (step 2)",
            "zero: wait reduce_scatter gradients of unit 'blocks.0' (step 2)",
        ]
    else:
        want += [n for n in names if n.startswith("zero: reduce_scatter gradients of group 0 ")][:1] or ["(group 0)"]
        want += [n for n in names if n.startswith("zero: all_gather parameters of group 0 ")][:1] or ["(gather)"]
    missing = [n for n in want if n not in names]
    if missing:
        raise AssertionError(f"stage {stage}: ranges missing from the trace: {missing}; found {sorted(names)[:30]}")
    if report["steps"] != 3:
        raise AssertionError(f"stage {stage}: comm_report counted {report['steps']} steps, want 3: {report}")
    step_s, exposed = report["step_seconds"], report["exposed_seconds"]
    if not (0 < exposed <= step_s and 0 < report["exposed_pct"] <= 100 and report["bytes"] > 0):
        raise AssertionError(f"stage {stage}: exposed communication not within the step: {report}")


def _check_prefetch_bucket(rank: int, world: int, trace_dir: str) -> None:
    """A prefetch bucket of 0 gathers nothing ahead: fewer units gathered at once, the same
    numbers. A bucket smaller than one unit still prefetches the next unit (issue 45, item 5: a
    0.94B Llama's 50.6M-element layer was over the default 50M and never prefetched): each unit's
    forward and backward pre-hook finds its gather already issued, except the first of each pass.
    ``stage3_max_live_parameters`` stays a hard cap: below the root and one unit, nothing ahead."""
    ahead = _run(3, rank, world, trace_dir)
    none = _run(3, rank, world, trace_dir, prefetch_bucket=0)
    small = _run(3, rank, world, trace_dir, prefetch_bucket=1)
    capped = _run(3, rank, world, trace_dir, prefetch_bucket=1, max_live=1)
    if not none["peak"] < ahead["peak"] or small["peak"] != ahead["peak"]:
        raise AssertionError(f"gathered peaks: {none['peak']} no prefetch, {small['peak']} bucket 1, {ahead['peak']}")
    for run in (none, small, capped):
        if run["losses"] != ahead["losses"] or not all(v == v for v in run["losses"]):
            raise AssertionError(f"losses differ: {run['losses']} vs {ahead['losses']}")
    units = ["unit 'blocks.0'", "unit 'blocks.1'", "unit 'blocks.2'"]
    for run, first in ((none, None), (capped, None), (small, 1), (ahead, 1)):
        want = [
            ("pre_forward", n, "SHARDED" if first is None or k < first else "UNSHARDING") for k, n in enumerate(units)
        ]
        want += [("pre_backward", n, "SHARDED" if first is None or k < first else "UNSHARDING")
                 for k, n in enumerate(units[::-1])]  # fmt: skip
        if run["seen"] != want:
            raise AssertionError(f"units as their pre-hooks ran: {run['seen']}, want {want}")


def _worker(rank: int, world: int, trace_dir: str) -> int:
    cells = [{"stage": s} for s in (1, 2, 3)] + [{"prefetch": True}]

    def one(stage: int = 3, prefetch: bool = False) -> None:
        if prefetch:
            _check_prefetch_bucket(rank, world, trace_dir)
        else:
            _check_trace(stage, rank, world, trace_dir)

    run_subtests(one, cells, label="overlap")
    return len(cells)


def test_profile_names_units_and_comm_report_counts_exposed_time(launch, tmp_path) -> None:
    assert launch(_worker, 2, args=(str(tmp_path),), timeout=300) == [4, 4]
