#!/usr/bin/env python
"""Step-time and memory benchmark: zero-strategy against DDP, FSDP2 and DeepSpeed ZeRO.

Trains the bundled GPT on 2 CPU ranks (gloo, ``OMP_NUM_THREADS=1``) with every engine,
each in 2 fresh processes, and prints one markdown table. See ``bench/README.md``.

The same file is both the harness (default) and the per-rank worker (``--_worker``);
the harness spawns the workers itself with ``subprocess`` on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:  # run from a checkout without installing or setting PYTHONPATH
    sys.path.insert(0, _REPO_ROOT)

ALL_ENGINES = [
    "ddp",
    "fsdp2_noreshard",
    "fsdp2",
    "ds1",
    "ds2",
    "ds3",
    "zero1",
    "zero2",
    "zero3",
    "zero1_native",
    "zero2_native",
    "zero3_native",
    "ds2_offload",
    "ds3_offload",
    "zero2_offload",
    "zero3_offload",
]
# not in a plain run's default list: the offload engines answer another question (issue 12)
DEFAULT_ENGINES = [e for e in ALL_ENGINES if not e.endswith("_offload")]
ENGINE_NOTES = {
    "ddp": "torch DDP (baseline)",
    "fsdp2_noreshard": "FSDP2 fully_shard, reshard_after_forward=False (~ZeRO-2)",
    "fsdp2": "FSDP2 fully_shard, reshard_after_forward=True (~ZeRO-3)",
    "ds1": "DeepSpeed ZeRO stage 1",
    "ds2": "DeepSpeed ZeRO stage 2",
    "ds3": "DeepSpeed ZeRO stage 3",
    "zero1": "zero-strategy stage 1",
    "zero2": "zero-strategy stage 2",
    "zero3": "zero-strategy stage 3",
    "zero1_native": "zero-strategy stage 1, collective_impl=native (the NCCL code path, without gloo's p2p exchange)",
    "zero2_native": "zero-strategy stage 2, collective_impl=native",
    "zero3_native": "zero-strategy stage 3, collective_impl=native",
    "ds2_offload": "DeepSpeed ZeRO stage 2, offload_optimizer cpu, its compiled DeepSpeedCPUAdam (config optimizer AdamW)",
    "ds3_offload": "DeepSpeed ZeRO stage 3, offload_optimizer + offload_param cpu, DeepSpeedCPUAdam",
    "zero2_offload": "zero-strategy stage 2, offload_optimizer cpu (torch AdamW, fused CPU kernel chosen by us)",
    "zero3_offload": "zero-strategy stage 3, offload_optimizer + offload_param cpu (torch AdamW, fused)",
}
OFFLOAD_CPU = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_BOTH = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
WORLD_SIZE = 2
MICRO_BATCH = 2
LR = 1e-4
SEED = 0
MIB = 1024 * 1024


# --------------------------------------------------------------------------------------
# Worker (one rank of one engine run)
# --------------------------------------------------------------------------------------


def _gpt_config(tiny: bool):
    from zero_strategy.models import GPTConfig

    if tiny:
        return GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=2, n_head=4, tie_embeddings=False)
    return GPTConfig.bench()


def _make_optimizer(params, fused: bool):
    import torch

    return torch.optim.AdamW(params, lr=LR, fused=True) if fused else torch.optim.AdamW(params, lr=LR)


def _optimizer_desc(opt, fused: bool) -> str:
    inner = getattr(opt, "optimizer", None)  # DeepSpeed / wrapper optimizers keep the user's one here
    base = f"torch.optim.AdamW(lr={LR:g}, fused={fused})"
    outer = type(opt).__name__
    if inner is not None and inner is not opt:
        return f"{base} wrapped by {outer}"
    if outer != "AdamW":
        return f"{base} wrapped by {outer}"
    return base


def _live_tensor_bytes() -> tuple[int, int, list[dict]]:
    """Bytes of unique live tensor storages reachable as Python objects (gc), their count, the largest.

    nn.Parameters are tensors; a DTensor contributes its local tensor. Storages are deduplicated
    by ``untyped_storage().data_ptr()`` so views and shared buffers count once. Buffers held only
    by C++ (e.g. DDP's reducer buckets, gloo scratch) are invisible here; peak RSS covers them.
    """
    import gc

    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # type: ignore[assignment]

    gc.collect()
    seen: dict[int, int] = {}
    what: dict[int, str] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            t = obj
            if DTensor and isinstance(t, DTensor):
                t = t._local_tensor
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0:
                continue
            if st.nbytes() >= seen.get(ptr, 0):
                seen[ptr] = st.nbytes()
                what[ptr] = f"{type(obj).__name__}{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        except Exception:
            continue
    top = sorted(seen, key=seen.__getitem__, reverse=True)[:5]
    largest = [{"mib": seen[p] / MIB, "tensor": what[p]} for p in top]
    return sum(seen.values()), len(seen), largest


def _peak_rss_mib() -> float:
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    try:
        import psutil

        cur = psutil.Process().memory_info().rss / MIB
    except Exception:
        cur = 0.0
    return max(peak_kib / 1024.0, cur)


def _build_engine(engine: str, cfg, fused: bool, rank: int):
    """Returns (train_step, optimizer_desc, model_for_memory). train_step(x, y) -> loss tensor."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from zero_strategy.models import GPT

    class LossModule(nn.Module):
        """forward(x, y) returns the loss, so wrappers that hook forward() see the whole step."""

        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, x, y):
            return self.gpt.loss(x, y)

    torch.manual_seed(SEED)

    if engine.startswith("ds"):
        import deepspeed  # an import failure is an error in the table, as any other

        from zero_strategy import ZeroConfig
        from zero_strategy.bench.peers import deepspeed_config

        deepspeed.init_distributed(dist_backend="gloo")
        stage = int(engine[2])
        offload = engine.endswith("_offload")
        torch.manual_seed(SEED)
        module = LossModule(GPT(cfg))
        # with offload DeepSpeed's own path: the config's AdamW becomes its compiled DeepSpeedCPUAdam
        opt = None if offload else _make_optimizer(module.parameters(), fused)
        # the same bucket sizes and persistence threshold as ours (our defaults)
        ds_config = deepspeed_config(
            MICRO_BATCH,
            {
                "stage": stage,
                "reduce_bucket_size": ZeroConfig().reduce_bucket_size,
                "allgather_bucket_size": ZeroConfig().allgather_bucket_size,
                **(
                    {
                        "stage3_param_persistence_threshold": ZeroConfig().stage3_param_persistence_threshold,
                        "stage3_prefetch_bucket_size": ZeroConfig().reduce_bucket_size,
                    }
                    if stage == 3
                    else {}
                ),
                **((OFFLOAD_BOTH if stage == 3 else OFFLOAD_CPU) if offload else {}),
            },
            **({"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}} if offload else {}),
        )
        model, ds_opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)

        def step(x, y):
            loss = model(x, y)
            model.backward(loss)
            model.step()  # optimizer step + zero_grad
            return loss

        return step, _optimizer_desc(ds_opt, fused), model

    dist.init_process_group("gloo")

    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(LossModule(GPT(cfg)), gradient_as_bucket_view=True)  # DDP's best memory setting
        opt = _make_optimizer(model.parameters(), fused)

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step, _optimizer_desc(opt, fused), model

    if engine in ("fsdp2", "fsdp2_noreshard"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        reshard = engine == "fsdp2"
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        gpt = GPT(cfg)
        for blk in gpt.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(gpt, mesh=mesh, reshard_after_forward=reshard)
        opt = _make_optimizer(gpt.parameters(), fused)

        def step(x, y):
            loss = gpt.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step, _optimizer_desc(opt, fused), gpt

    if engine.startswith("zero"):
        import zero_strategy as zs

        stage = int(engine[4])
        impl = "native" if engine.endswith("_native") else "auto"
        offload = (OFFLOAD_BOTH if stage == 3 else OFFLOAD_CPU) if engine.endswith("_offload") else {}
        gpt = GPT(cfg)
        opt = _make_optimizer(gpt.parameters(), fused)
        model, opt = zs.initialize(gpt, opt, config=zs.ZeroConfig(stage=stage, collective_impl=impl, **offload))

        def step(x, y):
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step, _optimizer_desc(opt, fused), model

    raise ValueError(f"unknown engine {engine!r}")


def worker_main(args: argparse.Namespace) -> int:
    import traceback

    rank = int(os.environ["RANK"])
    out = Path(args.out_dir) / f"rank{rank}.json"

    def write(obj: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        tmp.replace(out)

    engine = args._worker
    try:
        import torch
        import torch.distributed as dist

        from zero_strategy.models import synthetic_batch

        cfg = _gpt_config(args.tiny)
        step, opt_desc, model = _build_engine(engine, cfg, args.fused, rank)

        times: list[float] = []
        losses: list[float] = []
        loss_val = float("nan")
        n_total = args.warmup + args.steps
        for i in range(n_total):
            x, y = synthetic_batch(cfg, batch=MICRO_BATCH, step=i, seed=rank)
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(x, y)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
            loss_val = float(loss.detach())
            losses.append(loss_val)
            del loss
        dist.barrier()
        del x, y
        state_bytes, n_storages, largest = _live_tensor_bytes()
        result = {
            "status": "ok",
            "engine": engine,
            "rank": rank,
            "step_times": times,
            "median_step_s": statistics.median(times) if times else float("nan"),
            "peak_rss_mib": _peak_rss_mib(),
            "model_state_mib": state_bytes / MIB,
            "live_storages": n_storages,
            "largest_storages": largest,
            "final_loss": loss_val,
            "losses": losses,
            "optimizer": opt_desc,
            "torch": torch.__version__,
        }
        write(result)
        dist.barrier()
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        return 0
    except BaseException:
        tb = traceback.format_exc()
        write(
            {"status": "error", "engine": engine, "rank": rank, "reason": tb.strip().splitlines()[-1], "traceback": tb}
        )
        print(tb, file=sys.stderr, flush=True)
        os._exit(1)


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _kill_group(p: subprocess.Popen) -> None:
    """Kill the process group of a worker we started (its own session, so only its children)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run_engine(engine: str, args: argparse.Namespace, log) -> dict:
    """Launch WORLD_SIZE fresh worker processes for one engine run; collect their results."""
    with tempfile.TemporaryDirectory(prefix=f"bench_{engine}_") as d:
        out_dir = Path(d)
        port = _free_port()
        repo_root = _REPO_ROOT
        procs: list[subprocess.Popen] = []
        logs: list[Path] = []
        for rank in range(WORLD_SIZE):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(WORLD_SIZE),
                LOCAL_WORLD_SIZE=str(WORLD_SIZE),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                DS_ACCELERATOR="cpu",
                PYTHONPATH=repo_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
            )
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--_worker",
                engine,
                "--_out",
                str(out_dir),
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
            ]
            if args.tiny:
                cmd.append("--tiny")
            if args.fused:
                cmd.append("--fused")
            lp = out_dir / f"rank{rank}.log"
            logs.append(lp)
            with open(lp, "wb") as lf:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
                )

        t_start = time.monotonic()
        deadline = t_start + args.timeout
        first_exit: float | None = None
        timed_out = False
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    break
                # One rank gone (an error) while its peer waits in a collective: short grace, then kill.
                if first_exit is None and any(p.poll() is not None for p in procs):
                    first_exit = now
                if first_exit is not None and now - first_exit > 60:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill_group(p)
        wall = time.monotonic() - t_start

        ranks = []
        for rank in range(WORLD_SIZE):
            f = out_dir / f"rank{rank}.json"
            ranks.append(json.loads(f.read_text()) if f.exists() else None)
        rcs = [p.returncode for p in procs]

        if all(r is not None and r["status"] == "ok" for r in ranks) and not timed_out:
            return {"status": "ok", "ranks": ranks, "wall_s": wall}
        reason = f"timed out after {args.timeout}s" if timed_out else f"exit codes {rcs}"
        errs = [r for r in ranks if r is not None and r["status"] == "error"]
        if errs:
            reason += f"; {errs[0]['reason']}"
        tails = {f"rank{i}": _tail(lp) for i, lp in enumerate(logs)}
        return {"status": "error", "reason": reason, "log_tail": tails, "wall_s": wall}


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None or v != v else format(v, spec)


def _ratio(v: float | None, base: float | None) -> str:
    if v is None or base is None or v != v or base != base or base == 0:
        return "–"
    return f"{v / base:.2f}×"


def summarize(engines: list[str], runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for e in engines:
        ok = [r for r in runs.get(e, []) if r["status"] == "ok"]
        if not ok:
            bad = [r for r in runs.get(e, []) if r["status"] != "ok"]
            summary[e] = {
                "status": bad[-1]["status"] if bad else "not run",
                "reason": bad[-1].get("reason", "") if bad else "",
            }
            continue
        per_run = [r["ranks"][0]["median_step_s"] for r in ok]
        rss = [max(rk["peak_rss_mib"] for rk in r["ranks"]) for r in ok]
        state = [r["ranks"][0]["model_state_mib"] for r in ok]
        last = ok[-1]["ranks"]
        losses = [sum(col) / len(col) for col in zip(*(rk["losses"] for rk in last))]  # per step, mean over ranks
        summary[e] = {
            "status": "ok",
            "losses": losses,
            "runs_ok": len(ok),
            "runs_failed": len(runs[e]) - len(ok),
            "step_s_median": statistics.median(per_run),
            "step_s_min": min(per_run),
            "step_s_max": max(per_run),
            "per_run_medians": per_run,
            "peak_rss_mib": statistics.median(rss),
            "model_state_mib_rank0": statistics.median(state),
            "final_loss_rank0": last[0]["final_loss"],
            "final_loss_mean": statistics.fmean(rk["final_loss"] for rk in last),
            "optimizer": last[0]["optimizer"],
            "largest_storage_rank0": last[0]["largest_storages"][0] if last[0]["largest_storages"] else None,
        }
    return summary


def _loss_vs(losses: list[float], ref: list[float] | None) -> str:
    """Largest relative difference of every step's loss from DDP's (NaN-strict)."""
    if ref is None:
        return "–"
    from zero_strategy.testing import rel_error

    try:
        err = rel_error(losses, ref)
    except AssertionError as e:  # a non-finite loss or a different number of steps
        return f"differs: {e}"
    return f"{err:.1e}" + ("" if err <= 1e-5 else " (> 1e-5)")


def render_table(engines: list[str], summary: dict[str, dict]) -> str:
    base = summary.get("ddp", {})
    b_t = base.get("step_s_median")
    b_r = base.get("peak_rss_mib")
    b_m = base.get("model_state_mib_rank0")
    head = (
        "| engine | s/step (median) | spread | ratio to ddp | peak RSS MiB (max over ranks) | ratio to ddp "
        "| model-state MiB (rank 0) | ratio to ddp | final loss | every step's loss vs ddp (max rel) |"
    )
    lines = [head, "|" + "---|" * 10]
    for e in engines:
        s = summary[e]
        if s["status"] != "ok":
            reason = " ".join(str(s.get("reason", "")).split())[:160]
            lines.append(f"| {e} | {s['status']}: {reason} | | | | | | | | |")
            continue
        spread = f"{s['step_s_min']:.3f}–{s['step_s_max']:.3f}"
        if s["runs_failed"]:
            spread += f" ({s['runs_failed']} run(s) failed)"
        lines.append(
            f"| {e} | {s['step_s_median']:.3f} | {spread} | {_ratio(s['step_s_median'], b_t)} "
            f"| {s['peak_rss_mib']:.0f} | {_ratio(s['peak_rss_mib'], b_r)} "
            f"| {s['model_state_mib_rank0']:.1f} | {_ratio(s['model_state_mib_rank0'], b_m)} "
            f"| {s['final_loss_mean']:.4f} | {_loss_vs(s['losses'], base.get('losses'))} |"
        )
    return "\n".join(lines)


def machine_info() -> dict:
    import torch

    try:
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:
        ds = "not installed"
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "deepspeed": ds,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
    }


def harness_main(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ALL_ENGINES]
    if unknown:
        print(f"unknown engine(s): {unknown}; choose from {','.join(ALL_ENGINES)}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = machine_info()
    command = "OMP_NUM_THREADS=1 " + " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    log(
        f"# {len(engines)} engine(s) x {args.repeats} repeat(s), {args.warmup} warmup + {args.steps} steps, "
        f"{'tiny' if args.tiny else 'bench'} GPT, {WORLD_SIZE} ranks, timeout {args.timeout}s per run"
    )
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    t0 = time.monotonic()
    for rep in range(args.repeats):
        for e in engines:  # interleaved: ddp, fsdp2, ..., then ddp, fsdp2, ... again
            log(f"[repeat {rep + 1}/{args.repeats}] {e} ...")
            r = run_engine(e, args, log)
            runs[e].append(r)
            if r["status"] == "ok":
                rk = r["ranks"]
                log(
                    f"    {e}: {rk[0]['median_step_s']:.3f} s/step, loss {rk[0]['final_loss']:.4f}, "
                    f"RSS {max(x['peak_rss_mib'] for x in rk):.0f} MiB, state {rk[0]['model_state_mib']:.1f} MiB "
                    f"({r['wall_s']:.0f}s wall)"
                )
            else:
                log(f"    {e}: FAILED: {r['reason']}")
                for name, tail in r.get("log_tail", {}).items():
                    log(f"    --- {name} log tail ---")
                    log("\n".join("    " + ln for ln in tail.splitlines()))
    total = time.monotonic() - t0

    summary = summarize(engines, runs)
    cfg = _gpt_config(args.tiny)
    from zero_strategy.models import GPT, num_parameters

    n_params = num_parameters(GPT(cfg))
    opts = sorted({s["optimizer"] for s in summary.values() if s.get("status") == "ok"})

    print(
        f"Machine: nproc {info['nproc']} ({info['cpu']}), torch {info['torch']}, deepspeed {info['deepspeed']}, "
        f"python {info['python']}, {info['date']}"
    )
    print(
        f"Setup: GPT {n_params / 1e6:.1f}M params (vocab {cfg.vocab_size}, d {cfg.d_model}, {cfg.n_layer} layers, "
        f"seq {cfg.seq_len}), {WORLD_SIZE} ranks CPU/gloo, OMP_NUM_THREADS=1, micro-batch {MICRO_BATCH}, fp32, "
        f"{args.warmup} warmup + {args.steps} measured steps, {args.repeats} interleaved repeat(s); "
        f"total {total:.0f}s"
    )
    print(f"Command: `{command}`")
    print()
    print(render_table(engines, summary))
    print()
    for e in engines:
        if summary[e].get("status") == "ok":
            big = summary[e]["largest_storage_rank0"]
            big_s = f"; largest live storage {big['mib']:.1f} MiB ({big['tensor']})" if big else ""
            print(f"- {e}: {ENGINE_NOTES[e]}; optimizer {summary[e]['optimizer']}{big_s}")
        else:
            print(f"- {e}: {ENGINE_NOTES[e]}; {summary[e]['status']}")
    print(
        "\ns/step: median over runs of rank 0's median step time (forward+backward+step+zero_grad, timed after a "
        "barrier); spread: min–max of the per-run medians. Peak RSS: ru_maxrss, max over ranks. Model state: "
        "unique live tensor storages reachable through gc after the last step (params, grads, optimizer state, "
        "engine buffers held by Python). Final loss: last step, mean over ranks."
    )

    if args.json:
        payload = {
            "machine": info,
            "command": command,
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "n_params": n_params,
            "optimizers": opts,
            "summary": summary,
            "runs": runs,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2))
        log(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"comma list from {','.join(ALL_ENGINES)}")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps per run (default 3; --tiny: 2)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 20; --tiny: 3)")
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats of the engine list (default 3; --tiny: 1)"
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds before one engine run is killed (default 600)")
    p.add_argument("--fused", action="store_true", help="torch.optim.AdamW(fused=True) for every engine")
    p.add_argument("--tiny", action="store_true", help="tiny GPT (d 128, 2 layers), 2+3 steps, 1 repeat: smoke check")
    p.add_argument("--json", metavar="OUT", default=None, help="write raw numbers to OUT")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", dest="out_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = (2, 3, 1) if args.tiny else (3, 20, 3)
    for name, d in zip(("warmup", "steps", "repeats"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, d)
    if args._worker:
        return worker_main(args)
    return harness_main(args)


if __name__ == "__main__":
    sys.exit(main())
