"""``zero-strategy bench``: every row at every rank count in ranks it starts, and a summary.

All rows of one (repeat, rank count) run one after the other in one launch of
:func:`zero_strategy.bench.worker.run_rows` (fresh processes started by torchrun where torch has
it, else by the test harness's launcher: :mod:`zero_strategy.bench.ranks`; CPU/gloo here,
``OMP_NUM_THREADS=1``): one start instead of six. Each row's peak RSS is counted from the
row's start but includes what earlier rows left to the allocator; ``fresh=True``
(``--fresh-processes``) gives every row its own launch and a clean RSS column. Repeats are
interleaved (all rows, then all rows again) so drift of the machine
hits every row alike; the summary takes medians over repeats. While it runs, rank 0 writes its
step to a file that a thread here turns into a progress bar (``rich``, on a terminal only).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zero_strategy.bench.estimate import Setup, this_engine, zero_paper
from zero_strategy.bench.ranks import choose_launcher, start_ranks
from zero_strategy.testing import rel_error
from zero_strategy.testing.launcher import RankFailure

__all__ = ["CORE_ROWS", "PEER_ROWS", "BenchOptions", "run_bench", "summarize"]

CORE_ROWS = ("ddp", "zero1", "zero2", "zero3", "zero3_cpu", "zero3_nvme")
PEER_ROWS = ("fsdp2", "deepspeed1", "deepspeed2", "deepspeed3")
LABELS = {
    "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
    "zero3_cpu": "ZeRO-3 + CPU offload", "zero3_nvme": "ZeRO-3 + NVMe",
    "fsdp2": "FSDP2 (torch)", "deepspeed1": "DeepSpeed ZeRO-1", "deepspeed2": "DeepSpeed ZeRO-2",
    "deepspeed3": "DeepSpeed ZeRO-3",
}  # fmt: skip
LOSS_RTOL = 1e-5  # fp32 rows see the same weights and data: a larger difference is a numerics bug


@dataclass(frozen=True)
class BenchOptions:
    model: str = "small"
    ranks: tuple[int, ...] = (1, 2)
    steps: int = 5
    warmup: int = 2
    repeats: int = 1
    batch: int = 4  # micro-batch per rank
    peers: bool = False
    rows: tuple[str, ...] = CORE_ROWS
    timeout: float = 900.0
    fresh: bool = False  # True: each row in its own ranks (clean peak RSS); False: one launch per rank count
    progress: bool = field(default_factory=lambda: sys.stderr.isatty() and _has_rich())
    launcher: str = "auto"  # "torchrun" where torch has it, else "own" (zero_strategy.testing.launch)

    def __post_init__(self) -> None:
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"bench: --ranks {self.ranks}: give positive rank counts, e.g. 1,2,4")
        if self.steps < 1 or self.warmup < 0 or self.repeats < 1:
            raise ValueError("bench: --steps and --repeats must be >= 1, --warmup >= 0")
        unknown = set(self.rows) - set(CORE_ROWS) - set(PEER_ROWS)
        if unknown:
            raise ValueError(f"bench: unknown row(s) {sorted(unknown)}; choose from {CORE_ROWS + PEER_ROWS}")
        choose_launcher(self.launcher)  # an unknown or missing launcher fails before any run


def peer_status() -> dict[str, str]:
    """Why a peer row runs or not: "ok", or the reason shown in its table cells."""
    out = {"fsdp2": "ok" if importlib.util.find_spec("torch.distributed.fsdp") else "not installed"}
    ds = "ok" if importlib.util.find_spec("deepspeed") is not None else "not installed"
    out.update({row: ds for row in PEER_ROWS if row.startswith("deepspeed")})
    return out


def _has_rich() -> bool:
    """The progress bar's library (the ``bench`` extra); without it the bench runs without a bar."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str, Path, int], None]]:
    """Yields ``start(description, file, steps)``: the bar follows the step count rank 0 writes
    to ``file`` (up to ``steps``) until the next start. Without a terminal (pipes, tests) it
    shows nothing."""
    if not enabled:
        yield lambda desc, path, steps: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    state: dict[str, Any] = {"path": None, "base": 0, "steps": 0, "stop": False}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:  # fmt: skip
        task = bar.add_task("bench", total=total)

        def poll() -> None:
            while not state["stop"]:
                path = state["path"]
                try:
                    done = int(path.read_text().split()[0]) if path is not None else 0
                except (OSError, ValueError, IndexError):
                    done = 0
                bar.update(task, completed=state["base"] + done)
                time.sleep(0.2)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()

        def start(desc: str, path: Path, steps: int) -> None:
            state["base"] += state["steps"]  # the previous launch is done
            state["path"], state["steps"] = path, steps
            bar.update(task, description=desc, completed=state["base"])

        try:
            yield start
        finally:
            state["stop"] = True
            thread.join()
            bar.update(task, completed=total)


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Run every row at every rank count ``opts.repeats`` times; return the raw per-rank results
    (``runs[row][str(ranks)]``: one entry per repeat) with the options and peers' status."""
    from zero_strategy.bench.estimate import count_model

    n_params, largest = count_model(opts.model)
    peers = peer_status()
    rows = [r for r in opts.rows if r in CORE_ROWS] + ([r for r in PEER_ROWS if r in opts.rows or opts.peers])
    runs: dict[str, dict[str, list[Any]]] = {r: {str(n): [] for n in opts.ranks} for r in rows}
    per_run = opts.warmup + opts.steps
    launched = [r for r in rows if peers.get(r, "ok") == "ok"]
    total = opts.repeats * len(opts.ranks) * len(launched) * per_run
    launcher = choose_launcher(opts.launcher)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero_bench_") as tmp, _progress(opts.progress, total) as start:
        swap = os.path.join(tmp, "swap")
        os.makedirs(swap, exist_ok=True)
        for rep in range(opts.repeats):
            for n in opts.ranks:
                for row in rows:
                    if row not in launched:
                        runs[row][str(n)].append({"status": peers[row]})
                groups = [[r] for r in launched] if opts.fresh else [launched]
                for group in groups:
                    prog = Path(tmp, f"progress_{rep}_{n}_{group[0]}")
                    what = LABELS[group[0]] if len(group) == 1 else f"{len(group)} rows"
                    start(f"{what}, {n} rank(s), repeat {rep + 1}/{opts.repeats}", prog, len(group) * per_run)
                    spec = {"model": opts.model, "steps": opts.steps, "warmup": opts.warmup, "batch": opts.batch,
                            "nvme_path": swap, "progress": str(prog)}  # fmt: skip
                    t_run = time.monotonic()
                    try:
                        per_rank = start_ranks(_run_rows(), n, args=(group, spec), timeout=opts.timeout * len(group),
                                               env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
                                               launcher=launcher)  # fmt: skip
                        results: list[dict[str, Any]] = [
                            {"status": "ok", "ranks": [rk[k] for rk in per_rank]} for k in range(len(group))
                        ]
                    except RankFailure as exc:  # (LaunchTimeout too) a failing row is an error cell, never a silent gap
                        results = [{"status": "error: " + str(exc).splitlines()[0][:200]} for _ in group]
                    wall = time.monotonic() - t_run
                    for row, result in zip(group, results):
                        result["wall_s"] = round(wall / len(group), 3)
                        runs[row][str(n)].append(result)
                    log(f"{what} x{n} (repeat {rep + 1}): {results[0]['status']}, {wall:.0f} s")
    return {
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
        "n_params": n_params,
        "largest_layer": largest,
        "peers": peers,
        "launcher": launcher,
        "runs": runs,
        "wall_s": time.monotonic() - t0,
    }


def _run_rows() -> Callable[..., Any]:
    from zero_strategy.bench.worker import run_rows  # torch: only once the bench runs

    return run_rows


def formula_bytes(row: str, n_params: int, ranks: int, persistent: int = 0) -> tuple[str, float, list[float]]:
    """(formula name, model-state bytes per rank, [device, host, disk] bytes) that a row's
    measurement is checked against; ``persistent``: parameters of ZeRO-3 units that stay
    gathered (from the run's engine)."""
    if row == "fsdp2":
        est = zero_paper(Setup(n_params, ranks, 3, "fp32"))
        return "ZeRO paper, fp32 AdamW", est.total, [est.device, est.host, est.disk]
    if row.startswith("deepspeed"):
        est = zero_paper(Setup(n_params, ranks, int(row[-1]), "fp32"))
        return "ZeRO paper, fp32 AdamW", est.total, [est.device, est.host, est.disk]
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(row, 3)
    off = {"zero3_cpu": "cpu", "zero3_nvme": "nvme"}.get(row, "none")
    est = this_engine(Setup(n_params, ranks, stage, "fp32", "adamw", off, off, persistent=persistent))
    return "this engine, fp32 AdamW", est.total, [est.device, est.host, est.disk]


def _mean_losses(ranks: list[dict[str, Any]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*(r["losses"] for r in ranks))]


def summarize(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per (row, rank count): medians over repeats of rank 0's step time, the largest
    model-state and RSS peak over ranks, samples/s, exposed communication %, losses (mean over
    ranks, last repeat) and whether they equal DDP's at the same rank count."""
    opts, out = raw["options"], []
    ddp = raw["runs"].get("ddp", {})
    for row, by_n in raw["runs"].items():
        for n, reps in by_n.items():
            ok = [r for r in reps if r["status"] == "ok"]
            persistent = ok[-1]["ranks"][0]["persistent_params"] if ok else 0
            name, formula, tiers = formula_bytes(row, raw["n_params"], int(n), persistent)
            entry: dict[str, Any] = {"row": row, "label": LABELS[row], "ranks": int(n), "formula": name,
                                     "formula_bytes": formula, "formula_tiers": tiers}  # fmt: skip
            if not ok:
                entry["status"] = reps[-1]["status"] if reps else "not run"
                out.append(entry)
                continue
            last = ok[-1]["ranks"]
            step = statistics.median(r["ranks"][0]["median_step_s"] for r in ok)
            peak = max((rk["model_state"] for rk in last), key=lambda s: s["model_state"])
            pct = [r["ranks"][0]["exposed_pct"] for r in ok if r["ranks"][0]["exposed_pct"] is not None]
            losses = _mean_losses(last)
            entry.update(
                status="ok",
                step_s=step,
                samples_per_s=int(n) * opts["batch"] / step,
                model_state_bytes=peak["model_state"],
                tiers={k: v for k, v in peak.items() if k.startswith("tier_")},
                peak_rss_bytes=max(rk["peak_rss_bytes"] for rk in last),
                exposed_pct=statistics.median(pct) if pct else None,
                breakdown=_breakdown(ok),
                losses=losses,
                loss_vs_ddp=_loss_vs(losses, ddp.get(n, [])),
            )
            out.append(entry)
    return out


def _breakdown(ok: list[dict[str, Any]]) -> dict[str, float | None]:
    """Seconds per step (rank 0, median over repeats): compute (forward + backward without
    exposed communication and offload I/O), exposed communication, optimizer step (without
    either), offload I/O (the time the training thread waited on the disk tier's swap-file
    reads and writes, in both phases; the host tier's copies are memory copies and stay in
    compute and optimizer)."""
    r0 = [r["ranks"][0] for r in ok]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in r0)

    fb, opt, io_fb, io_op = (
        med("forward_backward_s"),
        med("optimizer_s"),
        med("io_forward_backward_s"),
        med("io_optimizer_s"),
    )
    if r0[0]["exposed_forward_backward_s"] is None:
        return {"compute": fb - io_fb, "exposed_comm": None, "optimizer": opt - io_op, "offload_io": io_fb + io_op}
    e_fb, e_op = med("exposed_forward_backward_s"), med("exposed_optimizer_s")
    return {"compute": fb - e_fb - io_fb, "exposed_comm": e_fb + e_op, "optimizer": opt - e_op - io_op,
            "offload_io": io_fb + io_op}  # fmt: skip


def _loss_vs(losses: list[float], ddp_reps: list[dict[str, Any]]) -> float | str:
    """Largest relative difference of every step's loss from DDP's (NaN-strict), or why none."""
    ref = [r for r in ddp_reps if r["status"] == "ok"]
    if not ref:
        return "no DDP run"
    try:
        return rel_error(losses, _mean_losses(ref[-1]["ranks"]), what="losses")
    except AssertionError as exc:  # a non-finite loss or another number of steps
        return f"differs: {str(exc).splitlines()[0]}"
