"""The one-launch backward (Triton dK/dV computing delta and dQ, kernels/triton/backward.py) against
the three-launch one (delta, Gluon dK/dV, dQ) at up to 128 keys, bf16, over batch sizes: GPU time per
backward (20 calls replayed from a CUDA graph) and time per call of 20 calls made eagerly (the larger
of host and GPU time), as `cuflash bench --decode` times (bench.decode.time_calls), to find where each
wins (plan.OneLaunch). Usage, on a Hopper GPU:
PYTHONPATH=src python3 scripts/short_backward.py [--tiles 64x128x8x2,32x128x4x2]"""
import argparse

import torch
import triton

from cuflash.bench.decode import time_calls
from cuflash.kernels import attention, gluon
from cuflash.kernels.plan import Entry, Length, entry
from cuflash.kernels.triton import OneLaunch, Tiles
from cuflash.params import AttentionParams


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", default="64x128x8x2", help="one-launch dK/dV tiles, block_m x block_n x warps x stages")
    p.add_argument("--seqlens", default="64,128")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    args = p.parse_args()
    print(triton.__version__, torch.cuda.get_device_name())
    tiles = [Tiles(*map(int, t.split("x"))) for t in args.tiles.split(",")]
    OneLaunch.MAX_HEADS_PER_SM = 1 << 30  # one launch at every batch size, where the table stops at 4 heads per SM
    print("D   N  causal batch  three: gpu/loop us  " + "  ".join(f"one {t.block_m}x{t.block_n}x{t.num_warps}x"
                                                                 f"{t.num_stages}: gpu/loop" for t in tiles))
    for d in (64, 128):
        h = 2048 // d
        for n in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                cell = entry(90, d, False, False, Length.UP_TO_512, causal)  # the three-launch backward
                assert isinstance(cell.dkdv[0], gluon.Dkdv)
                three = Entry(cell.forward[-1:], cell.dkdv, cell.dq)
                ones = [Entry(cell.forward[-1:], (OneLaunch(t), t), cell.dq) for t in tiles]
                for batch in map(int, args.batches.split(",")):
                    q, k, v, dout = (torch.randn(batch, n, h, d, device="cuda", dtype=torch.bfloat16)
                                     for _ in range(4))
                    out, lse = attention.attention_forward(q, k, v, params)
                    row = []
                    for e in (three, *ones):
                        graph_ms, eager_ms = time_calls([lambda e=e: attention.attention_backward(
                            dout, q, k, v, out, lse, params, e)], 20, 10, q.device)
                        row.append(f"{graph_ms * 1e3:7.1f}/{eager_ms * 1e3:7.1f}")
                    print(f"{d:3d} {n:4d} {causal!s:6s} {batch:4d}  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
