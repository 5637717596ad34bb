"""Side by side in one process: the committed Gluon forward (a copy of it at
src/cuflash/kernels/_hf_old.py, made from git for the run: `git show HEAD:...`) against the new one
(two Q buffers at D=64, each consumer visiting only the tiles its rows see) with 2 or 3
consumer warpgroups, beside the Triton forward and cuDNN; bf16, 16k tokens, hidden 2048, device time
(triton.testing.do_bench, median).
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-fwd-consumers/ab_fwd_mine.py [D,...] [seqlens]"""
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import _hf_old, attention_forward, forward, hopper_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams


class Old:  # the committed module, called like the new one
    accepts = staticmethod(_hf_old.accepts)

    @staticmethod
    def launch_args(tensors, prob, params, consumers):
        return _hf_old.launch_args(tensors, prob, params)


hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4096,8192,16384").split(",")]
variants = [("triton", hopper_forward, False, 2), ("old", Old, True, 2), ("new2", hopper_forward, True, 2),
            ("new3", hopper_forward, True, 3)]
for rnd in (1, 2):
    for d in hdims:
        for n in seqlens:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                                  warmup=25, rep=100, return_mode="median")
                line = f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}"
                for name, module, gluon, consumers in variants:
                    if d == 128 and consumers == 3:
                        continue  # out of registers
                    cfg = dataclasses.replace(forward_config(q, d, n, causal), gluon=gluon, consumers=consumers)
                    forward.hopper_forward = module
                    launch._plans.clear()
                    ms = triton.testing.do_bench(lambda: attention_forward(q, k, v, params, cfg), warmup=25,
                                                 rep=100, return_mode="median")
                    line += f"  {name} {flops / ms / 1e9:5.1f}"
                forward.hopper_forward = hopper_forward
                print(line, flush=True)
