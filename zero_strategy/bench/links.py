"""``zero-strategy bench --links``: bytes per step on each link class, and step time, of the
hybrid layouts against flat ZeRO-3 and FSDP2's HSDP, on ranks emulating ``nodes x per_node``.

One launch of :func:`zero_strategy.bench.links_worker.run_link_modes` runs every mode of
:data:`MODES` that this build has, in turn, on ``nodes * per_node`` CPU/gloo ranks with
``ZERO_STRATEGY_NODE_SIZE=per_node``: the engine's counters then class each collective as
``intra`` (its group's ranks in one emulated node) or ``inter`` (across nodes), as they would on
a cluster with ``LOCAL_WORLD_SIZE`` set. Gloo on one machine has one link speed, so the step
times measure the work, not a network; the bytes are what a cluster would move.

A mode whose DeepSpeed key this build still ignores (``zero-strategy check`` lists it as
ignored) is skipped with that reason, so the list grows as hpZ and the quantized modes land:
add a :class:`Mode` to :data:`MODES`. FSDP2's collectives run inside torch: its bytes are
computed with the counters' convention (an all-gather of Psi elements counts Psi, a
reduce-scatter Psi, an all-reduce 2 Psi) from its parameter counts: every unit gathered in the
forward, the blocks again in the backward (the root stays gathered), the gradients
reduce-scattered in the shard dimension (intra) and the shard all-reduced in the replicate
dimension (inter).

:func:`cluster_floor` is the same arithmetic on paper for a real cluster (bytes on the wire per
GPU and step, each link class at its bandwidth); ``bench/RESULTS.md`` has its table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODES", "Mode", "available", "cluster_floor", "links_markdown", "run_links", "summarize_links"]


@dataclass(frozen=True)
class Mode:
    name: str
    label: str
    kind: str = "engine"  # "engine" (this engine, counted) or "fsdp2_hsdp" (torch, computed)
    # the zero_optimization block; "{s}" values become the ranks per node
    zero_optimization: dict[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()  # DeepSpeed keys this build must honour for the mode to run


def _zo(**extra: Any) -> dict[str, Any]:
    return {"stage": 3, **extra}


MODES: tuple[Mode, ...] = (
    Mode("zero3", "flat ZeRO-3", zero_optimization=_zo()),
    Mode("shard", "shard groups (MiCS/HSDP)", zero_optimization=_zo(mics_shard_size="{s}")),
    Mode("hpz", "hpZ (secondary partition in the node)", zero_optimization=_zo(zero_hpz_partition_size="{s}"),
         requires=("zero_hpz_partition_size",)),
    Mode("qwz", "qwZ (int8 parameter gathers)", zero_optimization=_zo(zero_quantized_weights=True),
         requires=("zero_quantized_weights",)),
    Mode("qgz", "qgZ (quantized gradients)", zero_optimization=_zo(zero_quantized_gradients=True),
         requires=("zero_quantized_gradients",)),
    Mode("zeropp", "ZeRO++ (hpZ + qwZ + qgZ)",
         zero_optimization=_zo(zero_hpz_partition_size="{s}", zero_quantized_weights=True,
                               zero_quantized_gradients=True),
         requires=("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")),
    Mode("fsdp2_hsdp", "FSDP2 HSDP (torch, 2-D mesh)", kind="fsdp2_hsdp"),
)  # fmt: skip


def _resolved(mode: Mode, per_node: int) -> dict[str, Any]:
    return {k: per_node if v == "{s}" else v for k, v in mode.zero_optimization.items()}


def available(mode: Mode, per_node: int) -> str:
    """ "ok", or why ``mode`` does not run in this build (its keys are read and ignored, or refused)."""
    if mode.kind == "fsdp2_hsdp":
        import importlib.util

        return "ok" if importlib.util.find_spec("torch.distributed.fsdp") else "skipped: torch has no FSDP2"
    if not mode.requires:
        return "ok"
    from zero_strategy.config.zero_config import _DeepSpeedReader

    reader = _DeepSpeedReader("bench --links")
    try:
        reader.read({"zero_optimization": _resolved(mode, per_node)}, warn=False)
    except Exception as exc:  # a refused combination: the reason is the cell
        return f"skipped: {str(exc).splitlines()[0][:160]}"
    ignored = [k for k in mode.requires if f"zero_optimization.{k}" in reader.ignored]
    return f"skipped: not in this build ({', '.join(ignored)} read and ignored)" if ignored else "ok"


def run_links(
    model: str = "small",
    nodes: int = 2,
    per_node: int = 2,
    steps: int = 5,
    warmup: int = 2,
    batch: int = 4,
    modes: tuple[str, ...] | None = None,
    launcher: str = "auto",
    timeout: float = 900.0,
    log: Callable[[str], None] = lambda msg: None,
) -> dict[str, Any]:
    """Run the available modes in one launch; the raw per-rank results and every mode's status."""
    from zero_strategy.bench.estimate import count_model
    from zero_strategy.bench.links_worker import run_link_modes
    from zero_strategy.bench.ranks import choose_launcher, start_ranks

    if nodes < 2 or per_node < 2:
        raise ValueError(f"bench --links {nodes}x{per_node}: give at least 2 nodes of at least 2 ranks, e.g. 2x2")
    chosen = [m for m in MODES if modes is None or m.name in modes]
    if modes is not None and len(chosen) != len(modes):
        raise ValueError(f"bench --links: unknown mode(s) in {modes}; choose from {[m.name for m in MODES]}")
    status = {m.name: available(m, per_node) for m in chosen}
    run = [m for m in chosen if status[m.name] == "ok"]
    specs = [{"name": m.name, "kind": m.kind, "zero_optimization": _resolved(m, per_node)} for m in run]
    spec = {"model": model, "steps": steps, "warmup": warmup, "batch": batch, "nodes": nodes, "per_node": per_node}
    t0 = time.monotonic()
    launcher = choose_launcher(launcher)
    per_rank = start_ranks(run_link_modes, nodes * per_node, args=(specs, spec), timeout=timeout, launcher=launcher,
                           env={"OMP_NUM_THREADS": "1", "ZERO_STRATEGY_NODE_SIZE": str(per_node)})  # fmt: skip
    log(f"{len(run)} modes on {nodes}x{per_node} ranks: {time.monotonic() - t0:.0f} s")
    return {
        "options": {
            "model": model,
            "nodes": nodes,
            "per_node": per_node,
            "steps": steps,
            "warmup": warmup,
            "batch": batch,
        },  # fmt: skip
        "n_params": count_model(model)[0],
        "launcher": launcher,
        "labels": {m.name: m.label for m in chosen},
        "status": status,
        "runs": {m.name: [rk[k] for rk in per_rank] for k, m in enumerate(run)},
        "wall_s": time.monotonic() - t0,
    }


def fsdp2_hsdp_bytes(params: int, block_params: int, shard: int, element_size: int = 4) -> dict[str, float]:
    """FSDP2 HSDP's bytes per step in the counters' convention (see the module's docstring)."""
    gathers = params + block_params  # forward: every unit; backward: the blocks (the root stays gathered)
    return {"intra": float((gathers + params) * element_size), "inter": float(2 * params // shard * element_size)}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("nan")


def summarize_links(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode: bytes per step per link class (rank 0's counters; the largest over ranks for the
    check), rank 0's median step time, losses (mean over ranks) against flat ZeRO-3's, and the
    ratios against flat ZeRO-3 and FSDP2 HSDP."""
    per_node = raw["options"]["per_node"]
    out: list[dict[str, Any]] = []
    for name, label in raw["labels"].items():
        entry: dict[str, Any] = {"mode": name, "label": label, "status": raw["status"][name]}
        ranks = raw["runs"].get(name)
        if ranks is None:
            out.append(entry)
            continue
        if "bytes_per_step" in ranks[0]:
            links = {link: sum(kinds.values()) for link, kinds in ranks[0]["bytes_per_step"].items()}
            entry.update(counted=True, by_kind=ranks[0]["bytes_per_step"], groups=ranks[0]["links"])
        else:
            links = fsdp2_hsdp_bytes(ranks[0]["params"], ranks[0]["block_params"], per_node)
            entry["counted"] = False
        losses = [statistics.fmean(col) for col in zip(*(r["losses"] for r in ranks))]
        entry.update(bytes_intra=links.get("intra", 0.0), bytes_inter=links.get("inter", 0.0),
                     step_s=ranks[0]["median_step_s"], losses=losses)  # fmt: skip
        out.append(entry)
    done = {e["mode"]: e for e in out if "step_s" in e}
    for e in done.values():
        for ref in ("zero3", "fsdp2_hsdp"):
            r = done.get(ref)
            if r is None:
                continue
            e[f"vs_{ref}"] = {
                "inter": e["bytes_inter"] / r["bytes_inter"] if r["bytes_inter"] else float("nan"),
                "intra": e["bytes_intra"] / r["bytes_intra"] if r["bytes_intra"] else float("nan"),
                "step": e["step_s"] / r["step_s"],
            }
        if "zero3" in done:
            e["loss_vs_zero3"] = _rel(e["losses"], done["zero3"]["losses"])
    return out


def _ratio(e: dict[str, Any], ref: str) -> str:
    r = e.get(f"vs_{ref}")
    return "n/a" if r is None else f"{r['inter']:.2f} / {r['intra']:.2f} / {r['step']:.2f}"


def links_markdown(data: dict[str, Any]) -> str:
    o = data["options"]
    lines = [
        f"GPT `{o['model']}` ({data['n_params'] / 1e6:.2f}M parameters, fp32, AdamW), {o['nodes'] * o['per_node']} "
        f"CPU/gloo ranks as {o['nodes']} nodes x {o['per_node']}, micro-batch {o['batch']}, {o['warmup']} warmup + "
        f"{o['steps']} measured steps; ranks started by {data.get('launcher', '?')}; total {data['wall_s']:.0f} s.",
        "",
        "| mode | inter-node MiB/step | intra-node MiB/step | step s | vs flat ZeRO-3 (inter / intra / step) "
        "| vs FSDP2 HSDP (inter / intra / step) | loss vs flat ZeRO-3 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in data["summary"]:
        if "step_s" not in e:
            lines.append(f"| {e['label']} | {e['status']} | | | | | |")
            continue
        how = "" if e["counted"] else " (computed)"
        lines.append(
            f"| {e['label']} | {e['bytes_inter'] / 2**20:.2f}{how} | {e['bytes_intra'] / 2**20:.2f}{how} "
            f"| {e['step_s']:.3f} | {_ratio(e, 'zero3')} | {_ratio(e, 'fsdp2_hsdp')} "
            f"| {e.get('loss_vs_zero3', float('nan')):.1e} |"
        )
    lines += ["", "Bytes: this engine's counters (`zs.comm_stats_by_link()`, rank 0, ZeRO-paper convention: an "
              "all-gather of Psi elements counts Psi, a reduce-scatter Psi, an all-reduce 2 Psi); FSDP2's computed "
              "with the same convention from its parameter counts. One machine has one link speed: step times "
              "measure the work, not a network."]  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------- on paper


def cluster_floor(
    psi: float,
    nodes: int,
    per_node: int,
    intra_gbps: float,
    inter_gbps: float,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    quant_bytes: float = 1.0,
) -> list[dict[str, Any]]:
    """Bytes each GPU sends per step on each link class (ring collectives: an all-gather or
    reduce-scatter over ``g`` ranks sends ``(g-1)/g`` of the full tensor, an all-reduce twice
    that), and the step-time floor each implies at ``intra_gbps`` / ``inter_gbps`` (GB/s per GPU,
    one direction); the floor is the larger of the two (the links work in parallel). A
    collective over ranks of more than one node runs at the inter-node rate. ``quant_bytes``:
    bytes per element of the quantized gathers and gradients (int8: 1)."""
    n, s = nodes * per_node, per_node

    def ring(g: int) -> float:
        return (g - 1) / g

    p, gr, q = psi * param_bytes, psi * grad_bytes, psi * quant_bytes
    rows = {
        # forward gather, backward gather, gradient reduce-scatter: all over n ranks, across nodes
        "flat ZeRO-3": (0.0, ring(n) * (2 * p + gr)),
        # gathers and reduce-scatter inside the node; the shard (1/s) all-reduced across nodes
        "shard groups (MiCS/HSDP, s = per node)": (ring(s) * (2 * p + gr), 2 * ring(nodes) * gr / s),
        # forward gather and reduce-scatter flat; the backward gathers from the secondary shard in the node
        "hpZ (secondary partition in the node)": (ring(s) * p, ring(n) * (p + gr)),
        "qwZ (int8 forward gathers)": (0.0, ring(n) * (q + p + gr)),
        "qgZ (int8 gradients)": (0.0, ring(n) * (2 * p + q)),
        "ZeRO++ (hpZ + qwZ + qgZ)": (ring(s) * p, ring(n) * (q + q)),
    }
    out = []
    for name, (intra, inter) in rows.items():
        t_intra, t_inter = intra / (intra_gbps * 1e9), inter / (inter_gbps * 1e9)
        out.append({"mode": name, "intra_bytes": intra, "inter_bytes": inter, "intra_s": t_intra,
                    "inter_s": t_inter, "floor_s": max(t_intra, t_inter)})  # fmt: skip
    return out
