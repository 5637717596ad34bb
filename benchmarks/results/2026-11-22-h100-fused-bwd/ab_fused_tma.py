"""Whole backward, bf16: two passes (deterministic=True) vs dQ fused into the dK/dV kernel (TMA
reductions, the default), beside cuDNN, in one process; --rounds repeats the sweep."""
import argparse, dataclasses, sys
sys.path.insert(0, "scripts")
from tune import cases, bench, _sdpa_ms, _anchor
from cuflash.kernels import attention_backward, attention_forward

p = argparse.ArgumentParser()
p.add_argument("--seqlen", default="1024,4096,16384")
p.add_argument("--hdims", default="128,64")
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
import torch
for n, d, causal, b, h, q, k, v, do, flops, params in [c for _ in range(args.rounds) for c in cases(args, torch.bfloat16)]:
    _, anchor_bwd = _sdpa_ms(q, k, v, do, causal)
    out, lse = attention_forward(q, k, v, params)
    line = f"D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {2.5 * flops / anchor_bwd / 1e9:6.1f}"
    for name, det in (("two-pass", True), ("fused", False)):
        pr = dataclasses.replace(params, deterministic=det)
        ms = bench(lambda: attention_backward(do, q, k, v, out, lse, pr))
        line += f" | {name} {2.5 * flops / ms / 1e9:6.1f} TFLOP/s {anchor_bwd / ms:5.2f}x"
    print(line, flush=True)
