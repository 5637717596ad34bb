"""Side-by-side timing of two source trees on one GPU (the device machine's METHOD.md): the tree
under test (src/) and a baseline (.baseline/src, made with
`mkdir .baseline && git archive REV src | tar -x -C .baseline`), one process per round in the
order base, new, new, base, then one CSV row per case with both rounds of each tree and new/base
(the mean of the new rounds over the mean of the base rounds).

    python3 scripts/ab.py OUT [bench arguments, e.g. --providers cuflash --seqlens 1024,8192]
    python3 scripts/ab.py OUT --overhead
    python3 scripts/ab.py OUT --decode [decode bench arguments]

The first times `cuflash bench` (TFLOP/s: a ratio above 1 is faster; each round's output in
OUT/<round>-<tree>/), the second scripts/overhead.py (host microseconds per call: below 1 is faster;
each round's output in OUT/<round>-<tree>.txt), the third `cuflash bench --decode` (GB/s of the cache
read, from decode.csv: above 1 is faster). A host's speed drifts between rounds (up to 2x
within minutes on the GPU machines), so --overhead also gives each row's new/base with every
round's time taken over the same round's torch SDPA flash backend (ANCHOR), which both trees run
alike (column vs_anchor).
Writes OUT/ab.csv and prints the rows and the geometric mean of the ratios.
"""
import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ORDER = ("base", "new", "new", "base")
ANCHOR = ("torch SDPA, flash backend",)
KEY = ("provider", "dtype", "mode", "variant", "head_dim", "seqlen", "causal")
DECODE_KEY = ("provider", "batch", "seqlen_q", "cache_len", "layout")


def _round(out: Path, i: int, tree: str, args: list[str]) -> dict[tuple, float]:
    env = dict(os.environ, PYTHONPATH=".baseline/src" if tree == "base" else "src")
    if args == ["--overhead"]:
        text = subprocess.run([sys.executable, "scripts/overhead.py"], env=env, check=True, capture_output=True,
                              text=True).stdout
        (out / f"{i}-{tree}.txt").write_text(text)
        return {(m[2],): float(m[1]) for m in re.finditer(r"^\s*([\d.]+) us  (.+)$", text, re.MULTILINE)}
    folder = out / f"{i}-{tree}"
    subprocess.run([sys.executable, "-m", "cuflash.bench", *args, "--out", str(folder)], env=env, check=True)
    decode = args[:1] == ["--decode"]
    with open(folder / ("decode.csv" if decode else "results.csv")) as f:
        key, value = (DECODE_KEY, "gbps") if decode else (KEY, "tflops")
        return {tuple(row[k] for k in key): float(row[value]) for row in csv.DictReader(f) if row.get(value)}


def main() -> int:
    if len(sys.argv) < 2 or not Path(".baseline/src").is_dir():
        print(__doc__)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    overhead = sys.argv[2:] == ["--overhead"]
    columns = ("layer",) if overhead else DECODE_KEY if sys.argv[2:3] == ["--decode"] else KEY
    rounds = [(tree, _round(out, i, tree, sys.argv[2:])) for i, tree in enumerate(ORDER, 1)]
    base = [r for tree, r in rounds if tree == "base"]
    new = [r for tree, r in rounds if tree == "new"]
    anchored = overhead and all(ANCHOR in r for _, r in rounds)
    rows, logs = [], []
    for key in base[0]:
        b, n = [r[key] for r in base if key in r], [r[key] for r in new if key in r]
        if len(b) == 2 and len(n) == 2:
            ratio = (n[0] + n[1]) / (b[0] + b[1])
            row = [*key, *b, *n, round(ratio, 4)]
            if anchored:
                row.append(round(sum(r[key] / r[ANCHOR] for r in new) / sum(r[key] / r[ANCHOR] for r in base), 4))
            rows.append(row)
            logs.append(math.log(ratio))
    with open(out / "ab.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*columns, "base_r1", "base_r2", "new_r1", "new_r2", "ratio", *(["vs_anchor"] if anchored else [])])
        w.writerows(rows)
    for row in rows:
        print(",".join(map(str, row)))
    if logs:
        print(f"{len(rows)} cases; new/base {min(r[len(columns) + 4] for r in rows):.3f}-"
              f"{max(r[len(columns) + 4] for r in rows):.3f}, "
              f"geometric mean {math.exp(sum(logs) / len(logs)):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
