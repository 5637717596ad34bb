"""Host time per forward call (no grad; no synchronization but every 8 calls; medians of 200, three
rounds), bf16, 16k tokens: torch's cuDNN and flash SDPA, cuflash.scaled_dot_product_attention on
(B, H, N, D), cuflash.flash_attn_func on (B, N, H, D), ops.forward with prebuilt AttentionParams, and
kernels.attention_forward alone.
PYTHONPATH=src python3 host_fwd_parts.py"""
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from cuflash import ops
from cuflash.kernels import attention_forward
from cuflash.params import AttentionParams

dev = torch.device("cuda")


def host_us(fn, calls=200):
    for i in range(20):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e6)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times)


torch.set_grad_enabled(False)
for n, d in ((128, 64), (1024, 128)):
    b, h = 16384 // n, 2048 // d
    bhnd = [[torch.randn(b, h, n, d, dtype=torch.bfloat16, device=dev) for _ in range(3)] for _ in range(4)]
    bnhd = [[t.transpose(1, 2).contiguous() for t in s] for s in bhnd]
    params = AttentionParams(d ** -0.5)

    def sdpa(backend):
        def call(i):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*bhnd[i % 4])
        return call

    steps = {"sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "cuflash-sdpa": lambda i: cuflash.scaled_dot_product_attention(*bhnd[i % 4]),
             "cuflash-flash": lambda i: cuflash.flash_attn_func(*bnhd[i % 4]),
             "ops.forward": lambda i: ops.forward(*bnhd[i % 4], params),
             "kernels-fwd": lambda i: attention_forward(*bnhd[i % 4], params)}
    for rnd in range(3):
        row = {name: host_us(fn) for name, fn in steps.items()}
        print(f"N={n} D={d} round {rnd}: " + ", ".join(f"{name} {us:.1f}" for name, us in row.items())
              + " (us, host, median)", flush=True)
