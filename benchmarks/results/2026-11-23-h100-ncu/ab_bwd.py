"""The whole backward (delta, dK/dV, dQ; the table's launches) with the Gluon backward kernels of a module
copy made for the run (src/cuflash/kernels/_hb_base.py: the committed kernel, not committed) against the
working tree's, in one process, timed in the order base, new, new, base per case (drift and the
second-timed penalty cancel), each a do_bench median over 4 input sets rotated through the L2; cuDNN's
backward as the anchor; gradients compared with base's to 1e-2 absolute (the fused dQ's reductions
run in varying order). bf16, 16k tokens, hidden 2048.
PYTHONPATH=src python3 ab_bwd.py [D,...] [seqlens] [rounds]"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import _hb_base, attention_backward, attention_forward, backward, hopper_backward, launch
from cuflash.params import AttentionParams

modules = {"base": _hb_base, "new": hopper_backward}
hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "128,64").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096,16384").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


def run(name, sets, params):
    backward.hopper_backward = modules[name]
    launch._plans.clear()
    grads = attention_backward(*sets[0], params)
    return grads, timed(lambda *s: attention_backward(*s, params), sets)


for rnd in range(1, rounds + 1):
    for d in hdims:
        for n in seqlens:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                sets = []
                for _ in range(4):
                    q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
                    out, lse = attention_forward(q, k, v, params)
                    sets.append((do, q, k, v, out, lse))
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                ts = [[t.transpose(1, 2).detach().requires_grad_() for t in s[1:4]] for s in sets]
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    outs = [F.scaled_dot_product_attention(*t, is_causal=causal) for t in ts]
                    ref = timed(lambda o, t, g: torch.autograd.grad(o, t, g, retain_graph=True),
                                [(o, t, s[0].transpose(1, 2)) for o, t, s in zip(outs, ts, sets)])
                times = {"base": [], "new": []}
                for name in ("base", "new", "new", "base"):
                    grads, ms = run(name, sets, params)
                    if name == "base":
                        first = grads
                    else:
                        same = all(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0) for a, b in zip(grads, first))
                    times[name].append(ms)
                rate = {name: flops / (sum(t) / len(t)) / 1e9 for name, t in times.items()}
                print(f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}  base "
                      f"{rate['base']:5.1f} new {rate['new']:5.1f}{'' if same else '(DIFFERS)'}  "
                      f"{rate['new'] / rate['base'] - 1:+6.1%}  (base {times['base'][0]:.3f}/{times['base'][1]:.3f} "
                      f"new {times['new'][0]:.3f}/{times['new'][1]:.3f} ms)", flush=True)
                backward.hopper_backward = hopper_backward
                launch._plans.clear()
