"""Plots of a benchmark CSV: TFLOP/s against seqlen, one line per provider, one panel per
(variant, mode, head dim, causal). Usage: python -m cuflash.bench.plot results.csv [--out results.png]"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def plot(csv_path: Path, png_path: Path, title: str = "", metric: str = "tflops") -> Path:
    """metric: "tflops" (the y axis from 0) or "ms" (time per call, log scale: providers far apart,
    as the CPU and GPU of `cuflash experiment`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tflops")]
    panels = list(dict.fromkeys((r.get("variant", "none"), r["mode"], r["head_dim"], r["causal"]) for r in rows))
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    if metric == "ms":
        unit, scale = "ms per call", 1.0
    else:
        unit = "TFLOP/s" if any(float(r["tflops"]) > 1 for r in rows) else "GFLOP/s"
        scale = 1.0 if unit == "TFLOP/s" else 1e3
    for ax, panel in zip(axes.flat, panels):
        variant, mode, head_dim, causal = panel
        mine = [r for r in rows if (r.get("variant", "none"), r["mode"], r["head_dim"], r["causal"]) == panel]
        for provider in dict.fromkeys(r["provider"] for r in mine):
            pts = sorted((int(r["seqlen"]), float(r[metric]) * scale) for r in mine if r["provider"] == provider)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linewidth=2.5 if provider == "cuflash" else 1.2, label=provider)
        ax.set_xscale("log", base=2)
        name = "" if variant == "none" else f"{variant}, "
        ax.set_title(f"{name}{mode}, D={head_dim}, {'causal' if causal == 'True' else 'non-causal'}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel(unit)
        if metric == "ms":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuflash.bench.plot", description=__doc__)
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the CSV)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    print(plot(args.csv, args.out or args.csv.with_suffix(".png"), args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
