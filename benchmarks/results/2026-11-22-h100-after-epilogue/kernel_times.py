"""Device time per kernel of cuflash's forward and backward (torch.profiler, 20 calls each, mean per
call) with the table's launches: where the time goes, the small kernels (delta, the fused dQ's cast)
included, and the bytes per second of the delta kernel (reads O and dO, writes one float per row).
bf16, 16k tokens, hidden 2048.
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h100-after-epilogue/kernel_times.py [D,...] [seqlens]"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cuflash.kernels import attention_backward, attention_forward
from cuflash.params import AttentionParams

hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096,16384").split(",")]
CALLS = 20
for d in hdims:
    for n in seqlens:
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            out, lse = attention_forward(q, k, v, params)
            for _ in range(3):
                attention_backward(do, q, k, v, out, lse, params)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    attention_forward(q, k, v, params)
                    attention_backward(do, q, k, v, out, lse, params)
                torch.cuda.synchronize()
            times = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    times[e.name] += e.device_time / CALLS
            parts = "  ".join(f"{name[:40]} {t:7.1f} us" for name, t in sorted(times.items(), key=lambda x: -x[1]))
            delta = sum(t for name, t in times.items() if "delta" in name)
            gbs = 2 * q.numel() * 2 / (delta * 1e-6) / 1e9 if delta else 0
            print(f"D={d:3d} N={n:5d} causal={causal!s:5}  {parts}  | delta reads at {gbs:6.0f} GB/s", flush=True)
