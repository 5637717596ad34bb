"""Forward, bf16, D=128 non-causal, 16k tokens: the Triton and the Gluon forward (the table's launch
with gluon off / on) beside SDPA cuDNN, timed like `cuflash bench` (CUDA events around each call,
8 input sets rotated so the L2 holds none), two rounds in one process."""
import dataclasses, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from cuflash.kernels import attention_forward
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams


def median_ms(step, iters=60, warmup=10):
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(iters)] for _ in range(2))
    for i in range(iters):
        starts[i].record()
        step(i)
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2]


for rnd in range(2):
    for n in (256, 384, 512, 1024):
        b, h, d = 16384 // n, 16, 128
        sets = [[torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3)] for _ in range(8)]
        params = AttentionParams(d ** -0.5)
        flops = 4 * b * h * n * n * d
        cfg = forward_config(sets[0][0], d, n, False)
        line = f"round {rnd} N={n:5d}"
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = median_ms(lambda i: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in sets[i % 8])))
        line += f"  cudnn {flops / ms / 1e9:6.1f}"
        for name, gluon in (("triton", False), ("gluon", True)):
            c = dataclasses.replace(cfg, gluon=gluon)
            ms = median_ms(lambda i: attention_forward(*sets[i % 8], params, c))
            line += f" | {name} {flops / ms / 1e9:6.1f} TFLOP/s {ms * 1e3:6.1f} us"
        print(line, flush=True)
