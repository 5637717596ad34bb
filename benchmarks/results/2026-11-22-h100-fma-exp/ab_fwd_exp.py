"""Forward, bf16, one process: the committed Gluon forward (src/cuflash/kernels/_hf_base.py, a copy
of kernels/hopper_forward.py at 27199a4: every exponential on the MUFU) against the working tree's
(half of each tile's exponentials as a polynomial on the FMA units), beside cuDNN, rounds
interleaved. Where the table runs the Triton forward both columns time the same launch (noise)."""
import argparse, sys
sys.path.insert(0, "scripts")
from tune import cases, bench, _sdpa_ms
import torch
from cuflash.kernels import _hf_base, attention_forward, forward, hopper_forward, launch

p = argparse.ArgumentParser()
p.add_argument("--seqlen", default="1024,4096,16384")
p.add_argument("--hdims", default="64,128")
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
for n, d, causal, b, h, q, k, v, do, flops, params in [c for _ in range(args.rounds) for c in cases(args, torch.bfloat16)]:
    anchor, _ = _sdpa_ms(q, k, v, do, causal)
    line = f"D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {flops / anchor / 1e9:6.1f}"
    for name, module in (("mufu", _hf_base), ("split", hopper_forward)):
        forward.hopper_forward = module
        launch._plans.clear()
        ms = bench(lambda: attention_forward(q, k, v, params))
        line += f" | {name} {flops / ms / 1e9:6.1f} {anchor / ms:5.2f}x"
    print(line, flush=True)
