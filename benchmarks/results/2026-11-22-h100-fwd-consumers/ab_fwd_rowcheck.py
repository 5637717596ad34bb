"""Side by side in one process, D=128 forward: the committed Gluon forward before this change (a copy
at src/cuflash/kernels/_hf_old.py, `git show 8caa84e:src/cuflash/kernels/hopper_forward.py`), the new
one, and the new one without the rows-past-the-end check (a copy at _hf_var.py with
`n_mine = n_tiles`); bf16, 16k tokens, device time, three rounds.
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-fwd-consumers/ab_fwd_rowcheck.py"""
import dataclasses

import torch
import triton

from cuflash.kernels import _hf_old, _hf_var, attention_forward, forward, hopper_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams


class Old:  # the committed module, called like the new one
    accepts = staticmethod(_hf_old.accepts)

    @staticmethod
    def launch_args(tensors, prob, params, consumers):
        return _hf_old.launch_args(tensors, prob, params)


variants = [("old", Old), ("new", hopper_forward), ("no-row-check", _hf_var)]
d = 128
for rnd in (1, 2, 3):
    for n in (2048, 4096, 8192):
        for causal in (True, False):
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            cfg = dataclasses.replace(forward_config(q, d, n, causal), gluon=True)
            line = f"round {rnd} D={d} N={n:5d} causal={causal!s:5}"
            for name, module in variants:
                forward.hopper_forward = module
                launch._plans.clear()
                ms = triton.testing.do_bench(lambda: attention_forward(q, k, v, params, cfg), warmup=25, rep=100,
                                             return_mode="median")
                line += f"  {name} {flops / ms / 1e9:5.1f}"
            forward.hopper_forward = hopper_forward
            print(line, flush=True)
