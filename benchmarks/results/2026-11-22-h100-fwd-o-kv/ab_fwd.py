"""Side by side in one process, two rounds: the Gluon forward as committed (base: a module copy made
for the run, src/cuflash/kernels/_hf_base.py, not committed) and the working tree's (new), both on
every case the table or a check might give them (the table's consumer count where it takes Gluon, else
2), and the Triton forward with the table's tiles (triton). bf16, 16k tokens, hidden 2048; device time
(do_bench median) over 4 input sets rotated so that the L2 does not keep Q between calls; outputs of
the Gluon variants compared bitwise with base's; cuDNN as the anchor; the table's pick marked with *.
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-fwd-o-kv/ab_fwd.py [D,...] [seqlens]"""
import dataclasses
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

modules = {"base": importlib.import_module("cuflash.kernels._hf_base"), "new": hopper_forward}
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
                table = forward_config(sets[0][0], d, n, causal)
                gluon = dataclasses.replace(table, gluon=True, consumers=table.consumers if table.gluon else 2)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = timed(lambda q, k, v: F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal), sets)
                line = (f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5} consumers={gluon.consumers}  "
                        f"cudnn {flops / ref / 1e9:5.1f}")
                for name in ("base", "new", "triton"):
                    cfg = dataclasses.replace(table, gluon=False) if name == "triton" else gluon
                    forward.hopper_forward = modules.get(name, hopper_forward)
                    launch._plans.clear()
                    out, lse = attention_forward(*sets[0], params, cfg)
                    if name == "base":
                        first = out, lse
                    same = "" if name == "triton" or (torch.equal(out, first[0]) and torch.equal(lse, first[1])) \
                        else "(DIFFERS)"
                    ms = timed(lambda q, k, v: attention_forward(q, k, v, params, cfg), sets)
                    pick = "*" if (name == "triton") != table.gluon else " "
                    line += f"  {name}{pick}{flops / ms / 1e9:5.1f}{same}"
                forward.hopper_forward = hopper_forward
                launch._plans.clear()
                print(line, flush=True)
