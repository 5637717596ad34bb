"""The forward (the table's launches) with the Gluon forward of module copies made for the run
(src/cuflash/kernels/_hf_*.py, not committed; "base" = _hf_base.py, the committed kernel) against the
working tree's ("new"), in one process, each timed twice per case in the order base, others, reversed;
each a do_bench median over 4 input sets rotated through the L2; cuDNN's forward as the anchor; outputs
compared with base's to 1e-2 absolute. bf16, 16k tokens, hidden 2048.
PYTHONPATH=src python3 ab_fwd_mods.py D,... seqlens rounds causal,... module,...  (e.g. reg: _hf_reg.py)"""
import importlib
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_forward, forward, hopper_forward, launch
from cuflash.params import AttentionParams

hdims = [int(d) for d in sys.argv[1].split(",")]
seqlens = [int(n) for n in sys.argv[2].split(",")]
rounds = int(sys.argv[3])
causals = [c == "1" for c in sys.argv[4].split(",")]
modules = {"base": importlib.import_module("cuflash.kernels._hf_base"), "new": hopper_forward}
for name in sys.argv[5].split(",") if len(sys.argv) > 5 else ():
    modules[name] = importlib.import_module(f"cuflash.kernels._hf_{name}")
order = list(modules) + list(modules)[::-1]


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


for rnd in range(1, rounds + 1):
    for d in hdims:
        for n in seqlens:
            for causal in causals:
                b, h = 16384 // n, 2048 // d
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                sets = [tuple(torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                        for _ in range(4)]
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                [tuple(t.transpose(1, 2) for t in s) for s in sets])
                times = {name: [] for name in modules}
                same = {}
                for name in order:
                    forward.hopper_forward = modules[name]
                    launch._plans.clear()
                    out, _ = attention_forward(*sets[0], params)
                    if name == "base":
                        first = out
                    else:
                        same[name] = torch.allclose(out.float(), first.float(), atol=1e-2, rtol=0)
                    times[name].append(timed(lambda *s: attention_forward(*s, params), sets))
                rate = {name: flops / (sum(t) / len(t)) / 1e9 for name, t in times.items()}
                cols = "  ".join(f"{name} {rate[name]:5.1f}{'' if same.get(name, True) else '(DIFFERS)'} "
                                 f"{rate[name] / rate['base'] - 1:+6.1%}" for name in modules if name != "base")
                print(f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}  base "
                      f"{rate['base']:5.1f}  {cols}", flush=True)
                forward.hopper_forward = hopper_forward
                launch._plans.clear()
