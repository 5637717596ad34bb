"""Summarizes `ncu -i REP --page source --print-source sass --csv` (stdin): per kernel, the SASS
instructions with the most warp-stall samples and the stall reasons behind them, and the totals
per reason. python3 stalls.py [top] < sass.csv"""
import collections
import csv
import sys

top = int(sys.argv[1]) if len(sys.argv) > 1 else 40
rows = list(csv.reader(sys.stdin))
kernels, current = [], None
for row in rows:
    if "Address" in row and "Source" in row:
        current = (row, [])
        kernels.append(current)
    elif current is not None and len(row) == len(current[0]):
        current[1].append(row)
    elif row:
        print("#", ",".join(row)[:200])


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


for header, body in kernels:
    print("\n=== columns:", " | ".join(header))
    all_col = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    reason_cols = [i for i, h in enumerate(header) if "stall" in h.lower() and i != all_col
                   and not h.startswith("Warp Stall Sampling")]
    total = sum(num(r[all_col]) for r in body) or 1.0
    per_reason = collections.Counter()
    for r in body:
        for i in reason_cols:
            per_reason[header[i]] += num(r[i])
    print(f"instructions {len(body)}, stall samples {total:.0f}")
    for name, v in per_reason.most_common(14):
        print(f"  {name:60s} {v / total:6.1%}")
    print(f"--- top {top} instructions by samples (address, share, source, main reasons)")
    for r in sorted(body, key=lambda r: -num(r[all_col]))[:top]:
        reasons = sorted(((num(r[i]), header[i]) for i in reason_cols), reverse=True)[:3]
        why = ", ".join(f"{h.split('_')[-1] if '_' in h else h}={v:.0f}" for v, h in reasons if v)
        print(f"{r[header.index('Address')]:>6} {num(r[all_col]) / total:6.2%}  {r[header.index('Source')][:70]:70s} {why}")
