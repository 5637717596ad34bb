"""Sweeps the decode kernel's launch (key tile, warps, stages) and split count on the GPU at hand:
GB/s of the cached K/V read per call, replayed from a CUDA graph, against the device copy
bandwidth, and the default launch's figure beside the best SDPA backend's (contiguous cache). Fills
decode_tiles and even_splits (kernels/plan.py). Run from the source tree:

    PYTHONPATH=src python3 scripts/tune_decode.py [--batches 1,8 --caches 32768 --layouts contiguous,paged256
                                                   --configs 64x4x3,128x4x3 --all] [--profile]

--configs: key tile x warps x stages; --all: every split count's figure, not the best ten;
--profile: only the kernel breakdown of a few steps."""
import argparse

import torch

from cuflash.bench.decode import GRAPH_BYTES, copy_bandwidth, sdpa_call, time_calls
from cuflash.kernels.device import num_sms
from cuflash.kernels import decode_forward
from cuflash.kernels.plan import MAX_SPLITS
from cuflash.kernels.triton import Tiles
from cuflash.params import AttentionParams

CONFIGS = "64x4x3,64x4x2,128x4x2,128x4x3,128x8x3"
CASES = [(1, 131072, None), (1, 131072, 256), (8, 32768, None), (8, 32768, 256), (8, 131072, None),
         (8, 131072, 16), (64, 4096, None), (64, 32768, 16)]
SPLITS = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 17, 20, 24, 32, 33, 40, 48, 64)


def profile(batch: int, n: int, nheads: int, nheads_k: int, d: int, dtype) -> None:
    """Device time of the kernels of one decode step, cuflash and SDPA's cuDNN backend, and the time
    the benchmark measures for a CUDA graph of it (and of a graph holding one tiny kernel: the floor)."""
    import cuflash
    q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, n, nheads_k, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    tiny = torch.zeros(1, device="cuda")
    steps = {"cuflash": lambda: cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, causal=True),
             "sdpa-cudnn": sdpa_call("sdpa-cudnn", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
             "one tiny kernel": lambda: tiny.add_(1)}
    for name, step in steps.items():
        graph_ms, eager_ms = time_calls([step], 1, 30, torch.device("cuda"))
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches")
    p.add_argument("--caches")
    p.add_argument("--layouts", default="contiguous,paged256")
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--all", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    copy = copy_bandwidth(torch.device("cuda"), 2**30, 20)
    print(f"copy bandwidth {copy:.0f} GB/s; {num_sms(torch.device('cuda'))} SMs")
    if args.profile:
        for batch, n in ((1, 32768), (8, 4096), (1, 131072)):
            profile(batch, n, nheads, nheads_k, d, dtype)
        return
    configs = [Tiles(64, *map(int, c.split("x"))) for c in args.configs.split(",")]
    cases = CASES if not args.batches else [
        (b, n, int(layout[5:]) if layout.startswith("paged") else None) for b in map(int, args.batches.split(","))
        for n in map(int, args.caches.split(",")) for layout in args.layouts.split(",")]
    params = AttentionParams(d ** -0.5, window_right=0)
    for batch, n, page in cases:
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
        default = lambda: decode_forward(q, k, v, seqlens, 0, None, None, table, params)  # noqa: E731
        default()
        default_ms, _ = time_calls([default], per_graph, 20, q.device)
        for cfg in configs:
            for splits in (s for s in SPLITS if s <= MAX_SPLITS and s * batch * nheads_k <= 16 * num_sms(q.device)):
                fn = lambda: decode_forward(q, k, v, seqlens, 0, None, None, table, params, splits, tiles=cfg)  # noqa: E731
                try:
                    fn()
                    ms, _ = time_calls([fn], per_graph, 20, q.device)
                except Exception as exc:  # out of shared memory and the like
                    print(f"  {cfg} {splits} splits: {type(exc).__name__}")
                    continue
                results.append((nbytes / ms / 1e6, cfg, splits))
        if not args.all:
            results.sort(key=lambda r: -r[0])
        sdpa = ""
        if not page:
            best = min((time_calls([sdpa_call(name, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))],
                                   per_graph, 20, q.device)[0], name) for name in ("sdpa-cudnn", "sdpa-flash"))
            sdpa = f"; best SDPA {best[1]} {nbytes / best[0] / 1e6:.0f} GB/s"
        print(f"batch {batch} cache {n} {'paged' + str(page) if page else 'contiguous'} ({nbytes / 1e6:.0f} MB): "
              f"default {nbytes / default_ms / 1e6:.0f} GB/s{sdpa}")
        for gbps, cfg, splits in results if args.all else results[:10]:
            print(f"  {gbps:6.0f} GB/s ({gbps / copy:.0%} of copy)  BN={cfg.block_n} warps={cfg.num_warps} "
                  f"stages={cfg.num_stages} {splits} splits ({splits * batch * nheads_k} programs)")
        k = v = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
