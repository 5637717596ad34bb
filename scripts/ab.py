"""Side-by-side timing of two source trees on one GPU (the device machine's METHOD.md): the tree
under test (src/) and a baseline (.baseline/src, made with
`mkdir .baseline && git archive REV src | tar -x -C .baseline`), one process per round in the
order base, new, new, base, then one CSV row per case with both rounds of each tree and new/base
(the mean of the new rounds over the mean of the base rounds).

    python3 scripts/ab.py OUT [bench arguments, e.g. --providers cuflash --seqlens 1024,8192]
    python3 scripts/ab.py OUT --overhead
    python3 scripts/ab.py OUT --decode [decode bench arguments]
    python3 scripts/ab.py OUT --ncu {fwd,bwd,dq} [--hdims 64,128] [--seqlens 4096,16384] [--causal 0,1]

The first times `cuflash bench` (TFLOP/s: a ratio above 1 is faster; each round's output in
OUT/<round>-<tree>/), the second scripts/overhead.py (host microseconds per call: below 1 is faster;
each round's output in OUT/<round>-<tree>.txt), the third `cuflash bench --decode` (GB/s of the cache
read, from decode.csv: above 1 is faster). A host's speed drifts between rounds (up to 2x
within minutes on the GPU machines), so --overhead also gives each row's new/base with every
round's time taken over the same round's torch SDPA flash backend (ANCHOR), which both trees run
alike (column vs_anchor).
The fourth counts one Gluon kernel under ncu (the forward, the dK/dV kernel, or the dQ kernel where
the table runs it unfused: D=128 at 513-2048 keys; bf16, 16k tokens, hidden 2048, one launch after
two): ncu fixes the clock policy, so the SM cycles it reports resolve the 1-3% that the bench's rounds
do not (its ratio: cycles, below 1 is faster; OUT/ncu.csv holds each round's cycles, time and
instructions). Every tree and case first runs once without ncu, in parallel, to fill the Triton cache.
Writes OUT/ab.csv and prints the rows and the geometric mean of the ratios.
"""
import argparse
import csv
import itertools
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ORDER = ("base", "new", "new", "base")
ANCHOR = ("torch SDPA, flash backend",)
KEY = ("provider", "dtype", "mode", "variant", "head_dim", "seqlen", "causal")
DECODE_KEY = ("provider", "batch", "seqlen_q", "cache_len", "layout")


NCU_KERNELS = {"fwd": "_attn_fwd_hopper", "bwd": "_attn_bwd_dkdv_hopper", "dq": "_attn_bwd_dq_hopper"}
NCU_METRICS = {"sm__cycles_elapsed.max": "sm_cycles", "gpu__time_duration.sum": "time_ns",
               "smsp__inst_executed.sum": "instructions"}
NCU_KEY = ("pass", "head_dim", "seqlen", "causal")


def _env(tree: str) -> dict:
    return dict(os.environ, PYTHONPATH=".baseline/src" if tree == "base" else "src")


def _ncu_case(mode: str, head_dim: int, seqlen: int, causal: bool, calls: int) -> None:
    """The process ncu profiles: `calls` forward calls (fwd) or one forward and `calls` backward calls,
    bf16, 16k tokens of hidden size 2048 (batch 16k / seqlen, 2048 / head_dim heads)."""
    import torch

    import cuflash
    torch.manual_seed(0)
    shape = (max(16384 // seqlen, 1), seqlen, 2048 // head_dim, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fwd")
               for _ in range(3))
    for _ in range(calls if mode == "fwd" else 1):
        out = cuflash.flash_attn_func(q, k, v, causal=causal)
    if mode != "fwd":
        grad = torch.randn_like(out)
        for _ in range(calls):
            torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    torch.cuda.synchronize()


def parse_ncu(text: str) -> dict[str, float]:
    """NCU_METRICS' values (by their short names) from `ncu --csv` output of one profiled launch."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    values = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") in NCU_METRICS:
            values[NCU_METRICS[row["Metric Name"]]] = float(row["Metric Value"].replace(",", ""))
    if len(values) != len(NCU_METRICS):
        raise RuntimeError(f"ncu reported {sorted(values)} of {sorted(NCU_METRICS.values())}:\n{text[-2000:]}")
    return values


def _ncu(out: Path, args: list[str]) -> list[list]:
    """The --ncu rounds (ORDER), one ncu process per tree, round and case; returns ab.csv's rows."""
    p = argparse.ArgumentParser(prog="ab.py OUT --ncu")
    p.add_argument("mode", choices=sorted(NCU_KERNELS))
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--causal", default="0,1")
    a = p.parse_args(args)
    cases = [(a.mode, d, n, c) for d, n, c in itertools.product(*(map(int, x.split(",")) for x in (
        a.hdims, a.seqlens, a.causal)))]

    def command(case, calls):
        return [sys.executable, __file__, "--case", *map(str, case), str(calls)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # fill the Triton cache: every tree and case once
        list(pool.map(lambda job: subprocess.run(command(job[1], 1), env=_env(job[0]), check=True),
                      itertools.product(("base", "new"), cases)))
    measured: dict[tuple, dict[str, list[float]]] = {}
    with open(out / "ncu.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "tree", *NCU_KEY, *NCU_METRICS.values()])
        for (i, tree), case in itertools.product(enumerate(ORDER, 1), cases):
            text = subprocess.run(["ncu", "-k", f"regex:{NCU_KERNELS[a.mode]}", "--launch-skip", "2", "--launch-count",
                                   "1", "--metrics", ",".join(NCU_METRICS), "--csv", *command(case, 3)],
                                  env=_env(tree), check=True, capture_output=True, text=True).stdout
            values = parse_ncu(text)
            w.writerow([i, tree, *case, *values.values()])
            f.flush()
            measured.setdefault(case, {}).setdefault(tree, []).append(values["sm_cycles"])
    return [[*case, *m["base"], *m["new"], round(sum(m["new"]) / sum(m["base"]), 4)] for case, m in measured.items()]


def _round(out: Path, i: int, tree: str, args: list[str]) -> dict[tuple, float]:
    env = _env(tree)
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
    if sys.argv[1:2] == ["--case"]:  # (the process --ncu profiles)
        mode, d, n, causal, calls = sys.argv[2:7]
        _ncu_case(mode, int(d), int(n), causal in ("1", "True"), int(calls))
        return 0
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    if not Path(".baseline/src").is_dir():  # (git-ignored: a device call takes it only where carry names it)
        print("ab.py: no baseline tree at .baseline/src (make it with `mkdir .baseline && git archive REV src | "
              "tar -x -C .baseline`; on the GPU machine, name .baseline in the call's carry)", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    overhead = sys.argv[2:] == ["--overhead"]
    anchored = False
    if sys.argv[2:3] == ["--ncu"]:
        columns = NCU_KEY
        rows = _ncu(out, sys.argv[3:])
    else:
        columns = ("layer",) if overhead else DECODE_KEY if sys.argv[2:3] == ["--decode"] else KEY
        rounds = [(tree, _round(out, i, tree, sys.argv[2:])) for i, tree in enumerate(ORDER, 1)]
        base = [r for tree, r in rounds if tree == "base"]
        new = [r for tree, r in rounds if tree == "new"]
        anchored = overhead and all(ANCHOR in r for _, r in rounds)
        rows = []
        for key in base[0]:
            b, n = [r[key] for r in base if key in r], [r[key] for r in new if key in r]
            if len(b) == 2 and len(n) == 2:
                row = [*key, *b, *n, round((n[0] + n[1]) / (b[0] + b[1]), 4)]
                if anchored:
                    row.append(round(sum(r[key] / r[ANCHOR] for r in new) / sum(r[key] / r[ANCHOR] for r in base),
                                     4))
                rows.append(row)
    logs = [math.log(row[len(columns) + 4]) for row in rows]
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
