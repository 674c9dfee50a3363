"""Muon under ZeRO (docs/muon.md): ``[Muon(hidden matrices), AdamW(rest)]`` against AdamW alone, at DDP and ZeRO-1/2/3.

A small transformers Llama (``bench_gpu.py``'s ``Size``, built from its config, no download;
default hidden 256, 4 layers, intermediate 704, vocab 2048, 2 x 64 tokens per rank and step)
trains fp32 on 1, 2 and 4 ranks (the shared launcher: CPU, gloo, one thread per rank; on a
GPU, NCCL, one device per rank) under eight rows, one after the other in the same ranks:

- ``ddp_adamw``, ``ddp_muon``: ``DistributedDataParallel``; the reference of every ratio;
- ``zero{1,2,3}_adamw``, ``zero{1,2,3}_muon``: ``zero_strategy.initialize(model, opts, stage=s)``.

``_muon`` rows step ``torch.optim.Muon`` (lr 0.02) on the 2-D weights of the decoder layers and
``torch.optim.AdamW`` (lr 1e-3) on the embeddings, the head and the norms; ``_adamw`` rows step
one AdamW (lr 1e-3) on everything. Every row starts from the same weights (one saved
``state_dict``) and sees the same batches (by rank and step). Muon's Newton-Schulz runs in fp32
by default (``--ns-dtype fp32``: torch's quintic iteration, the same coefficients, without its
cast to bf16), so the whole run is fp32 and the loss check can be tight; ``--ns-dtype bf16``
runs torch's own. In bf16 the last-bit differences between DDP's and ZeRO's summation orders of
the averaged gradient can round an element of the orthogonalised update to the next bf16 value,
and the runs drift apart (bench/RESULTS.md: 1.5e-4 in the loss after 20 steps at 4 ranks).
Per row and rank:

- **loss vs DDP**: the largest relative difference of every step's loss from the DDP row with the
  same optimizers (same rank), NaN-strict. Over ``--rtol`` (1e-5, fp32) the row is refused: its
  losses are printed instead and the run exits 1. A check, not a timing;
- **s/step**: the median wall time of forward + backward + every ``step()`` + ``zero_grad()``
  (started after a barrier; the device synchronised at the end), and its ratio to DDP's;
- **NS ms**: the time spent inside torch's Newton-Schulz (``torch.optim._muon.
  _zeropower_via_newtonschulz``, wrapped) per step, wall and thread CPU time, on the slowest
  rank; the step waits for the slowest owner. CPU time is what the rank computed, which an
  oversubscribed machine does not inflate; wall time is what the step waited;
- **Muon state / AdamW state**: the bytes of each optimizer's state on the rank (unique
  storages: Muon's momentum, AdamW's two moments), the largest rank's, and its ratio to DDP's;
- **peak MiB**: on CPU the growth of the process's anonymous resident memory (``RssAnon``, after
  ``malloc_trim``) from before the row was built to its highest point after the forward, the
  backward and the step of ``--mem-steps`` further steps; on CUDA ``max_memory_allocated`` over
  those steps. The largest rank's, and the ratio to DDP's;
- **MiB moved/step**: this engine's collectives per step as its counters count them
  (``zs.comm_stats()``, the ZeRO paper's convention: a reduce-scatter or all-gather of Psi
  elements counts Psi, an all-to-all counts its input), rank 0's, and the ratio to the AdamW row
  of the same stage. The Muon exchange's share (``all_to_all``) summed over the ranks is checked
  against the formula ``3 x numel(matrices)`` elements (gradient and values to the owner, values
  back). DDP's own all-reduce is not counted by these counters ("-").

Then the owners' balance: the Newton-Schulz cost ``m * n * min(m, n)`` of each matrix as the
engine assigned it (``engine.whole.entries``), each rank's share, and the same from
``assign_owners`` for bench_gpu.py's larger Llama shapes at 2 to 8 ranks (machine-independent).

    OMP_NUM_THREADS=1 PYTHONPATH=.:integrations python bench/bench_muon.py            # ~300 CPU-seconds
    PYTHONPATH=.:integrations python bench/bench_muon.py --ranks 2 --stages 3 --steps 10
    PYTHONPATH=.:integrations python bench/bench_muon.py --tiny                        # smoke run (a test)

``--tiny`` trains bench_gpu.py's 2-layer tiny Llama on 2 ranks for a few steps: a smoke run of
every row and of the loss check, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_BENCH = Path(__file__).resolve().parent
for _p in (str(_BENCH), str(_BENCH.parent), str(_BENCH.parent / "integrations")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bench_gpu as bg  # noqa: E402
import torch  # noqa: E402

SIZE = bg.Size(hidden=256, layers=4, heads=4, intermediate=704, vocab=2048, batch=2, seq=64)
LR_MUON, LR_ADAMW = 0.02, 1e-3
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
MIB = 2**20


def _ns_fp32(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch's quintic Newton-Schulz (``torch.optim._muon``) in the gradient's dtype (fp32), not bf16."""
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.T if tall else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class _NSClock:
    """Wraps torch's Newton-Schulz function: wall and thread CPU seconds inside it, and calls.
    ``fp32``: the iteration runs in fp32 (:func:`_ns_fp32`) instead of torch's bf16."""

    def __init__(self, device: torch.device, fp32: bool) -> None:
        import torch.optim._muon as muon

        self.device, self.wall, self.cpu, self.calls = device, 0.0, 0.0, 0
        self._fn = _ns_fp32 if fp32 else muon._zeropower_via_newtonschulz

        def timed(grad: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            bg.sync(self.device)
            t0, c0 = time.perf_counter(), time.thread_time()
            out = self._fn(grad, *args, **kwargs)
            bg.sync(self.device)
            self.wall += time.perf_counter() - t0
            self.cpu += time.thread_time() - c0
            self.calls += 1
            return out

        muon._zeropower_via_newtonschulz = timed  # looked up at each call by _single_tensor_muon

    def reset(self) -> None:
        self.wall, self.cpu, self.calls = 0.0, 0.0, 0


def _device_and_group(rank: int) -> tuple[torch.device, Any]:
    """CPU and the launcher's gloo group; on CUDA one device per rank and an NCCL group."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), None
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    return device, dist.new_group(backend="nccl")


def _barrier(group: Any, device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _optimizers(model: torch.nn.Module, optim: str, scale: float) -> list[torch.optim.Optimizer]:
    """``[Muon(the decoder layers' 2-D weights), AdamW(the rest)]`` or ``[AdamW(everything)]``."""
    if optim == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=LR_ADAMW * scale)]
    matrices = [p for p in model.model.layers.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=LR_MUON * scale), torch.optim.AdamW(rest, lr=LR_ADAMW * scale)]


def _host_now() -> int:
    from zero_strategy.storage.host_memory import _malloc_trim, rss_anon

    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return rss_anon() or 0


def _mem_steps(step: Any, n: int, device: torch.device, base: int) -> int:
    """Peak bytes over ``n`` steps: device ``max_memory_allocated``, or host RssAnon above ``base``
    sampled after the forward, the backward and the step."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        for i in range(n):
            step(i, None)
        bg.sync(device)
        return torch.cuda.max_memory_allocated(device)
    peak = [0]

    def mark() -> None:
        peak[0] = max(peak[0], _host_now() - base)

    for i in range(n):
        step(i, mark)
    return peak[0]


def _run_row(rank: int, row: str, spec: dict, state: dict, data: list, device: torch.device, group: Any,
             ns: _NSClock) -> dict[str, Any]:  # fmt: skip
    import zero_strategy as zs
    from zero_strategy.bench.worker import _storage_bytes
    from zero_strategy.runtime.whole_params import matrix_cost

    kind, optim = row.split("_")
    stage = STAGES[kind]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = _host_now()
    model = bg.new_model(spec["size"], state, device)
    opts = _optimizers(model, optim, 1000.0 if spec.get("perturb") == row else 1.0)
    if stage == 0:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, process_group=group, device_ids=ids)
    else:
        model, got = zs.initialize(model, opts, stage=stage, process_group=group)
        opts = list(got) if isinstance(got, (list, tuple)) else [got]

    def step(i: int, mark: Any = None) -> torch.Tensor:
        loss = model(input_ids=data[i], labels=data[i]).loss
        if mark:
            mark()
        loss.backward()
        if mark:
            mark()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        if mark:
            mark()
        return loss.detach()

    warmup, steps = spec["warmup"], spec["steps"]
    losses, times = [], []
    for i in range(warmup + steps):
        _barrier(group, device)
        if i == warmup:
            zs.reset_comm_stats()
            ns.reset()
        t0 = time.perf_counter()
        losses.append(step(i))
        bg.sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    comm = {k: v["bytes"] / steps for k, v in zs.comm_stats().items()} if stage else {}
    a2a_elements = zs.comm_stats().get("all_to_all", {}).get("elements", 0) / steps if stage else 0
    ns_wall, ns_cpu, ns_calls = ns.wall / steps, ns.cpu / steps, ns.calls / steps
    state_bytes = [_storage_bytes(v for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)
                                  and v.dim() > 0) for o in opts]  # fmt: skip
    engine = getattr(model, "zero_engine", None)
    whole = engine.whole.entries if engine is not None and engine.whole is not None else []
    loads = [0] * engine.whole.ctx.world_size if whole else []
    for e in whole:
        loads[e.owner] += matrix_cost(e.param.shape)
    matrices_numel = sum(e.param.numel() for e in whole)
    peak = _mem_steps(lambda i, mark: step(warmup + steps + i, mark), spec["mem_steps"], device, base)
    if engine is not None:
        zs.destroy(model)
    return {
        "losses": [float(v) for v in losses],
        "s_step": statistics.median(times),
        "ns_wall": ns_wall,
        "ns_cpu": ns_cpu,
        "ns_calls": ns_calls,
        "muon_state": state_bytes[0] if optim == "muon" else 0,
        "adamw_state": state_bytes[-1],
        "peak": peak,
        "comm": comm,
        "a2a_elements": a2a_elements,
        "loads": loads,
        "matrices_numel": matrices_numel,
        "matrices": len(whole),
    }


def _worker(rank: int, world: int, spec: dict) -> dict[str, Any]:
    torch.set_num_threads(1)
    device, group = _device_and_group(rank)
    size = spec["size"] = bg.Size(**spec["size"])  # a dict across the launcher (no bench_gpu in its unpickling)
    state = bg.initial_state(size, device)
    n = spec["warmup"] + spec["steps"] + spec["mem_steps"]
    gens = [torch.Generator().manual_seed(1234 + 1000 * rank + i) for i in range(n)]
    data = [torch.randint(0, size.vocab, (size.batch, size.seq), generator=g).to(device) for g in gens]
    ns = _NSClock(device, spec["ns_dtype"] == "fp32")
    return {row: _run_row(rank, row, spec, state, data, device, group, ns) for row in spec["rows"]}


def _fmt_ratio(x: float, ref: float | None) -> str:
    return "-" if not ref or x != x else f"{x / ref:.2f}"


def _rel(losses: list[list[float]], ref: list[list[float]]) -> float:
    """The largest relative difference over ranks and steps (NaN-strict: inf)."""
    return max(bg.loss_check(a, b, float("inf")) for a, b in zip(losses, ref, strict=True))


def report(world: int, res: list[dict[str, dict]], rows: list[str], rtol: float) -> bool:
    """The table of one world size; False when a row's losses differ from DDP's."""
    ok = True
    mib = "GPU MiB" if torch.cuda.is_available() else "RssAnon MiB"
    print(f"\n## {world} rank{'s' if world > 1 else ''}\n")
    print(f"| row | loss vs DDP (max rel) | s/step | x DDP | NS ms/step wall (CPU) | NS x DDP | "
          f"Muon state MiB/rank | x DDP | AdamW state MiB/rank | x DDP | peak {mib} | x DDP | "
          f"MiB moved/step | x AdamW row | all_to_all MiB/step |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        per_rank = [r[row] for r in res]
        kind, optim = row.split("_")
        ref_row = f"ddp_{optim}"
        ref = [r[ref_row] for r in res] if ref_row in res[0] else None
        worst = _rel([p["losses"] for p in per_rank], [p["losses"] for p in ref]) if ref else float("nan")
        if ref and kind != "ddp" and not worst <= rtol:
            ok = False
            print(f"| {row} | LOSSES DIFFER from {ref_row} (max rel {worst:.2e} > {rtol:g}): rank 0 "
                  f"{[f'{v:.6f}' for v in per_rank[0]['losses']]} vs {[f'{v:.6f}' for v in ref[0]['losses']]} |")  # fmt: skip
            continue

        def top(key: str, rs: list[dict] | None = per_rank) -> float:
            return max(p[key] for p in rs) if rs else float("nan")

        s_step = per_rank[0]["s_step"]
        check = "reference" if kind == "ddp" else (f"{worst:.1e}" if ref else "no DDP row")
        moved = sum(per_rank[0]["comm"].values())
        adamw_row = f"{kind}_adamw"
        adamw_moved = sum(res[0][adamw_row]["comm"].values()) if adamw_row in res[0] else None
        a2a = per_rank[0]["comm"].get("all_to_all", 0.0)
        ns = f"{1000 * top('ns_wall'):.1f} ({1000 * top('ns_cpu'):.1f})" if optim == "muon" else "-"
        print(f"| {row} | {check} | {s_step:.3f} | {_fmt_ratio(s_step, ref[0]['s_step'] if ref else None)} | {ns} | "
              f"{_fmt_ratio(top('ns_wall'), top('ns_wall', ref)) if optim == 'muon' else '-'} | "
              f"{top('muon_state') / MIB:.2f} | {_fmt_ratio(top('muon_state'), top('muon_state', ref)) if optim == 'muon' else '-'} | "
              f"{top('adamw_state') / MIB:.2f} | {_fmt_ratio(top('adamw_state'), top('adamw_state', ref))} | "
              f"{top('peak') / MIB:.1f} | {_fmt_ratio(top('peak'), top('peak', ref))} | "
              f"{f'{moved / MIB:.2f}' if kind != 'ddp' else '-'} | "
              f"{_fmt_ratio(moved, adamw_moved) if kind != 'ddp' else '-'} | {a2a / MIB:.2f} |")  # fmt: skip
    for row in rows:
        p0 = res[0][row]
        if not p0["matrices"]:
            continue
        total = sum(p0["loads"])
        shares = " / ".join(f"{100 * x / total:.1f}%" for x in p0["loads"])
        a2a = sum(r[row]["a2a_elements"] for r in res)
        print(f"\n{row}: {p0['matrices']} matrices ({p0['matrices_numel']:,} elements) stepped whole; Newton-Schulz "
              f"cost per rank {shares} (max/mean {max(p0['loads']) * len(p0['loads']) / total:.3f}); "
              f"all_to_all elements per step over all ranks {a2a:,.0f} = {a2a / p0['matrices_numel']:.2f} x numel "
              f"(formula: 3 x, the ranks' own pieces included)")  # fmt: skip
    return ok


def balance_table(worlds: tuple[int, ...] = (2, 4, 8)) -> None:
    """The owners' balance of the Newton-Schulz cost for bench_gpu.py's Llama shapes."""
    from zero_strategy.runtime.whole_params import assign_owners, matrix_cost

    print("\n## Owners' balance of the Newton-Schulz cost m*n*min(m,n) (assign_owners, from the shapes)\n")
    print("| model | matrices | " + " | ".join(f"{w} ranks: max/mean" for w in worlds) + " |")
    print("|---|---:|" + "---:|" * len(worlds))
    for name, s in (("bench", SIZE), *((k, bg.SIZES[k]) for k in ("small", "0.17b", "0.94b"))):
        shapes = [(s.hidden, s.hidden)] * 4 + [(s.intermediate, s.hidden)] * 2 + [(s.hidden, s.intermediate)]
        costs = [matrix_cost(sh) for sh in shapes * s.layers]
        cells = []
        for w in worlds:
            loads = [0] * w
            assign_owners(costs, w, loads)
            cells.append(f"{max(loads) * w / sum(loads):.3f}")
        print(f"| {name} (hidden {s.hidden}, {s.layers} layers) | {len(costs)} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    from zero_strategy.testing import launch

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--ranks", default="1,2,4", help="comma list of world sizes")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages beside DDP")
    p.add_argument("--optims", default="adamw,muon")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mem-steps", type=int, default=2, help="further steps whose peak memory is sampled")
    p.add_argument("--rtol", type=float, default=1e-5, help="loss check, relative to DDP's loss at each step")
    p.add_argument("--ns-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Muon's Newton-Schulz in fp32 (the loss check's setting) or torch's own bf16")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="bench_gpu.py's tiny Llama on 2 ranks: a smoke run")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--perturb", default=None, help=argparse.SUPPRESS)  # tests: one row at 1000x its learning rate
    args = p.parse_args(argv)
    if args.tiny:
        args.ranks = "2" if args.ranks == "1,2,4" else args.ranks
        args.steps = min(args.steps, 3)
    size = bg.SIZES["tiny"] if args.tiny else SIZE
    rows = [
        f"{k}_{o}" for k in ("ddp", *(f"zero{s}" for s in args.stages.split(",") if s)) for o in args.optims.split(",")
    ]
    spec = {"size": dataclasses.asdict(size), "rows": rows, "warmup": args.warmup, "steps": args.steps, "mem_steps": args.mem_steps,
            "perturb": args.perturb, "ns_dtype": args.ns_dtype}  # fmt: skip
    cuda = torch.cuda.is_available()
    what = torch.cuda.get_device_name(0) if cuda else "cpu, gloo, 1 thread per rank"
    print(f"device: {what}; torch {torch.__version__}; Llama hidden {size.hidden}, {size.layers} layers, intermediate "
          f"{size.intermediate}, vocab {size.vocab}, {size.batch}x{size.seq} tokens per rank; {args.warmup} warm-up + "
          f"{args.steps} timed steps (+{args.mem_steps} memory steps), fp32 (Newton-Schulz in {args.ns_dtype}), loss check rtol {args.rtol:g}")  # fmt: skip
    ok, raw = True, {}
    for world in (int(w) for w in args.ranks.split(",") if w):
        if cuda and world > torch.cuda.device_count():
            print(f"\n## {world} ranks: skipped ({torch.cuda.device_count()} CUDA device(s), one per rank)")
            continue
        t0 = time.perf_counter()
        res = launch(_worker, world, args=(spec,), timeout=args.timeout, pg_timeout=300.0)
        raw[world] = res
        ok = report(world, res, rows, args.rtol) and ok
        print(f"\n({world} rank(s): {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    balance_table()
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in raw.items()}, indent=1))
    if not ok:
        print("\nFAILED: a row's losses differ from DDP's with the same optimizers (see above)")
        return 1
    print("\nevery ZeRO row's losses equal DDP's (same optimizers) within the tolerance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
