"""GPU time of a decode step (flash_attn_with_kvcache, bf16, 32 query heads on 8 KV heads, D=128, one new
token, causal) with softcap and with ALiBi beside the plain step, per batch and cache length: 20 steps
captured in one CUDA graph, fastest of 5 rounds of 5 replays (host time excluded), and the step's time
from Python (eager). For A/B runs of the decode kernel's options (scripts/ab.py's trees by PYTHONPATH).
Usage, on a GPU: PYTHONPATH=src python3 scripts/decode_options.py"""
import time

import torch
import triton

import cuflash
from short_kernels import graph_us  # (scripts/ is the path's first entry when run as a script)


def eager_us(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


print(triton.__version__, torch.cuda.get_device_name())
print("batch  cache  option   graph_us  eager_us")
slopes = torch.rand(32, device="cuda") * 0.1
for batch in (1, 8, 64):
    for cache in (4096, 32768):
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.full((batch,), cache - 1, dtype=torch.int32, device="cuda")
        for name, options in (("plain", {}), ("softcap", dict(softcap=30.0)), ("alibi", dict(alibi_slopes=slopes))):
            def step():
                cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, **options)
            print(f"{batch:5d}  {cache:5d}  {name:7s}  {graph_us(step):8.1f}  {eager_us(step):8.1f}", flush=True)
