"""Side by side in one process, whole backward: the committed Gluon dK/dV kernel (a copy at
src/cuflash/kernels/_hb_old.py made from git for the run) against the one whose dK product of a
query tile runs behind the next tile's S^T and dP^T, each with 2 and 3 ring buffers (STAGES);
bf16, 16k tokens, hidden 2048, device time (triton.testing.do_bench, median). `det` rows pass
deterministic=True (two passes; otherwise the table fuses dQ at D=64 where it does).
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-bwd-pipeline/ab_dkdv_pipeline.py"""
import types

import torch
import triton

from cuflash.kernels import _hb_old, attention_backward, attention_forward, backward, hopper_backward, launch
from cuflash.params import AttentionParams


def staged(module, stages):
    def dkdv_launch(*args):
        kernel, grid, kwargs = module.dkdv_launch(*args)
        return kernel, grid, {**kwargs, "STAGES": stages}
    return types.SimpleNamespace(accepts=module.accepts, dq_launch=module.dq_launch, dkdv_launch=dkdv_launch)


variants = [("old s2", staged(_hb_old, 2)), ("old s3", staged(_hb_old, 3)), ("new s2", staged(hopper_backward, 2)),
            ("new s3", staged(hopper_backward, 3))]
cases = [(64, n, c, det) for n in (1024, 4096, 16384) for c in (False, True) for det in (False, True)]
cases += [(128, n, c, True) for n in (1024, 4096, 16384) for c in (False, True)]
for rnd in (1, 2):
    for d, n, causal, det in cases:
        b, h = 16384 // n, 2048 // d
        q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        params = AttentionParams(d ** -0.5, window_right=0 if causal else -1, deterministic=det)
        out, lse = attention_forward(q, k, v, params)
        line = f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5} det={det!s:5}"
        for name, module in variants:
            backward.hopper_backward = module
            launch._plans.clear()
            ms = triton.testing.do_bench(lambda: attention_backward(do, q, k, v, out, lse, params), warmup=25,
                                         rep=100, return_mode="median")
            line += f"  {name} {flops / ms / 1e9:5.1f}"
        backward.hopper_backward = hopper_backward
        print(line, flush=True)
