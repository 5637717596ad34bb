"""Decode benchmark (`cuflash bench --decode`, also `python -m cuflash.bench.decode`): a few query
tokens attending to a long KV cache, which is bound by memory bandwidth. Each row: time, achieved
bandwidth (bytes of the cached K and V read over time), its fraction of the device's copy
bandwidth measured in the same run, and the ratio to the best of torch SDPA's backends on the same
problem (a contiguous cache; GQA through enable_gqa, or K/V expanded where a backend refuses it).
cuflash runs causal (bottom-right: every query sees the whole cache but the keys after it); SDPA
cannot align causal to the bottom-right without a mask, so it runs non-causal, which reads the
same bytes.

On a GPU each provider is timed as a serving engine runs a decode step: captured in a CUDA graph
and replayed ("ms"), so that the time is the device's, not Python's; "eager_ms" is the same calls
made from Python. A graph holds enough calls to read at least GRAPH_BYTES (replaying a graph costs
the host ~25 us, which would otherwise be timed instead of the device), and caches smaller than
twice the L2 are rotated through several copies, so that the L2 does not flatter them.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings

import torch
import torch.nn.functional as F

import cuflash

from ..commandline import CommandError, Parser, Progress, integer, integers, names, out_folder, run_guarded
from ..dtypes import DTYPES, dtype_name
from ..validate import MAX_HEAD_DIM
from .harness import SDPA_BACKENDS, median_ms, write_csv

GRAPH_BYTES = 2**30


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """GB/s of a device-to-device copy (bytes read + written over time)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), iters, 3, device)
    return 2 * nbytes / ms / 1e6


def sdpa_call(name: str, q, k, v):
    """A call of SDPA on (B, H, Sq, D) q and (B, Hk, N, D) k, v under backend `name`, GQA through
    enable_gqa; a backend that refuses it gets K/V expanded to every query head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPA_BACKENDS[name]

    def call(k, v, gqa):
        with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    try:
        with warnings.catch_warnings():  # backends that refuse enable_gqa warn before they raise
            warnings.simplefilter("ignore")
            call(k, v, group > 1)
        return lambda: call(k, v, group > 1)
    except RuntimeError:
        if group == 1:
            raise
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    call(k, v, False)
    return lambda: call(k, v, False)


def time_calls(calls, per_step: int, iters: int, device: torch.device) -> tuple[float, float | None]:
    """(ms per call replayed from a CUDA graph of per_step calls cycling through `calls`, ms per call
    made eagerly); on the CPU (eager, None)."""
    def step(_):
        for i in range(per_step):
            calls[i % len(calls)]()
    with torch.no_grad():
        eager = median_ms(step, iters, 3, device) / per_step
        if device.type != "cuda":
            return eager, None
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            step(0)
        torch.cuda.current_stream().wait_stream(stream)
        replay = median_ms(lambda i: graph.replay(), iters, 3, device) / per_step
    return replay, eager


def run_case(batch, seqlen_q, cache_len, layout, nheads, nheads_k, head_dim, dtype, device, providers, iters):
    """Rows for one problem: cuflash on the given layout, the SDPA backends on a contiguous cache."""
    device = torch.device(device)
    kv_bytes = 2 * batch * cache_len * nheads_k * head_dim * dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    copies = min(16, max(1, math.ceil(2 * l2 / kv_bytes)))
    calls_per_graph = min(64, max(copies, math.ceil(GRAPH_BYTES / kv_bytes))) if device.type == "cuda" else 1
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    base = {"batch": batch, "seqlen_q": seqlen_q, "cache_len": cache_len, "layout": layout, "nheads": nheads,
            "nheads_k": nheads_k, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
            "kv_mb": kv_bytes / 1e6, "copies": copies, "calls_per_graph": calls_per_graph}
    rows = []
    for provider in providers:
        row = {"provider": provider, **base}
        try:
            calls = []
            for _ in range(copies):
                if layout.startswith("paged"):
                    page = int(layout[5:])
                    blocks = batch * cache_len // page
                    k_cache = torch.randn(blocks, page, nheads_k, head_dim, dtype=dtype, device=device)
                    table = torch.randperm(blocks, device=device).view(batch, -1).int()  # pages scattered
                else:
                    k_cache = torch.randn(batch, cache_len, nheads_k, head_dim, dtype=dtype, device=device)
                    table = None
                v_cache = torch.randn_like(k_cache)
                if provider == "cuflash":
                    calls.append(lambda kc=k_cache, vc=v_cache, t=table: cuflash.flash_attn_with_kvcache(
                        q, kc, vc, cache_seqlens=cache_len, block_table=t, causal=True))
                else:
                    calls.append(sdpa_call(provider, q.transpose(1, 2), k_cache.transpose(1, 2),
                                           v_cache.transpose(1, 2)))
            ms, eager_ms = time_calls(calls, calls_per_graph, iters, device)
            rows.append({**row, "ms": ms, "eager_ms": eager_ms, "gbps": kv_bytes / ms / 1e6, "note": ""})
        except Exception as exc:  # a backend that refuses the case (or runs out of memory) says why
            rows.append({**row, "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"})
        calls = k_cache = v_cache = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def layouts(text: str) -> list[str]:
    """An argparse type: cache layouts, contiguous or paged<page size>, separated by commas."""
    items = text.split(",")
    for item in items:
        if item != "contiguous" and not (item.startswith("paged") and item[5:].isdigit() and int(item[5:]) >= 1):
            raise argparse.ArgumentTypeError(f"{item!r} is not a layout; accepted: contiguous, paged<page size> "
                                             f"(paged256, paged16, ...), separated by commas")
    return items


def main(argv=None, prog: str = "python -m cuflash.bench.decode") -> int:
    p = Parser(prog=prog, description=__doc__)
    p.add_argument("--providers", type=names(("cuflash",) + tuple(SDPA_BACKENDS)),
                   default="cuflash,sdpa-cudnn,sdpa-flash,sdpa-efficient")
    p.add_argument("--quick", action="store_true", help="batch 1,8; cache 4k,32k; seqlen_q 1; contiguous, paged256")
    p.add_argument("--batches", type=integers(1), default=None, help="(default: 1,8,64)")
    p.add_argument("--cache-lens", type=integers(1), default=None, help="(default: 4096,32768,131072)")
    p.add_argument("--seqlen-q", type=integers(1), default=None, help="(default: 1,4)")
    p.add_argument("--layouts", type=layouts, default=None,
                   help="contiguous, paged<page size> (default: contiguous,paged256,paged16)")
    p.add_argument("--nheads", type=integer(1), default=32)
    p.add_argument("--nheads-k", type=integer(1), default=8)
    p.add_argument("--head-dim", type=integer(1, MAX_HEAD_DIM), default=128)
    p.add_argument("--dtype", default="bf16", type=dtype_name, help="fp16, bf16 or fp32")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=integer(1), default=30)
    p.add_argument("--out", type=out_folder, default=None, help="folder for decode.csv and decode.md")
    args = p.parse_args(argv)
    if args.nheads % args.nheads_k:
        p.error(f"argument --nheads-k: {args.nheads_k} does not divide --nheads {args.nheads}")
    defaults: tuple[list, list, list, list] = (
        ([1, 8], [4096, 32768], [1], ["contiguous", "paged256"]) if args.quick else
        ([1, 8, 64], [4096, 32768, 131072], [1, 4], ["contiguous", "paged256", "paged16"]))
    batches, cache_lens = args.batches or defaults[0], args.cache_lens or defaults[1]
    seqlens_q, layout_names = args.seqlen_q or defaults[2], args.layouts or defaults[3]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda, but torch sees no CUDA GPU here (use --device cpu to time the CPU path)")
    device = torch.device(args.device)
    copy_gbps = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**26, args.iters)
    rows = []
    cases = [(b, sq, n, layout) for b in batches for sq in seqlens_q for n in cache_lens for layout in layout_names]
    with Progress(after_s=0) as progress:
        for i, (b, sq, n, layout) in enumerate(cases):
            progress(f"[{i + 1}/{len(cases)}] batch {b} seqlen_q {sq} cache {n} {layout}")
            providers = args.providers if layout == "contiguous" else ["cuflash"]
            rows += run_case(b, sq, n, layout, args.nheads, args.nheads_k, args.head_dim, DTYPES[args.dtype],
                             device, providers, args.iters)
            if args.out:  # (after every case: a sweep cut short keeps what it measured)
                write_csv(rows, args.out / "decode.csv")
    lines = [f"decode on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}: copy bandwidth "
             f"{copy_gbps:.0f} GB/s (read + written)", "",
             "| batch | seqlen_q | cache | layout | KV MB | cuflash ms | eager ms | GB/s | of copy | best SDPA | "
             "vs best SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, sq, n, layout in cases:
        mine = [r for r in rows if (r["batch"], r["seqlen_q"], r["cache_len"]) == (b, sq, n)]
        ours: dict = next((r for r in mine if r["provider"] == "cuflash" and r["layout"] == layout), {})
        sdpa = [r for r in mine if r["provider"] != "cuflash" and r.get("ms")]
        best = min(sdpa, key=lambda r: r["ms"]) if sdpa else None
        if not ours.get("ms"):
            lines.append(f"| {b} | {sq} | {n} | {layout} | | {ours.get('note', 'n/a')} | | | | | |")
            continue
        best_cell = f"{best['provider']} {best['ms']:.3f} ms" if best else "n/a"
        ratio_cell = f"{best['ms'] / ours['ms']:.2f}x" if best else "n/a"
        eager = f"{ours['eager_ms']:.3f}" if ours.get("eager_ms") else ""
        lines.append(f"| {b} | {sq} | {n} | {layout} | {ours['kv_mb']:.0f} | {ours['ms']:.3f} | {eager} | "
                     f"{ours['gbps']:.0f} | "
                     f"{ours['gbps'] / copy_gbps:.0%} | {best_cell} | {ratio_cell} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        (args.out / "decode.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded("python -m cuflash.bench.decode", main))
