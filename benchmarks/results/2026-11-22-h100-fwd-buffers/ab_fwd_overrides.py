"""Side by side in one process: the Gluon forward with some of its launch constants overridden
(K/V ring depth STAGES, Q_BUFFERS, key tile BLOCK_N), beside the table's launch, the Triton forward and
cuDNN; bf16, 16k tokens, hidden 2048, device time (triton.testing.do_bench, median).
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-fwd-buffers/ab_fwd_overrides.py [q|ring]"""
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_forward, hopper_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams

launch_args = hopper_forward.launch_args
CASES = {  # (D, seqlens, causal values, variants: name -> overrides of the kernel's constants)
    "q": [(128, (1024, 2048, 4096), (False, True),
           {"s3q1": {}, "s2q2": {"STAGES": 2, "Q_BUFFERS": 2}, "s2q1": {"STAGES": 2}}),
          (64, (1024, 2048), (True,), {"n128": {}, "n64": {"BLOCK_N": 64}, "n64s4": {"BLOCK_N": 64, "STAGES": 4}})],
    # (with three consumers at D=64 beyond 2k keys, the table's)
    "ring": [(64, (4096, 16384), (False, True),
              {"s3": {}, "s2": {"STAGES": 2}, "s4": {"STAGES": 4}, "n64s4": {"BLOCK_N": 64, "STAGES": 4}})],
}[sys.argv[1] if len(sys.argv) > 1 else "q"]
for rnd in (1, 2):
    for d, seqlens, causals, variants in CASES:
        for n in seqlens:
            for causal in causals:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                                  warmup=25, rep=100, return_mode="median")
                line = f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / ref / 1e9:5.1f}"
                table = forward_config(q, d, n, causal)
                runs = [("triton", dataclasses.replace(table, gluon=False), {})]
                runs += [(name, dataclasses.replace(table, gluon=True), change) for name, change in variants.items()]
                for name, cfg, change in runs:
                    def patched(*args, change=change):
                        kernel, grid, kwargs = launch_args(*args)
                        return kernel, grid, {**kwargs, **change}
                    hopper_forward.launch_args = patched
                    launch._plans.clear()
                    ms = triton.testing.do_bench(lambda: attention_forward(q, k, v, params, cfg), warmup=25,
                                                 rep=100, return_mode="median")
                    line += f"  {name} {flops / ms / 1e9:5.1f}"
                hopper_forward.launch_args = launch_args
                print(line, flush=True)
