"""python -m cuflash.bench: a side-by-side sweep, printed as a table and written as CSV/markdown."""
from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
from pathlib import Path

import torch

from .harness import PROVIDERS, Case, run_case

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuflash.bench", description=__doc__)
    p.add_argument("--providers", default="cuflash,sdpa-cudnn,sdpa-flash", help=f"from {','.join(PROVIDERS)}")
    p.add_argument("--seqlens", default="2048,8192")
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--modes", default="fwd,bwd")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (the papers' setting)")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim")
    p.add_argument("--out", default=None, help="folder for results.csv and results.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    providers = args.providers.split(",")
    for name in providers:
        if name not in PROVIDERS:
            p.error(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    cases = [Case(max(1, args.tokens // n), n, args.hidden // d, d, c, DTYPES[args.dtype], m)
             for d in map(int, args.hdims.split(",")) for c in causals for m in args.modes.split(",")
             for n in map(int, args.seqlens.split(","))]
    rows = []
    total = len(cases) * len(providers)
    for i, case in enumerate(cases):
        for j, provider in enumerate(providers):
            print(f"\r[{i * len(providers) + j + 1}/{total}] {provider} {case.mode} D={case.head_dim} "
                  f"N={case.seqlen} causal={case.causal}    ", end="", file=sys.stderr, flush=True)
            rows.append(run_case(provider, case))
    print(file=sys.stderr)
    header = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
              f"{__import__('triton').__version__} | cuDNN {torch.backends.cudnn.version()} | "
              f"{datetime.date.today()} | python {platform.python_version()}")
    table = _markdown(rows, providers, header)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.csv", "w", newline="") as f:
            fields = list(dict.fromkeys(k for r in rows for k in r))
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        (out / "results.md").write_text(table + "\n")
    return 0


def _markdown(rows, providers, header) -> str:
    """One line per case: TFLOP/s of each provider and cuflash's ratio to each of the others."""
    others = [p for p in providers if p != "cuflash"]
    lines = [header, "",
             "| mode | D | N | causal | " + " | ".join(f"{p} TFLOP/s" for p in providers) + " | "
             + " | ".join(f"vs {p}" for p in others) + " | cuflash err |",
             "|---" * (5 + len(providers) + len(others)) + "|"]
    keys = []
    for r in rows:
        key = (r["mode"], r["head_dim"], r["seqlen"], r["causal"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        by = {r["provider"]: r for r in rows if (r["mode"], r["head_dim"], r["seqlen"], r["causal"]) == key}
        tf = {p: by[p].get("tflops") for p in providers if p in by}
        cells = [f"{tf[p]:.1f}" if tf.get(p) else "n/a" for p in providers]
        ratios = [f"{tf['cuflash'] / tf[p]:.2f}x" if tf.get("cuflash") and tf.get(p) else "n/a" for p in others]
        err = by.get("cuflash", {}).get("rel_err")
        err_cell = f"{err:.1e}" if err is not None else "n/a"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells + ratios)
                     + f" | {err_cell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
