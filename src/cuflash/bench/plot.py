"""Plots of a benchmark CSV: TFLOP/s against seqlen, one line per provider, one panel per
(variant, mode, head dim, causal), or for `bench --flex`'s CSV (flex_plot) per (mod, pass).
Usage: python -m cuflash.bench.plot results.csv [--out results.png]"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def plot(csv_path: Path, png_path: Path, title: str = "", metric: str = "tflops") -> Path:
    """metric: "tflops" (the y axis from 0) or "ms" (time per call, log scale: providers far apart,
    as the CPU and GPU of `cuflash experiment`)."""
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tflops")]
    panels = list(dict.fromkeys((r.get("variant", "none"), r["mode"], _dims(r), r["causal"]) for r in rows))
    if metric == "ms":
        unit, scale = "ms per call", 1.0
    else:
        unit = "TFLOP/s" if any(float(r["tflops"]) > 1 for r in rows) else "GFLOP/s"
        scale = 1.0 if unit == "TFLOP/s" else 1e3
    plt, fig, axes = _figure(len(panels), min(4, len(panels)), (4.2, 3.4))
    for ax, panel in zip(axes.flat, panels):
        variant, mode, head_dim, causal = panel
        mine = [r for r in rows if (r.get("variant", "none"), r["mode"], _dims(r), r["causal"]) == panel]
        _lines(ax, mine, lambda r: float(r[metric]) * scale, "cuflash")
        name = "" if variant == "none" else f"{variant}, "
        ax.set_title(f"{name}{mode}, D={head_dim}, {'causal' if causal == 'True' else 'non-causal'}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel(unit)
        if metric == "ms":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    return _save(plt, fig, axes, len(panels), title, png_path)


def _dims(row: dict) -> str:
    """A row's head dim, D or D:Dv where v's differs (CSVs written before head_dim_v have D alone)."""
    d, dv = row["head_dim"], row.get("head_dim_v") or row["head_dim"]
    return d if d == dv else f"{d}:{dv}"


def flex_plot(csv_path: Path, png_path: Path, title: str = "") -> Path:
    """`bench --flex`'s CSV: TFLOP/s of the visible pairs against the keys, a line per provider, a panel
    per mod and pass (forward, backward), a row per head dim."""
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("fwd_tflops")]
    mods = list(dict.fromkeys(r["mod"] for r in rows))
    panels = [(d, m, p) for d in dict.fromkeys(r["head_dim"] for r in rows) for m in mods for p in ("fwd", "bwd")]
    plt, fig, axes = _figure(len(panels), 2 * len(mods) if len(mods) <= 2 else 4, (3.6, 3.0))
    for ax, (head_dim, mod, pass_) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["head_dim"], r["mod"]) == (head_dim, mod)]
        _lines(ax, mine, lambda r: float(r[f"{pass_}_tflops"]), "cuflash-flex")
        ax.set_title(f"{mod}, {'forward' if pass_ == 'fwd' else 'backward'}, D={head_dim}", fontsize=10)
        ax.set_xlabel("keys")
        ax.set_ylabel("TFLOP/s (visible pairs)")
        ax.set_ylim(bottom=0)
    return _save(plt, fig, axes, len(panels), title, png_path)


def _figure(panels: int, cols: int, size: tuple[float, float]):
    """(pyplot, figure, axes grid) of `panels` panels in rows of `cols`, each `size` inches."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(size[0] * cols, size[1] * nrows), squeeze=False)
    return plt, fig, axes


def _lines(ax, rows: list[dict], value, highlight: str) -> None:
    """A line per provider of rows, value(row) against seqlen (log 2), the `highlight` provider's bold."""
    for provider in dict.fromkeys(r["provider"] for r in rows):
        pts = sorted((int(r["seqlen"]), value(r)) for r in rows if r["provider"] == provider)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linewidth=2.5 if provider == highlight else 1.2, label=provider)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)


def _save(plt, fig, axes, panels: int, title: str, png_path: Path) -> Path:
    """The figure, its unused panels blanked, the legend in the first, written to png_path."""
    for ax in list(axes.flat)[panels:]:
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
    with open(args.csv) as f:
        flex = "fwd_tflops" in (csv.DictReader(f).fieldnames or ())
    print((flex_plot if flex else plot)(args.csv, args.out or args.csv.with_suffix(".png"), args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
