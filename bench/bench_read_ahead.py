"""ZeRO-3 with the parameter rows on NVMe: step time with the rows read ahead in the background
(the default) against read when each gather is issued (``ZERO_STRATEGY_DISK_READ_AHEAD=0``).

One process (the overlap is a property of each rank: its reader thread against its compute),
the bench GPT, ``offload_param: nvme`` and ``offload_optimizer: cpu``, persistence threshold 0,
so every block's rows are read from its swap file at each gather (``O_DIRECT`` where the
filesystem allows, so the reads come from the disk, not the page cache). The two settings are
interleaved, ``--repeats`` times each; the figure is the median s/step over the measured steps.
It also prints the time the training thread spent reading rows (the reads left on the critical
path) and the numbers of reads ahead and inline.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/bench_read_ahead.py --path /tmp/ra --layers 8 --d-model 512

A third row runs DeepSpeed's ZeRO-Infinity on the same model, batch, steps and disk
(``offload_param: nvme`` with its ``async_io`` op, ``offload_optimizer: cpu`` with the same
torch AdamW, persistence threshold 0) in a child process with ``DS_ACCELERATOR=cpu``, one rank
on gloo. Its ``async_io`` op needs libaio (``apt-get install libaio-dev``) and a compiler to
build once; where ``AsyncIOBuilder().is_compatible()`` is False, or DeepSpeed is missing or
fails, the row is left out with the reason printed (``--no-deepspeed`` leaves it out too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import zero_strategy as zs
from zero_strategy.models import GPT, GPTConfig
from zero_strategy.runtime.module import get_engine


def _run(args: argparse.Namespace, read_ahead: bool) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=8)
    swap = tempfile.mkdtemp(dir=args.path)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": swap},
                                    "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    model, opt = zs.initialize(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-4), config=config)
    rows = get_engine(model).disk.row_swap
    if rows is None:
        raise SystemExit("no parameter rows on disk: check offload_param")
    rows.read_ahead = read_ahead
    inline = 0.0
    from zero_strategy.storage import disk_rows  # time the inline reads: DiskRows._read on the training thread

    original = disk_rows.DiskRows._read

    def timed(self, slab, *, skip):  # type: ignore[no-untyped-def]
        nonlocal inline
        t0 = time.perf_counter()
        original(self, slab, skip=skip)
        inline += time.perf_counter() - t0

    disk_rows.DiskRows._read = timed  # type: ignore[method-assign]
    times = []
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            if step == args.warmup:
                inline = 0.0
                rows.reads.update(ahead=0, inline=0)
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        reads = dict(rows.reads)
        swap_mib = get_engine(model).disk.disk_bytes()["param_shards"] / 2**20
    finally:
        disk_rows.DiskRows._read = original  # type: ignore[method-assign]
        get_engine(model).close()
        shutil.rmtree(swap, ignore_errors=True)
    return {"s_step": statistics.median(times), "inline_read_s": inline / args.steps,
            "ahead": reads["ahead"] / args.steps, "inline": reads["inline"] / args.steps,
            "swap_mib": swap_mib}  # fmt: skip


def _deepspeed_step_times(args: argparse.Namespace) -> dict[str, object]:
    """In the child process (``DS_ACCELERATOR=cpu`` set before the import): DeepSpeed's
    ZeRO-Infinity on the same model and data; ``{"skip": reason}`` where it cannot run."""
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # any failure to import is a reason to leave the row out
        return {"skip": f"deepspeed does not import: {type(e).__name__}: {e}"}
    if not AsyncIOBuilder().is_compatible():
        return {"skip": "DeepSpeed's async_io op is not compatible here (libaio missing: apt-get install libaio-dev)"}
    from zero_strategy.bench.peers import deepspeed_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=8)
    probe = GPT(cfg)
    biggest = max(p.numel() for p in probe.parameters())
    block = sum(p.numel() for p in probe.blocks[0].parameters())
    # a buffer per parameter it swaps (those of 1 MiB and more): with fewer, its step asserts
    # "Not enough buffers" on this machine (they are not all released before the step)
    swapped = sum(p.numel() * 4 >= 2**20 for p in probe.parameters())
    swap = tempfile.mkdtemp(dir=args.path)
    config = deepspeed_config(
        args.batch,
        {"stage": 3, "stage3_param_persistence_threshold": 0,
         "stage3_prefetch_bucket_size": args.ds_prefetch if args.ds_prefetch >= 0 else block,
         "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_size": biggest, "buffer_count": swapped + 2,
                           "max_in_cpu": 0},  # its default 1e9 moves every row back to host memory
         "offload_optimizer": {"device": "cpu"}},
        zero_force_ds_cpu_optimizer=False,  # the same torch AdamW as ours, not its compiled CPU Adam
    )  # fmt: skip
    # built under zero.Init so that its parameters get the config's fp32 (initialize's own
    # conversion picks bf16 on the CPU accelerator, and the NVMe buffers then mismatch)
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    times = []
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            t0 = time.perf_counter()
            logits = engine(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(swap) for f in fs)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return {"s_step": statistics.median(times), "swap_mib": on_disk / 2**20}


def _deepspeed(args: argparse.Namespace) -> dict[str, object]:
    """DeepSpeed's row, from a child process (its accelerator and process group stay there)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    argv = [sys.executable, os.path.abspath(__file__), "--_deepspeed", *sys.argv[1:]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.deepspeed_timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("DEEPSPEED_RESULT "):
            return dict(json.loads(line.removeprefix("DEEPSPEED_RESULT ")))
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"skip": f"DeepSpeed's run failed (exit {done.returncode}): {' / '.join(tail)}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=tempfile.gettempdir(), help="directory for the swap files (a real disk)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's ZeRO-Infinity row out")
    p.add_argument("--deepspeed-timeout", type=float, default=900.0, help="seconds for DeepSpeed's child run")
    p.add_argument("--ds-prefetch", type=int, default=0,
                   help="DeepSpeed's stage3_prefetch_bucket_size (0, the default: no prefetch, since its NVMe "
                        "prefetch fails an assertion here; -1: one block's elements)")  # fmt: skip
    p.add_argument("--_deepspeed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._deepspeed:
        print("DEEPSPEED_RESULT " + json.dumps(_deepspeed_step_times(args)), flush=True)
        return
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for ahead in (False, True):
            results[ahead].append(_run(args, ahead))
    ds = None if args.no_deepspeed else _deepspeed(args)  # after ours: its process is separate
    for _ in range(args.repeats - 1 if ds is not None and "s_step" in ds else 0):
        more = _deepspeed(args)  # the median over the repeats, as ours
        ds["runs"] = [*ds.get("runs", [ds["s_step"]]), more.get("s_step", float("nan"))]  # type: ignore[list-item]
    print("| rows read | s/step | ratio | training thread reading rows, s/step | reads ahead / inline per step |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(r["s_step"] for r in results[False])
    for ahead in (False, True):
        rs = results[ahead]
        s = statistics.median(r["s_step"] for r in rs)
        io = statistics.median(r["inline_read_s"] for r in rs)
        name = "ahead, in the background" if ahead else "at each gather (READ_AHEAD=0)"
        print(f"| {name} | {s:.3f} | {s / base:.2f}x | {io:.3f} | {rs[0]['ahead']:.0f} / {rs[0]['inline']:.0f} |")
    if ds is not None and "s_step" in ds:
        s = statistics.median(ds.get("runs", [ds["s_step"]]))  # type: ignore[arg-type]
        print(f"| DeepSpeed ZeRO-Infinity (async_io) | {s:.3f} | {s / base:.2f}x | - | - |")
        ours = results[True][0]["swap_mib"]
        print(f"\nswap files after the steps: DeepSpeed {float(str(ds['swap_mib'])):.1f} MiB, ours {ours:.1f} MiB")
    elif ds is not None:
        print(f"\nDeepSpeed's ZeRO-Infinity row left out: {ds['skip']}")


if __name__ == "__main__":
    main()
