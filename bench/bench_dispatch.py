"""A CPU proxy for the GPU step cost: ATen ops dispatched per step, who issues them, hook time.

On a GPU at world size 1 a step costs its kernels plus the host work that launches them; with
small kernels the launches and the Python around them dominate (issue 45: ZeRO-3 at 1.22x
FSDP2 on one H200). Without a GPU the kernels cannot be timed, but they can be counted: almost
every ATen op dispatched on a CUDA tensor launches one kernel (a foreach op launches a few). This
script trains the same small transformers Llama (``bench_gpu.py``'s rows, CPU, gloo, world size
1, fp32, ``AdamW(foreach=True)`` as on CUDA) under the plain model, FSDP2 and zero-strategy at
stages 1-3, and measures per steady step:

1. **ops**: every ATen op the step dispatches (a ``TorchDispatchMode`` counts each call; views
   included, as their metadata work is host time too), by op name, and by who issued it: the
   *engine* (the innermost frame outside torch is in ``zero_strategy/``, or in FSDP2's
   ``torch/distributed/fsdp/``), the *optimizer* (``torch/optim/``) or the *model* (anything else:
   the model's forward, autograd's backward kernels, the loss), and for the engine whether the
   op ran inside one of its hooks. Each engine op is attributed to the innermost engine frame
   (``file:line function``) and the hook it ran in: the map of where per-unit cost comes from.
2. **hook time**: host seconds inside the engine's hooks (module forward hooks, tensor gradient
   hooks, post-accumulate-grad hooks, optimizer step hooks, end-of-backward callbacks and
   FSDP2's autograd functions), each wrapped at registration with ``time.perf_counter``, in
   steps run without the dispatch mode.
3. **hooks registered**: module hooks on the model after set-up, post-accumulate-grad hooks on
   parameters, and tensor hooks registered per step.

ZeRO-3 runs with ``gather_checks: deferred`` and every row with ``collective_impl: native``,
what they are on a GPU (on CPU ``auto`` picks the immediate checks and the point-to-point
exchange). The ratios ours/FSDP2 are what to read; CPU seconds are not GPU seconds.

    PYTHONPATH=.:integrations OMP_NUM_THREADS=1 python bench/bench_dispatch.py          # 4-layer Llama
    PYTHONPATH=.:integrations OMP_NUM_THREADS=1 python bench/bench_dispatch.py --tiny   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROWS = ("plain", "fsdp2", "zero1", "zero2", "zero3")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_ZS = os.path.join(bg._REPO_ROOT, "zero_strategy") + os.sep
_OPTIM = os.path.join(_TORCH, "optim") + os.sep
_FSDP = os.path.join(_TORCH, "distributed", "fsdp") + os.sep
_HERE = os.path.abspath(__file__)
# ops that launch no kernel on a GPU: views (``OpOverload.is_view``), allocations, profiler
# ranges, constants lifted from Python scalars; a value read (``_local_scalar_dense``) is a sync
_NO_KERNEL = frozenset({"empty", "empty_strided", "_unsafe_view", "_record_function_enter_new", "_record_function_exit",
                        "lift_fresh", "_local_scalar_dense", "set_", "resize_"})  # fmt: skip


def launches_kernel(func: Any) -> bool:
    return not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL


def _is_engine(path: str) -> bool:
    return (path.startswith(_ZS) and not path.startswith(_ZS + "testing" + os.sep)) or path.startswith(_FSDP)


def who(frame: FrameType | None) -> tuple[str, FrameType | None]:
    """``engine``, ``optimizer`` or ``model`` for the code that called into torch at ``frame``,
    with the deciding frame: the innermost one that is the engine's, the optimizer's, or
    outside torch."""
    while frame is not None:
        path = frame.f_code.co_filename
        if _is_engine(path):
            return "engine", frame
        if path.startswith(_OPTIM):
            return "optimizer", frame
        if not path.startswith(_TORCH) and path != _HERE:
            return "model", frame
        frame = frame.f_back
    return "model", None


def _via(frame: FrameType) -> str:
    """The next engine frame outwards from ``frame`` (its caller in the engine), or ``-``."""
    f = frame.f_back
    while f is not None and (not _is_engine(f.f_code.co_filename) or f.f_code.co_name.startswith("<")):
        f = f.f_back
    return _site(f) if f is not None else "-"


def _site(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    base = _ZS if path.startswith(_ZS) else _TORCH
    prefix = "zero_strategy/" if base == _ZS else "torch/"
    return f"{prefix}{os.path.relpath(path, base)}:{frame.f_lineno} {frame.f_code.co_name}"


@dataclasses.dataclass
class HookState:
    """The hook wrappers' shared state: nesting depth, the hook running, time and calls."""

    depth: int = 0
    current: str = ""
    seconds: float = 0.0
    calls: int = 0
    registered: Counter[str] = dataclasses.field(default_factory=Counter)
    by_hook: Counter[str] = dataclasses.field(default_factory=Counter)  # seconds per hook
    calls_by_hook: Counter[str] = dataclasses.field(default_factory=Counter)


def _hook_name(fn: Any) -> str:
    """A readable name for a hook: the function under ``functools.partial`` and
    ``torch.compiler.disable`` wrappers (ours: the engine method ``_call_weakly`` calls)."""
    for _ in range(4):
        if isinstance(fn, functools.partial):
            if getattr(fn.func, "__name__", "") == "_call_weakly" and fn.args:
                return f"ZeroEngine.{fn.args[-1]}"
            fn = fn.func
        else:
            fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__qualname__", type(fn).__name__)


def timed(state: HookState, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """``fn`` with its outermost calls timed into ``state`` (and marked as hook time)."""
    label = name or _hook_name(fn)

    def hook(*args: Any, **kwargs: Any) -> Any:
        if state.depth:
            return fn(*args, **kwargs)
        state.depth, state.current = 1, label
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            state.seconds += dt
            state.calls += 1
            state.by_hook[label] += dt
            state.calls_by_hook[label] += 1
            state.depth, state.current = 0, ""

    return hook


class _Engine:
    """Stands in for autograd's execution engine: its end-of-backward callbacks get timed."""

    def __init__(self, real: Any, state: HookState) -> None:
        self._real, self._state = real, state

    def queue_callback(self, cb: Callable[[], Any]) -> Any:
        if who(sys._getframe(1))[0] == "engine":
            cb = timed(self._state, cb)
        return self._real.queue_callback(cb)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextmanager
def hooks_timed(state: HookState) -> Iterator[None]:
    """While active, every hook the engine (ours or FSDP2) registers is wrapped by :func:`timed`."""
    from torch.autograd.variable import Variable

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        old = owner.__dict__[attr]
        patched.append((owner, attr, old))
        setattr(owner, attr, make(old))

    def registering(kind: str, hook_arg: int) -> Callable[[Any], Any]:
        def make(register: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if who(sys._getframe(1))[0] == "engine":
                    state.registered[kind] += 1
                    args = (*args[:hook_arg], timed(state, args[hook_arg]), *args[hook_arg + 1 :])
                return register(*args, **kwargs)

            return wrapper

        return make

    for attr in ("register_forward_pre_hook", "register_forward_hook"):
        patch(nn.Module, attr, registering(f"module {attr[9:]}", 1))
    patch(torch.Tensor, "register_hook", registering("tensor grad hook", 1))
    patch(torch.Tensor, "register_post_accumulate_grad_hook", registering("post-accumulate-grad hook", 1))
    for attr in ("register_step_pre_hook", "register_step_post_hook"):
        patch(torch.optim.Optimizer, attr, registering(f"optimizer {attr[9:]}", 1))
    patch(Variable, "_execution_engine", lambda real: _Engine(real, state))
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    for fn_cls in (_fsdp_param_group.RegisterPostBackwardFunction, _fsdp_state.RegisterPreBackwardFunction):
        patch(fn_cls, "backward", lambda old, c=fn_cls: staticmethod(timed(state, old.__func__, c.__name__)))
    try:
        yield
    finally:
        for owner, attr, old in reversed(patched):
            setattr(owner, attr, old)


class OpCounter(TorchDispatchMode):
    """Counts every dispatched ATen op by name, by issuer, and engine ops by site and hook."""

    def __init__(self, hooks: HookState) -> None:
        super().__init__()
        self.hooks = hooks
        self.ops: Counter[str] = Counter()
        self.by_who: Counter[str] = Counter()
        self.kernels_by_who: Counter[str] = Counter()
        self.site_kernels: Counter[str] = Counter()
        self.hook_kernels: Counter[str] = Counter()
        self.engine_ops: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str, str]] = Counter()  # (hook or "-", site, op)
        self.via: dict[str, Counter[str]] = {}  # site: its engine callers

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        kind, frame = who(sys._getframe(1))
        kernel = launches_kernel(func)
        if kind == "engine" and frame is not None:
            kind = "engine in hooks" if self.hooks.depth else "engine outside hooks"
            self.engine_ops[name] += 1
            site = _site(frame)
            self.sites[(self.hooks.current or "-", site, name)] += 1
            self.site_kernels[site] += kernel
            self.hook_kernels[self.hooks.current or "-"] += kernel
            self.via.setdefault(site, Counter())[_via(frame)] += 1
        self.by_who[kind] += 1
        self.kernels_by_who[kind] += kernel
        return func(*args, **(kwargs or {}))


def module_hooks(model: nn.Module) -> tuple[int, int]:
    """Module hooks on the model, and post-accumulate-grad hooks on its parameters."""
    mods = sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return mods, params


def measure(args: argparse.Namespace, name: str, size: bg.Size, state: dict, data: list) -> dict[str, Any]:
    cpu = torch.device("cpu")
    hooks = HookState()
    extra = {"zero_strategy": {"collective_impl": "native", "gather_checks": "deferred"}}
    # narrow: only the norms persistent at ZeRO-3 (as at hidden 512 with the default 100,000, and at 0.94B)
    keys = {"stage3_param_persistence_threshold": size.hidden + 1} if args.size == "narrow" else None
    with hooks_timed(hooks):
        row = bg.build_row(name, size, state, cpu, amp=False, foreach=True, zero_extra=extra, zero_keys=keys)
        try:
            registered_at_setup = sum(hooks.registered.values())
            mods, params = module_hooks(row.model)
            it = iter(data)
            for _ in range(args.warmup):
                bg.step(row, next(it), amp=False)
            hooks.registered.clear()
            counter = OpCounter(hooks)
            with counter:
                for _ in range(args.steps):
                    bg.step(row, next(it), amp=False)
            per_step_registered = sum(hooks.registered.values()) / args.steps
            hooks.seconds, hooks.calls = 0.0, 0
            hooks.by_hook.clear()
            hooks.calls_by_hook.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                bg.step(row, next(it), amp=False)
            step_s = (time.perf_counter() - t0) / args.steps
        finally:
            bg.close_row(row)
    n = args.steps
    return {
        "ops": sum(counter.ops.values()) / n,
        "by_op": Counter({k: v / n for k, v in counter.ops.items()}),
        "by_who": Counter({k: v / n for k, v in counter.by_who.items()}),
        "kernels_by_who": Counter({k: v / n for k, v in counter.kernels_by_who.items()}),
        "site_kernels": Counter({k: v / n for k, v in counter.site_kernels.items()}),
        "hook_kernels": Counter({k: v / n for k, v in counter.hook_kernels.items()}),
        "engine_ops": Counter({k: v / n for k, v in counter.engine_ops.items()}),
        "sites": Counter({k: v / n for k, v in counter.sites.items()}),
        "via": counter.via,
        "hook_s": hooks.seconds / n,
        "hook_calls": hooks.calls / n,
        "hook_ms_by": {h: (1e3 * t / n, hooks.calls_by_hook[h] / n) for h, t in hooks.by_hook.most_common()},
        "step_s": step_s,
        "module_hooks": mods,
        "param_hooks": params,
        "registered_setup": registered_at_setup,
        "registered_step": per_step_registered,
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


WHO = ("model", "optimizer", "engine in hooks", "engine outside hooks")


def _engine(counts: Counter[str]) -> float:
    return counts["engine in hooks"] + counts["engine outside hooks"]


def report(results: dict[str, dict[str, Any]], top: int) -> None:
    fs = results.get("fsdp2")
    print("\nATen ops dispatched per step, by issuer; kernels: those that launch one on a GPU (views, "
          "allocations, profiler ranges and lifted constants excluded)\n")  # fmt: skip
    print("| row | ops | kernels | kernels x FSDP2 | model ops (kernels) | optimizer | engine in hooks "
          "| engine outside hooks | hook ms/step | hook calls/step | module hooks | param hooks "
          "| tensor hooks/step | step s (CPU) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        w, k = r["by_who"], r["kernels_by_who"]
        kernels = sum(k.values())
        x = _ratio(kernels, sum(fs["kernels_by_who"].values())) if fs else "-"
        cells = " | ".join(f"{w[c]:.0f} ({k[c]:.0f})" for c in WHO)
        print(f"| {name} | {r['ops']:.0f} | {kernels:.0f} | {x} | {cells} | {1e3 * r['hook_s']:.1f} | "
              f"{r['hook_calls']:.0f} | {r['module_hooks']} | {r['param_hooks']} | {r['registered_step']:.0f} | "
              f"{r['step_s']:.3f} |")  # fmt: skip
    if fs:
        print("\nours / FSDP2:")
        for name, r in results.items():
            if name.startswith("zero"):
                print(f"- {name}: ops {_ratio(r['ops'], fs['ops'])}, "
                      f"kernels {_ratio(sum(r['kernels_by_who'].values()), sum(fs['kernels_by_who'].values()))}, "
                      f"engine ops {_ratio(_engine(r['by_who']), _engine(fs['by_who']))}, "
                      f"engine kernels {_ratio(_engine(r['kernels_by_who']), _engine(fs['kernels_by_who']))}, "
                      f"hook time {_ratio(r['hook_s'], fs['hook_s'])}, "
                      f"module hooks {_ratio(r['module_hooks'], fs['module_hooks'])}")  # fmt: skip
    for name, r in results.items():
        print(f"\n### {name}: top {top} ops per step (all issuers; engine's own in brackets)\n")
        print(", ".join(f"{op} {c:.0f} [{r['engine_ops'][op]:.0f}]" for op, c in r["by_op"].most_common(top)))
        if r["hook_ms_by"]:
            each = ", ".join(f"{h} {ms:.2f} ms/{c:.0f} calls" for h, (ms, c) in r["hook_ms_by"].items())
            print(f"\n{name}: hook host time per step: {each}")
        if r["sites"]:
            _report_sites(name, r, top)


def _report_sites(name: str, r: dict[str, Any], top: int) -> None:
    """The engine's ops per step by hook, and by site (file:line, with the op mix, its kernels
    and the engine frame that called it)."""
    by_hook: Counter[str] = Counter()
    by_site: dict[str, Counter[str]] = {}
    for (hook, site, op), c in r["sites"].items():
        by_hook[hook] += c
        by_site.setdefault(site, Counter())[op] += c
    hooks = ", ".join(f"{h} {c:.0f} ({r['hook_kernels'][h]:.0f})" for h, c in by_hook.most_common())
    print(f"\n{name}: engine ops (kernels) per step by hook: {hooks}")
    print(f"\n{name}: top {top} engine sites (ops per step (kernels), file:line function, op mix; called from)\n")
    ranked = sorted(by_site.items(), key=lambda kv: -sum(kv[1].values()))
    for site, ops in ranked[:top]:
        mix = ", ".join(f"{op} {c:.0f}" for op, c in ops.most_common())
        via = r["via"][site].most_common(1)[0][0]
        print(f"- {sum(ops.values()):.0f} ({r['site_kernels'][site]:.0f}) at {site} ({mix}; from {via})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help=f"one of {','.join(bg.SIZES)} (small: 4 layers, hidden 512; "
                   "narrow: the same at hidden 64, for the hooks' host overhead)")  # fmt: skip
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps counted, and as many timed")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--tiny", action="store_true", help="the 2-layer tiny Llama, 1 warm-up step: a smoke run")
    args = p.parse_args()
    if args.tiny:
        args.size, args.warmup, args.steps = "tiny", 1, 1
    if args.size not in bg.SIZES:
        raise SystemExit(f"--size: unknown size {args.size!r}; choose from {','.join(bg.SIZES)}")
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    bg.init_process_group(cpu)
    size = bg.SIZES[args.size]
    state = bg.initial_state(size, cpu)
    data = bg.batches(size, args.warmup + 2 * args.steps, cpu)
    print(f"torch {torch.__version__}, CPU, gloo, world size 1, {args.size} Llama ({size.layers} layers, hidden "
          f"{size.hidden}, {sum(v.numel() for v in state.values()):,} parameters, {size.batch}x{size.seq} tokens), "
          f"fp32, AdamW(foreach=True); {args.warmup} warm-up steps, {args.steps} counted, {args.steps} timed")  # fmt: skip
    results, failed = {}, []
    try:
        for name in [r for r in args.rows.split(",") if r]:
            try:
                results[name] = measure(args, name, size, state, data)
            except Exception as exc:  # reported; the run fails at the end
                import traceback

                traceback.print_exc()
                print(f"| {name} | error: {type(exc).__name__}: {exc} |")
                failed.append(name)
    finally:
        torch.distributed.destroy_process_group()
    report(results, args.top)
    if failed:
        print(f"\nFAILED rows: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
