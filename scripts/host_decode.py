"""Host time per flash_attn_with_kvcache decode step (one query token, a cache small enough that the
GPU finishes first), against torch SDPA's flash backend on the same step: contiguous cache with an
int or a tensor cache_seqlens, paged cache. Usage, on a GPU: PYTHONPATH=src python3 scripts/host_decode.py
(fastest of 5 interleaved rounds of 2000 calls)."""
import time

import torch
import torch.nn.functional as F

import cuflash


def per_call_us(fn, calls=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


dev, dt = "cuda", torch.bfloat16
q = torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
k_new, v_new = (torch.randn(1, 1, 8, 128, device=dev, dtype=dt) for _ in range(2))
k_cache, v_cache = (torch.randn(1, 256, 8, 128, device=dev, dtype=dt) for _ in range(2))
k_pages, v_pages = (torch.randn(16, 16, 8, 128, device=dev, dtype=dt) for _ in range(2))
table = torch.arange(16, device=dev, dtype=torch.int32)[None]
seqlens = torch.tensor([100], device=dev, dtype=torch.int32)
sdpa_q, sdpa_k = q.transpose(1, 2), k_cache[:, :101].transpose(1, 2)
cases = {
    "contiguous, int cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                             cache_seqlens=100, causal=True),
    "contiguous, tensor cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                                cache_seqlens=seqlens, causal=True),
    "paged, tensor cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new,
                                                                           cache_seqlens=seqlens, block_table=table,
                                                                           causal=True),
}


def sdpa_flash():
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_k)


cases["torch SDPA flash (attention only)"] = sdpa_flash
best = {name: float("inf") for name in cases}
for _ in range(5):
    for name, fn in cases.items():
        best[name] = min(best[name], per_call_us(fn))
for name, us in best.items():
    print(f"{name:40s} {us:7.1f} us")
