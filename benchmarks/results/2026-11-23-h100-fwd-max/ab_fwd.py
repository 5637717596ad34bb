"""The forward (the table's launches) with the Gluon forward of a module copy made for the run
(src/cuflash/kernels/_hf_base.py: the committed kernel, not committed) against the working tree's, in
one process, timed in the order base, new, new, base per case, each a do_bench median over 4 input
sets rotated through the L2; cuDNN's forward as the anchor; outputs compared with base's to 1e-2
absolute. bf16, 16k tokens, hidden 2048.
PYTHONPATH=src python3 ab_fwd.py [D,...] [seqlens] [rounds]"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import _hf_base, attention_forward, forward, hopper_forward, launch
from cuflash.params import AttentionParams

modules = {"base": _hf_base, "new": hopper_forward}
hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4096,16384").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


def run(name, sets, params):
    forward.hopper_forward = modules[name]
    launch._plans.clear()
    out, _ = attention_forward(*sets[0], params)
    return out, timed(lambda *s: attention_forward(*s, params), sets)


for rnd in range(1, rounds + 1):
    for d in hdims:
        for n in seqlens:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                sets = [tuple(torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                        for _ in range(4)]
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                [tuple(t.transpose(1, 2) for t in s) for s in sets])
                times = {"base": [], "new": []}
                for name in ("base", "new", "new", "base"):
                    out, ms = run(name, sets, params)
                    if name == "base":
                        first = out
                    else:
                        same = torch.allclose(out.float(), first.float(), atol=1e-2, rtol=0)
                    times[name].append(ms)
                rate = {name: flops / (sum(t) / len(t)) / 1e9 for name, t in times.items()}
                print(f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}  base "
                      f"{rate['base']:5.1f} new {rate['new']:5.1f}{'' if same else '(DIFFERS)'}  "
                      f"{rate['new'] / rate['base'] - 1:+6.1%}  (base {times['base'][0]:.3f}/{times['base'][1]:.3f} "
                      f"new {times['new'][0]:.3f}/{times['new'][1]:.3f} ms)", flush=True)
                forward.hopper_forward = hopper_forward
                launch._plans.clear()
