"""The bench's outputs: a Markdown table, the JSON it is made from, three PNG plots, and the
generated section of ``bench/RESULTS.md``.

- ``memory.png``: model-state MiB per rank against the rank count, one line per row (measured,
  solid) beside its formula (dashed).
- ``breakdown.png``: seconds per step, stacked: compute, exposed communication, optimizer step,
  offload I/O (waits on the disk tier's swap files), per row at the largest rank count.
- ``losses.png``: every row's loss per step at the largest rank count, overlaid on DDP's.

The table and plots are made from the JSON alone (:func:`write_outputs`, ``--update-results``),
so a saved run can be redrawn. Matplotlib (``pip install zero-strategy[bench]``) draws with the
non-interactive Agg backend.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "markdown", "update_results", "write_outputs", "write_plots"]

MIB = 2**20
BEGIN = "<!-- zero-strategy bench: generated section, begin (zero-strategy bench --update-results) -->"
END = "<!-- zero-strategy bench: generated section, end -->"
HOST_IS_DEVICE = "host = device here"


def _cell(v: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec) + suffix


def _loss_cell(v: float | str, row: str) -> str:
    if row == "ddp":
        return "(reference)"
    if isinstance(v, str):
        return f"no ({v})" if v.startswith("differs") else v
    return f"yes ({v:.0e})" if v <= 1e-5 else f"no (max rel {v:.1e})"


def markdown(data: dict[str, Any]) -> str:
    """The table: one line per (row, rank count)."""
    cpu_only = data.get("machine", {}).get("device") == "cpu"
    lines = [
        "| row | ranks | model states MiB per rank (formula) | peak RSS MiB per rank | samples/s "
        "| exposed comm % of step | final loss | loss = DDP's |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in data["summary"]:
        label = e["label"] + (f" ({HOST_IS_DEVICE})" if cpu_only and e["row"] in ("zero3_cpu", "zero3_nvme") else "")
        if e["status"] != "ok":
            lines.append(f"| {label} | {e['ranks']} | {e['status']} | | | | | |")
            continue
        formula = _cell(e["formula_bytes"] / MIB, ".1f")
        tiers = e["tiers"]
        split = ""
        if tiers.get("tier_disk") or tiers.get("tier_host_pageable") or tiers.get("tier_host_pinned"):
            host = tiers.get("tier_host_pageable", 0) + tiers.get("tier_host_pinned", 0)
            split = (f" [device {tiers.get('tier_device', 0) / MIB:.1f}, host {host / MIB:.1f}, "
                     f"disk {tiers.get('tier_disk', 0) / MIB:.1f}]")  # fmt: skip
        lines.append(
            f"| {label} | {e['ranks']} | {e['model_state_bytes'] / MIB:.1f} ({formula}){split} "
            f"| {e['peak_rss_bytes'] / MIB:.0f} | {e['samples_per_s']:.1f} | {_cell(e['exposed_pct'], '.1f', '%')} "
            f"| {e['losses'][-1]:.4f} | {_loss_cell(e['loss_vs_ddp'], e['row'])} |"
        )
    return "\n".join(lines)


def header(data: dict[str, Any]) -> str:
    o, m = data["options"], data.get("machine", {})
    return (
        f"GPT `{o['model']}` ({data['n_params'] / 1e6:.2f}M parameters), bundled text, fp32 AdamW, micro-batch "
        f"{o['batch']} per rank, {o['warmup']} warmup + {o['steps']} measured steps, {o['repeats']} interleaved "
        f"repeat(s); {m.get('nproc', '?')} CPU cores ({m.get('cpu', '?')}), torch {m.get('torch', '?')}, "
        f"{m.get('date', '')}; load average at start {m.get('load', '?')}; ranks started by "
        f"{data.get('launcher', 'the own launcher')}; total {data['wall_s']:.0f} s.\n\n"
        f"Command: `{data.get('command', '')}`"
    )


def notes(data: dict[str, Any]) -> str:
    return (
        "Model states: parameters, gradients, optimizer state and masters (`memory_stats()` for this engine, the "
        "unique storages of parameters, grads and optimizer state for DDP/FSDP2) at the step's peak (after the "
        "backward or after the step), the largest over ranks; the formula is `zero-strategy estimate`'s. "
        "Samples/s: ranks x micro-batch / rank 0's median step time (forward + backward + step + zero_grad, after "
        "a barrier). Exposed comm: the time this engine's host waited on collectives (`zs.comm_stats`) over the "
        "step time; n/a for peers, whose collectives this engine does not time. Loss = DDP's: every step's loss "
        f"(mean over ranks) within 1e-5 relative of DDP's at the same rank count. Offload rows on a CPU machine: "
        f"{HOST_IS_DEVICE}, so they show the copies' and I/O's step cost, not device memory saved."
    )


def write_plots(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in data["summary"] if e["status"] == "ok"]
    rows = list(dict.fromkeys(e["row"] for e in ok))
    label = {e["row"]: e["label"] for e in ok}
    colors = {r: f"C{i}" for i, r in enumerate(rows)}
    paths = [out / "memory.png", out / "breakdown.png", out / "losses.png"]
    title = f"GPT {data['options']['model']} ({data['n_params'] / 1e6:.1f}M params)"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        pts = sorted((e["ranks"], e["model_state_bytes"] / MIB, e["formula_bytes"] / MIB) for e in ok if e["row"] == r)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], "o-", color=colors[r], label=f"{label[r]} measured")
        ax.plot(xs, [p[2] for p in pts], "x--", color=colors[r], alpha=0.6, label=f"{label[r]} formula")
    ax.set(xlabel="ranks", ylabel="model states MiB per rank", title=f"Model states per rank: {title}")
    ax.set_xticks(sorted({e["ranks"] for e in ok}))
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)

    n_max = max(e["ranks"] for e in ok)
    at = [e for e in ok if e["ranks"] == n_max]
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottom = [0.0] * len(at)
    for part, color in (("compute", "C0"), ("exposed_comm", "C3"), ("optimizer", "C2"), ("offload_io", "C1")):
        vals = [e["breakdown"].get(part) or 0.0 for e in at]
        ax.bar(
            range(len(at)),
            vals,
            bottom=bottom,
            color=color,
            label={"offload_io": "offload I/O"}.get(part, part.replace("_", " ")),
        )
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(at)), [e["label"].replace(" + ", "\n+ ") for e in at], fontsize=7)
    ax.set(ylabel="seconds per step (rank 0)", title=f"Step time breakdown, {n_max} rank(s): {title}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.text(0.01, 0.01, "offload I/O: the waits on swap-file reads and writes; DDP and peers: no exposed-comm split",
             fontsize=6)  # fmt: skip
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(paths[1], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, e in enumerate(at):
        style = {"linewidth": 3, "alpha": 0.4} if e["row"] == "ddp" else {"linestyle": (0, (1 + i, 2)), "linewidth": 1}
        ax.plot(range(1, len(e["losses"]) + 1), e["losses"], color=colors[e["row"]], label=e["label"], **style)
    ax.set(xlabel="step", ylabel="loss (mean over ranks)", title=f"Loss per step, {n_max} rank(s): {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=80)
    plt.close(fig)
    return paths


PLOTS = ("memory", "breakdown", "losses")


def write_outputs(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """``bench.json`` and ``bench.md`` under ``out``, then the three PNGs when matplotlib is
    installed (the ``bench`` extra); without it the result has no plot entries."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(data, indent=1))
    table = f"{header(data)}\n\n{markdown(data)}\n\n{notes(data)}\n"
    (out / "bench.md").write_text(table)
    paths = {"json": out / "bench.json", "md": out / "bench.md"}
    if not plots_available():
        return paths
    return {**paths, **dict(zip(PLOTS, write_plots(data, out)))}


def plots_available() -> bool:
    """Whether matplotlib can be imported (the plots need it; the table and JSON do not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def update_results(results_md: Path, data: dict[str, Any], plot: str | None = None) -> None:
    """Replace the text between :data:`BEGIN` and :data:`END` in ``results_md`` with the table
    made from ``data`` (and a link to ``plot``); add the markers at the end the first time.
    Everything outside the markers (the hand-written history) stays as it is."""
    text = results_md.read_text() if results_md.exists() else ""
    body = f"{header(data)}\n\n{markdown(data)}\n\n{notes(data)}\n"
    if plot:
        body += f"\n![model states per rank]({plot})\n"
    section = f"{BEGIN}\n{body}{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: section, text, count=1, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## `zero-strategy bench` (generated)\n\n" + section + "\n"
    results_md.write_text(text)
