"""One GPU, one process: a transformers Llama under the plain model, FSDP2 and zero-strategy.

Issue 45 measured ZeRO-3 at 1.22x FSDP2 on one H200 (0.94B Llama, bf16 mixed precision, AdamW,
world size 1). This script is that measurement as one command, so that each change to the
per-unit cost can be measured the same way. Every row trains the same ``LlamaForCausalLM``
(built from its config, no download) from the same initial weights (one saved ``state_dict``
copied into each) on the same token batches, with fp32 parameters and the same bf16 autocast
around the forward and the loss, and ``torch.optim.AdamW`` (torch's default implementation:
foreach on CUDA):

- ``plain``: the model on the device, no wrapper; the baseline of ``x plain`` and the oracle of
  the loss check;
- ``fsdp2``: ``fully_shard`` on each decoder layer, then on the root, over a world-size-1 mesh;
- ``zero1``, ``zero2``, ``zero3``: ``zero_strategy.initialize(..., precision="bf16-mixed")``
  (the engine applies the same autocast), default config otherwise;
- ``zero2_offload``: ZeRO-2 with the optimizer on the host; ``zero3_offload``: ZeRO-3 with
  the parameters and the optimizer on the host (pinned).

All rows run in one process, one after the other (``gc.collect()`` and
``torch.cuda.empty_cache()`` between them). A row reports the median s/step over its timed
steps (the device synchronised at the end of each step), the ratios to ``plain`` and ``fsdp2``,
the peak device memory, the host synchronisations per step (``torch.cuda.set_sync_debug_mode
("warn")`` over a few further steps, its warnings counted; on CPU ``HostSyncCounter``, which
counts the engine's own calls only), the model FLOP utilisation (``6 * N * tokens / step time /
--peak-flops``, N every parameter, embeddings included) and whether every step's loss equals the
plain model's within ``--rtol`` (relative). A row whose losses differ is not printed as a
result: its losses are printed instead and the script exits 1 at the end (so does a row that
raised).

    PYTHONPATH=.:integrations python bench/bench_gpu.py                   # one GPU, both sizes
    PYTHONPATH=.:integrations python bench/bench_gpu.py --sizes 0.94b --rows plain,fsdp2,zero3
    PYTHONPATH=.:integrations python bench/bench_gpu.py --tiny            # CPU smoke run, gloo

``--tiny`` runs a 2-layer Llama on CPU (gloo, world size 1) in a few seconds: a smoke run of
every row and of the loss check, not a measurement (bf16 autocast on CPU too; CPU kernels are
deterministic, so the losses come out equal or within float rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
for _p in (_REPO_ROOT, os.path.join(_REPO_ROOT, "integrations")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROWS = ("plain", "fsdp2", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
LR = 1e-4
HOST = {"device": "cpu", "pin_memory": True}
OFFLOAD = {
    "zero2_offload": {"offload_optimizer": HOST},
    "zero3_offload": {"offload_optimizer": HOST, "offload_param": HOST},
}


@dataclasses.dataclass(frozen=True)
class Size:
    """A Llama config and its batch."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=self.seq,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )


SIZES = {
    "tiny": Size(hidden=64, layers=2, heads=4, intermediate=128, vocab=256, batch=2, seq=16),
    # "narrow": small's shape (4 layers, norms under ZeRO-3's persistence threshold, linears over it
    # with bench_dispatch.py's threshold) at a width where compute is negligible: host overhead
    "narrow": Size(hidden=64, layers=4, heads=4, intermediate=176, vocab=512, batch=2, seq=32),
    "small": Size(hidden=512, layers=4, heads=8, intermediate=1408, vocab=8192, batch=2, seq=128),
    "0.17b": Size(hidden=1024, layers=8, heads=16, intermediate=2816, vocab=32000, batch=8, seq=512),
    "0.94b": Size(hidden=2048, layers=16, heads=16, intermediate=5504, vocab=32000, batch=8, seq=1024),
}


def init_process_group(device: torch.device) -> None:
    """World size 1 over a file store: gloo on CPU, NCCL (and gloo for host tensors) on a GPU."""
    if dist.is_initialized():
        return
    store = Path(tempfile.mkdtemp(prefix="bench_gpu_")) / "store"
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **kwargs)


def initial_state(size: Size, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights every row starts from (built on the device, kept on the host)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(size.config())
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    return state


def new_model(size: Size, state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(size.config())
    model.load_state_dict(state)
    return model.train()


@dataclasses.dataclass
class Row:
    name: str
    model: torch.nn.Module
    opt: Any
    outer_autocast: bool  # the bench applies autocast (plain, fsdp2); the engine applies its own
    zero: bool


def build_row(
    name: str,
    size: Size,
    state: dict[str, torch.Tensor],
    device: torch.device,
    *,
    amp: bool,
    foreach: bool | None = None,
    zero_extra: dict | None = None,
    zero_keys: dict | None = None,
) -> Row:
    """The model and optimizer of one row, from ``state``."""
    model = new_model(size, state, device)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=LR, foreach=foreach)

    if name == "plain":
        return Row(name, model, adamw(model.parameters()), outer_autocast=True, zero=False)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Row(name, model, adamw(model.parameters()), outer_autocast=True, zero=False)
    if name.startswith("zero") and name[4:5] in ("1", "2", "3"):
        import zero_strategy as zs

        zero = {"stage": int(name[4]), **OFFLOAD.get(name, {}), **(zero_keys or {})}
        config = {"zero_optimization": zero, **(zero_extra or {})}
        precision = "bf16-mixed" if amp else "fp32"
        model, opt = zs.initialize(model, adamw, config=config, precision=precision)
        return Row(name, model, opt, outer_autocast=False, zero=True)
    raise SystemExit(f"unknown row {name!r}: choose from {','.join(ROWS)}")


def close_row(row: Row) -> None:
    if row.zero:
        import zero_strategy as zs

        zs.destroy(row.model)


def step(row: Row, x: torch.Tensor, amp: bool) -> torch.Tensor:
    """Forward and loss (under autocast), backward, optimizer step, zero_grad; the loss, unread."""
    ctx = (
        torch.autocast(x.device.type, dtype=torch.bfloat16) if amp and row.outer_autocast else contextlib.nullcontext()
    )
    with ctx:
        loss = row.model(input_ids=x, labels=x).loss
    loss.backward()
    row.opt.step()
    row.opt.zero_grad(set_to_none=True)
    return loss.detach()


def batches(size: Size, n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, size.vocab, (size.batch, size.seq), generator=g).to(device) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def count_host_syncs(device: torch.device) -> Iterator[Callable[[], int]]:
    """Host synchronisations inside the block: on CUDA every one the sync debug mode warns
    about; on CPU the engine's own value reads (``HostSyncCounter``)."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield lambda: sum("synchroniz" in str(w.message) for w in seen)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    else:
        from zero_strategy.testing.syncs import HostSyncCounter

        with HostSyncCounter() as counter:
            yield lambda: counter.total


def run_row(args: argparse.Namespace, row: Row, data: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Warm-up and timed steps, then the counted ones; every loss kept (read at the end)."""
    cuda = device.type == "cuda"
    if cuda:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(step(row, data[i], args.amp))
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    n_sync = args.sync_steps
    with count_host_syncs(device) as counted:
        for i in range(n_sync):
            step(row, data[args.warmup + args.steps + i], args.amp)
        sync(device)
        syncs = counted() / max(n_sync, 1)
    return {"s_step": statistics.median(times), "peak_gib": peak, "syncs": syncs, "losses": [float(v) for v in losses]}


def loss_check(losses: list[float], ref: list[float], rtol: float) -> float:
    """The largest relative difference from the reference, NaN-strict (inf when not finite)."""
    worst = 0.0
    for a, b in zip(losses, ref, strict=True):
        if not (torch.isfinite(torch.tensor(a)) and torch.isfinite(torch.tensor(b))):
            return float("inf")
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def _fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # NaN: not measured here


def run_size(args: argparse.Namespace, size_name: str, device: torch.device) -> bool:
    """Every row of one size; prints its table. False when a row failed or its losses differed."""
    size = SIZES[size_name]
    state = initial_state(size, device)
    n_params = sum(v.numel() for v in state.values())
    data = batches(size, args.warmup + args.steps + args.sync_steps, device)
    tokens = size.batch * size.seq
    print(f"\n## {size_name}: {n_params / 1e9:.3f}B ({n_params:,}) parameters, {size.layers} layers, hidden {size.hidden}, "
          f"{size.batch}x{size.seq} tokens, {args.warmup} warm-up + {args.steps} timed steps, "
          f"bf16 autocast {'on' if args.amp else 'off'}, loss check rtol {args.rtol:g}\n")  # fmt: skip
    print("| row | s/step | x plain | x FSDP2 | peak GiB | host syncs/step | MFU | losses = plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    ok, results, rows = True, {}, [r for r in args.rows.split(",") if r]
    for name in rows:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = None
        try:
            row = build_row(name, size, state, device, amp=args.amp, foreach=args.foreach)
            if args.perturb == name:  # a smoke test of the loss check: this row's optimizer steps differently
                for group in row.opt.param_groups:
                    group["lr"] = LR * 1000
            results[name] = run_row(args, row, data, device)
        except Exception as exc:  # a row that raises is reported, and the run fails at the end
            traceback.print_exc()
            print(f"| {name} | error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} |")
            ok = False
            continue
        finally:
            if row is not None:
                close_row(row)
            del row
        r = results[name]
        ref = results.get("plain")
        worst = loss_check(r["losses"], ref["losses"], args.rtol) if ref is not None else float("nan")
        if ref is not None and not worst <= args.rtol:
            ok = False
            print(f"| {name} | LOSSES DIFFER from plain (max rel {worst:.2e} > {args.rtol:g}): "
                  f"{[f'{v:.6f}' for v in r['losses']]} vs plain {[f'{v:.6f}' for v in ref['losses']]} |")  # fmt: skip
            continue
        x_plain = r["s_step"] / ref["s_step"] if ref is not None else float("nan")
        x_fsdp = r["s_step"] / results["fsdp2"]["s_step"] if "fsdp2" in results else float("nan")
        mfu = 6 * n_params * tokens / r["s_step"] / args.peak_flops if device.type == "cuda" else float("nan")
        check = (
            "reference" if name == "plain" else (f"yes (max rel {worst:.1e})" if ref is not None else "no plain row")
        )
        print(f"| {name} | {r['s_step']:.4f} | {_fmt(x_plain, '.2f')} | {_fmt(x_fsdp, '.2f')} | "
              f"{_fmt(r['peak_gib'], '.2f')} | {r['syncs']:.1f} | {_fmt(100 * mfu, '.1f')}{'%' if mfu == mfu else ''} | "
              f"{check} |", flush=True)  # fmt: skip
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.17b,0.94b", help=f"comma list of {','.join(SIZES)}")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list; plain first (the loss reference)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sync-steps", type=int, default=2, help="steps after the timed ones whose host syncs are counted")
    p.add_argument(
        "--rtol",
        type=float,
        default=5e-3,
        help="loss check (a bit over one bf16 ulp, 2^-8): relative to plain's loss at each step",
    )
    p.add_argument("--peak-flops", type=float, default=989e12, help="the device's dense bf16 peak (H200: 989e12)")
    p.add_argument("--fp32", dest="amp", action="store_false", help="no autocast (every row in fp32)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None, help="AdamW(foreach=...)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama on CPU (gloo): a smoke run")
    p.add_argument("--perturb", default=None, help=argparse.SUPPRESS)  # tests: make one row's losses differ
    args = p.parse_args()
    if args.tiny:
        args.sizes = "tiny"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        raise SystemExit("bench_gpu.py: no CUDA device; run with --tiny for the CPU smoke run")
    for name in args.sizes.split(","):
        if name not in SIZES:
            raise SystemExit(f"--sizes: unknown size {name!r}; choose from {','.join(SIZES)}")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls (outside autocast) as the plain model's
    init_process_group(device)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run, gloo)"
    print(f"device: {what}; torch {torch.__version__}; world size 1")
    ok = True
    try:
        for name in args.sizes.split(","):
            ok = run_size(args, name, device) and ok
    finally:
        dist.destroy_process_group()
    if not ok:
        print("\nFAILED: a row raised or its losses differ from the plain model's (see above)")
        sys.exit(1)
    print("\nall rows printed; every row's losses equal the plain model's within the tolerance")


if __name__ == "__main__":
    main()
