"""Side by side in one process: the Gluon forward with 2 or 3 consumer warpgroups and one or two
Q buffers (hopper_forward.Q_BUFFERS, read when a launch is planned), beside the Triton forward and
cuDNN, bf16, 16k tokens, hidden 2048, device time (triton.testing.do_bench, median).
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-fwd-consumers/ab_fwd_qbuf.py [D] [seqlens]"""
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_forward, hopper_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams

d = int(sys.argv[1]) if len(sys.argv) > 1 else 64
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4096,8192,16384").split(",")]
variants = [("triton", False, 2, 1), ("c2 q1", True, 2, 1), ("c2 q2", True, 2, 2), ("c3 q1", True, 3, 1),
            ("c3 q2", True, 3, 2)]
for rnd in (1, 2):
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
            line = f"round {rnd} D={d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}"
            for name, gluon, consumers, qbuf in variants:
                if d == 128 and (consumers == 3 or qbuf == 2):
                    continue  # out of registers / shared memory
                cfg = dataclasses.replace(forward_config(q, d, n, causal), gluon=gluon, consumers=consumers)
                hopper_forward.Q_BUFFERS = qbuf
                launch._plans.clear()
                ms = triton.testing.do_bench(lambda: attention_forward(q, k, v, params, cfg), warmup=25, rep=100,
                                             return_mode="median")
                line += f"  {name} {flops / ms / 1e9:5.1f}"
            print(line, flush=True)
