"""Sweeps the decode kernel's launch (key tile, warps, stages) and split count on the GPU at hand:
GB/s of the cached K/V read per call, replayed from a CUDA graph, against the device copy
bandwidth. Fills decode_tiles (kernels/plan.py) and PROGRAMS_PER_SM (kernels/triton/decode.py). Run from
the source tree: PYTHONPATH=src python3 scripts/tune_decode.py [--profile]  (--profile: only the kernel breakdown)"""
import sys

import torch

from cuflash.bench.decode import GRAPH_BYTES, _time, copy_bandwidth
from cuflash.kernels.device import num_sms
from cuflash.kernels.triton import Tiles
from cuflash.kernels.triton.decode import PROGRAMS_PER_SM, decode_forward
from cuflash.params import AttentionParams

CONFIGS = [Tiles(64, *c) for c in [(64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 3)]]
CASES = [(1, 32768, 16), (1, 131072, 256), (8, 4096, None), (8, 32768, 16), (8, 32768, 256), (64, 4096, 16),
         (64, 32768, None)]


def profile(batch: int, n: int, nheads: int, nheads_k: int, d: int, dtype) -> None:
    """Device time of the kernels of one decode step, cuflash and SDPA's cuDNN backend, and the time
    the benchmark measures for a CUDA graph of it (and of a graph holding one tiny kernel: the floor)."""
    import cuflash
    from cuflash.bench.decode import _sdpa
    q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, n, nheads_k, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    tiny = torch.zeros(1, device="cuda")
    steps = {"cuflash": lambda: cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, causal=True),
             "sdpa-cudnn": _sdpa("sdpa-cudnn", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
             "one tiny kernel": lambda: tiny.add_(1)}
    for name, step in steps.items():
        graph_ms, eager_ms = _time([step], 1, 30, torch.device("cuda"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        kernels = ", ".join(f"{e.key[:40]} {e.device_time_total / e.count:.1f} us" for e in prof.key_averages()
                            if e.device_time_total > 0)
        print(f"batch {batch} cache {n} {name}: graph {graph_ms * 1e3:.1f} us, eager {eager_ms * 1e3:.1f} us; "
              f"kernels: {kernels}")


def main():
    torch.manual_seed(0)
    nheads, nheads_k, d, dtype = 32, 8, 128, torch.bfloat16
    copy = copy_bandwidth(torch.device("cuda"), 2**30, 20)
    print(f"copy bandwidth {copy:.0f} GB/s; {num_sms(torch.device('cuda'))} SMs; default PROGRAMS_PER_SM "
          f"{PROGRAMS_PER_SM}")
    if "--profile" in sys.argv:
        for batch, n in ((1, 32768), (8, 4096), (1, 131072)):
            profile(batch, n, nheads, nheads_k, d, dtype)
        return
    params = AttentionParams(d ** -0.5, window_right=0)
    for batch, n, page in CASES:
        q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
        rows = batch * n // page if page else batch
        k = torch.randn(rows, page or n, nheads_k, d, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        table = torch.randperm(rows, device="cuda").view(batch, -1).int() if page else None
        seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        nbytes = 2 * k.numel() * k.element_size()
        # As cuflash bench --decode times it: a graph of calls reading GRAPH_BYTES at least, so that a
        # replay's fixed cost does not weigh on small caches.
        per_graph = min(64, max(1, -(-GRAPH_BYTES // nbytes)))
        results = []
        for cfg in CONFIGS:
            for per_sm in (1, 2, 4):
                splits = max(1, min(64, -(-per_sm * num_sms(q.device) // (batch * nheads_k))))
                fn = lambda: decode_forward(q, k, v, seqlens, 0, None, None, table, params, splits, tiles=cfg)  # noqa: E731
                try:
                    fn()
                    ms, _ = _time([fn], per_graph, 20, q.device)
                except Exception as exc:  # out of shared memory and the like
                    print(f"  {cfg} {per_sm}/SM: {type(exc).__name__}")
                    continue
                results.append((nbytes / ms / 1e6, cfg, per_sm, splits))
        results.sort(key=lambda r: -r[0])
        print(f"batch {batch} cache {n} {'paged' + str(page) if page else 'contiguous'} ({nbytes / 1e6:.0f} MB):")
        for gbps, cfg, per_sm, splits in results[:8]:
            print(f"  {gbps:6.0f} GB/s ({gbps / copy:.0%} of copy)  BN={cfg.block_n} warps={cfg.num_warps} "
                  f"stages={cfg.num_stages} {per_sm}/SM -> {splits} splits")


if __name__ == "__main__":
    main()
