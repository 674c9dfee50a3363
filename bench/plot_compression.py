"""Plot ``bench_compression.py --json`` results: training loss per step (a moving mean over
``--smooth`` steps) of every run of each file, one panel per file, dense solid, top-k dashed.

    PYTHONPATH=. python bench/plot_compression.py out/adam_noclip.json out/adam_clip.json \\
        --titles "AdamW,AdamW + clipping" --png bench/plots/compression.png

A file without a dense run (``--no-dense``) takes the dense numbers from ``--dense EVAL,MB``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _smooth(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def main(argv: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--titles", default=None, help="comma list, one per file (default: the file names)")
    ap.add_argument("--smooth", type=int, default=10)
    ap.add_argument("--png", required=True)
    ap.add_argument(
        "--ylim", default=None, help="'LOW,HIGH': the loss axis (a run that diverged would flatten the rest)"
    )
    ap.add_argument("--dense", default=None, help="'EVAL,MB': the dense run's held-out loss and MB per step, for "
                    "files without a dense run (bench_compression.py --no-dense)")  # fmt: skip
    args = ap.parse_args(argv)
    titles = args.titles.split(",") if args.titles else [Path(f).stem for f in args.files]
    cols = min(2, len(args.files))
    rows = (len(args.files) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False, sharey=True)
    for ax, path, title in zip(axes.flat, args.files, titles):
        runs = json.loads(Path(path).read_text())
        if "dense" in runs:
            dense, dense_bytes = runs["dense"]["eval"], runs["dense"]["bytes"]
        elif args.dense:
            dense, dense_mb = (float(x) for x in args.dense.split(","))
            dense_bytes = dense_mb * 2**20
        else:
            raise SystemExit(f"plot_compression.py: {path} has no dense run; pass --dense EVAL,MB")
        for name, run in runs.items():
            label = f"{name}: held-out {run['eval']:.3f} ({100 * (run['eval'] / dense - 1):+.1f}%), " + (
                f"{100 * run['bytes'] / dense_bytes:.1f}% bytes"
            )
            ax.plot(_smooth(run["losses"], args.smooth), "-" if name == "dense" else "--", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {args.smooth} steps)")
        if args.ylim:
            ax.set_ylim(*(float(x) for x in args.ylim.split(",")))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(args.files) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)


if __name__ == "__main__":
    main()
