"""Side by side in one process, two rounds: Gluon forward variants as module copies made for the run
(src/cuflash/kernels/_hf_*.py, not committed): base (the committed kernel), pf (the loader asks the L2
for the next item's Q rows: the working tree), kv (pf, and each item's first K/V tile loaded before its
Q), noepi (base with the epilogue's O and lse stores predicated off: what the stores' traffic costs).
bf16, 16k tokens, hidden 2048, the table's launches (Gluon ones only), device time (do_bench median)
(outputs compared with the first variant's, bitwise) over 4 input sets rotated so that the L2 does not keep Q between calls, cuDNN as the anchor.
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-epilogue/ab_fwd_variants.py [D,...] [seqlens]"""
import importlib
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_forward, forward, hopper_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams

names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["base", "new", "noepi"]
modules = {"new": hopper_forward, **{n: importlib.import_module(f"cuflash.kernels._hf_{n}") for n in names if n != "new"}}
hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "128,64").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4096,16384").split(",")]


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


for rnd in (1, 2):
    for d in hdims:
        for n in seqlens:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                sets = [[torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3)] for _ in range(4)]
                cfg = forward_config(sets[0][0], d, n, causal)
                if not cfg.gluon:
                    continue
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = timed(lambda q, k, v: F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal), sets)
                line = f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5} consumers={cfg.consumers}  cudnn {flops / ref / 1e9:5.1f}"
                for name in names:
                    if name == "sep" and d == 128:
                        continue  # a separate O buffer does not fit beside D=128's K/V ring
                    forward.hopper_forward = modules[name]
                    launch._plans.clear()
                    out, lse = attention_forward(*sets[0], params, cfg)
                    if name == names[0]:
                        first = out, lse
                    same = "" if name == "noepi" or (torch.equal(out, first[0]) and torch.equal(lse, first[1])) else "(DIFFERS)"
                    ms = timed(lambda q, k, v: attention_forward(q, k, v, params, cfg), sets)
                    line += f"  {name} {flops / ms / 1e9:5.1f}{same}"
                forward.hopper_forward = hopper_forward
                launch._plans.clear()
                print(line, flush=True)
