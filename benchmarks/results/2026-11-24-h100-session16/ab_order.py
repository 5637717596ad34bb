"""The Triton kernels' banded launch order: heaviest tiles first across groups of heads sized to the L2
(new, the working tree) against each head's tiles in turn (base: heads_per_group 1, the order before),
in one process, timed in the order base, new, new, base per case, each a do_bench median over 4 input
sets rotated through the L2; outputs and gradients compared with base's. 16k tokens, hidden 2048.
PYTHONPATH=src python3 ab_order.py"""
import itertools

import torch
import triton

from cuflash.kernels import attention_backward, attention_forward, backward, forward, launch
from cuflash.kernels.config import heads_per_group
from cuflash.params import AttentionParams

# (dtype, head dim, seqlens, causal): the inputs that take the Triton kernels on Hopper.
CASES = [(torch.bfloat16, 256, (1024, 2048, 4096, 8192, 16384), True),
         (torch.bfloat16, 256, (4096,), False),
         (torch.float32, 64, (1024, 4096), True),
         (torch.float32, 128, (1024, 4096), True),
         (torch.bfloat16, 64, (512,), True)]


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


def use(name):
    group = (lambda *a: 1) if name == "base" else heads_per_group
    forward.heads_per_group = backward.heads_per_group = group
    launch._plans.clear()


def run(name, sets, params):
    use(name)
    q, k, v, do = sets[0]
    out, lse = attention_forward(q, k, v, params)
    grads = attention_backward(do, q, k, v, out, lse, params)
    fwd = timed(lambda q, k, v, do: attention_forward(q, k, v, params), sets)
    fixed = [(s, attention_forward(*s[:3], params)) for s in sets]
    bwd = timed(lambda s, o: attention_backward(s[3], *s[:3], *o, params), fixed)
    return (out, *grads), fwd, bwd


for rnd in (1, 2):
    for dtype, d, seqlens, causal in CASES:
        for n in seqlens:
            b, h = 16384 // n, 2048 // d
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            sets = [tuple(torch.randn(b, n, h, d, dtype=dtype, device="cuda") for _ in range(4)) for _ in range(4)]
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            times = {"base": [], "new": []}
            for name in ("base", "new", "new", "base"):
                results, fwd, bwd = run(name, sets, params)
                if name == "base":
                    first = results
                else:
                    same = all(torch.equal(a, b) for a, b in zip(results, first))
                times[name].append((fwd, bwd))
            rate = {name: [m * flops / (sum(t[i] for t in ts) / 2) / 1e9 for i, m in enumerate((1.0, 2.5))]
                    for name, ts in times.items()}
            print(f"round {rnd} {str(dtype)[6:]:8s} D={d:3d} N={n:5d} causal={causal!s:5} G={heads_per_group(sets[0][1], n, d)}"
                  f"  fwd base {rate['base'][0]:5.1f} new {rate['new'][0]:5.1f} {rate['new'][0] / rate['base'][0] - 1:+6.1%}"
                  f"  bwd base {rate['base'][1]:5.1f} new {rate['new'][1]:5.1f} {rate['new'][1] / rate['base'][1] - 1:+6.1%}"
                  f"  {'bitwise equal' if same else 'DIFFERS'}"
                  f"  (fwd ms {' '.join(f'{t[0]:.3f}' for t in times['base'] + times['new'])})", flush=True)
