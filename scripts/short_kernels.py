"""GPU time per forward call at short sequences (16k tokens, hidden 2048, bf16), host time
excluded: 20 calls captured in one CUDA graph, fastest of 5 rounds of 5 replays, for cuflash's SDPA
and torch SDPA's flash and cuDNN backends (graph_us: also scripts/decode_options.py's). Usage, on a GPU:
PYTHONPATH=src python3 scripts/short_kernels.py"""
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash


def graph_us(fn, calls=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / (5 * calls))
    return best


def main():
    print(triton.__version__, torch.cuda.get_device_name())
    print("D   N   causal  cuflash  flash  cudnn  (us per forward, GPU only)")
    for d in (64, 128):
        for n in (128, 256, 512):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                row = [graph_us(lambda: cuflash.scaled_dot_product_attention(q, k, v, is_causal=causal))]
                for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    def f():
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    row.append(graph_us(f))
                print(f"{d:3d} {n:4d} {causal!s:6s} " + " ".join(f"{x:7.1f}" for x in row))


if __name__ == "__main__":
    main()
