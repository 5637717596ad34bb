"""The Gluon forward's main loop in SASS, without a GPU: compiles the kernel the launch table picks for
Hopper (scripts/compile_check.py's stand-in driver) and reports, for one K/V tile of one consumer
warpgroup (from one S product's first HGMMA to the next tile's), the instructions a thread runs by
opcode, the exponentials issued between the S product's wait and the P V product's wait (0: the
P V product is awaited before the softmax, not overlapped with it), and ptxas's spill stores. This is
what docs/tuning.md's instruction counts per tile come from (benchmarks/results/h100/schedule/). Use the
GPU machine's Triton for numbers to compare with its runs (compile_check.py's docstring says how):

    PYTHONPATH=src python3 scripts/loop_sass.py [--hdims 64,128,256] [--seqlen 3000] [--option plain] [--top 12]
"""
import argparse
import collections
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL = "_attn_fwd_hopper"


def _instructions(sass: str) -> list[str]:
    """The instructions of a cuobjdump listing, predicates kept, without addresses and encodings."""
    found = re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]+);", sass)
    return [" ".join(text.split()) for text in found]


def _opcode(instruction: str) -> str:
    words = instruction.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loop_report(sass: str) -> tuple[int, collections.Counter, int]:
    """(instructions a tile, their opcodes, exponentials between the two wgmma waits) of the forward's
    main loop: the span between the first instructions of the second and third S products (an S product
    is a run of HGMMA whose first starts from a zero accumulator, `RZ`)."""
    code = _instructions(sass)
    zero_starts = [i for i, text in enumerate(code) if text.startswith("HGMMA") and ", RZ" in text]
    starts = [i for n, i in enumerate(zero_starts) if n == 0 or i - zero_starts[n - 1] > 40]
    if len(starts) < 3:
        raise SystemExit(f"found {len(starts)} S products, not the forward's loop")
    tile = code[starts[1]:starts[2]]
    waits = [i for i, text in enumerate(tile) if text.startswith("WARPGROUP.DEPBAR")]
    overlapped = sum(_opcode(text) == "MUFU" for text in tile[waits[0]:waits[1]]) if len(waits) >= 2 else 0
    return len(tile), collections.Counter(map(_opcode, tile)), overlapped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--seqlen", type=int, default=3000, help="queries and keys (the table's length class)")
    p.add_argument("--option", default="plain", help="a scripts/compile_check.py option (plain, causal, ...)")
    p.add_argument("--top", type=int, default=12, help="opcodes listed a kernel")
    args = p.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="loop_sass_"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # (before Triton is imported)
    try:
        _report(args, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


def _report(args, cache: Path) -> None:
    """Compiles each head dim's case into `cache` and prints its forward kernels' loop reports."""
    check = runpy.run_path(str(Path(__file__).with_name("compile_check.py")), run_name="compile_check")
    import torch
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas  # (the ptxas Triton compiles sm_90 with)

    seen: set[Path] = set()
    for d in map(int, args.hdims.split(",")):
        error = check["compile_case"](torch.bfloat16, d, args.seqlen, args.seqlen, 4, 2, args.option)
        if error:
            print(f"D={d}: {error}")
            continue
        for cubin in sorted(set(cache.glob(f"*/{KERNEL}.cubin")) - seen):
            seen.add(cubin)
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], check=True, capture_output=True,
                                  text=True).stdout
            ptx = cubin.with_suffix(".ptx")
            report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                                    capture_output=True, text=True).stderr
            spills = re.search(r"(\d+) bytes spill stores", report)
            threads = re.search(r"\.reqntid (\d+)", ptx.read_text())
            n, ops, overlapped = loop_report(sass)
            warps = int(threads.group(1)) // 32 if threads else 0
            print(f"D={d} {args.option} {args.seqlen} ({warps} warps): {n} instructions a tile, {overlapped} "
                  f"exponentials between the S and P V waits, {spills.group(1) if spills else '?'} bytes spilled")
            print("   ", ", ".join(f"{op} {count}" for op, count in ops.most_common(args.top)))


if __name__ == "__main__":
    sys.exit(main())
