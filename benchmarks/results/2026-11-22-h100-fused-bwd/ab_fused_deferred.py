"""Whole backward, bf16, one process: the two passes (deterministic=True), dQ fused as committed in
877ddd8 (each consumer's dQ part right after its dK/dV of the tile; src/cuflash/kernels/_hb_split.py,
a copy of that hopper_backward.py) and dQ fused one tile late (the working tree), beside cuDNN.
The fused pass is forced at D=128 too (the table takes it at D=64 only); --rounds repeats."""
import argparse, dataclasses, sys
sys.path.insert(0, "scripts")
from tune import cases, bench, _sdpa_ms
import torch
from cuflash.kernels import _hb_split, attention_backward, attention_forward, backward, hopper_backward, launch

p = argparse.ArgumentParser()
p.add_argument("--seqlen", default="1024,4096,16384")
p.add_argument("--hdims", default="128,64")
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
table = backward.backward_configs
backward.backward_configs = lambda *a: (dataclasses.replace(table(*a)[0], fuse_dq=True), table(*a)[1])
variants = (("two-pass", True, hopper_backward), ("split", False, _hb_split), ("deferred", False, hopper_backward))
for n, d, causal, b, h, q, k, v, do, flops, params in [c for _ in range(args.rounds) for c in cases(args, torch.bfloat16)]:
    _, anchor_bwd = _sdpa_ms(q, k, v, do, causal)
    out, lse = attention_forward(q, k, v, params)
    line = f"D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {2.5 * flops / anchor_bwd / 1e9:6.1f}"
    for name, det, module in variants:
        backward.hopper_backward = module
        launch._plans.clear()
        pr = dataclasses.replace(params, deterministic=det)
        ms = bench(lambda: attention_backward(do, q, k, v, out, lse, pr))
        line += f" | {name} {2.5 * flops / ms / 1e9:6.1f} {anchor_bwd / ms:5.2f}x"
    print(line, flush=True)
