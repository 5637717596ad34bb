"""The Gluon forward's consumers, key tile and K/V ring depth (Launch fields), against the table's
launch and the Triton forward, in one process: every variant timed twice per case
(order forward, then reversed), each a do_bench median over 4 input sets rotated through the L2;
cuDNN's forward as the anchor; outputs compared with the first variant's to 1e-2 absolute. bf16, 16k
tokens, hidden 2048.
PYTHONPATH=src python3 ab_fwd_tiles.py [D,...] [seqlens] [rounds] [causal: 0,1] [variants: table,...]"""
import dataclasses
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams

hdims = [int(d) for d in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
seqlens = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "768,1024,2048").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
causals = [bool(int(c)) for c in (sys.argv[4] if len(sys.argv) > 4 else "0,1").split(",")]
chosen = sys.argv[5].split(",") if len(sys.argv) > 5 else None

# name -> the Launch fields changed from the table's forward launch ({}: the table's own).
VARIANTS = {
    64: {"table": {}, "triton": {"gluon": False}, "g2n128": {"gluon": True, "consumers": 2, "gluon_block_n": 128, "gluon_stages": 3},
         "g2n64s4": {"gluon": True, "consumers": 2, "gluon_block_n": 64, "gluon_stages": 4},
         "g2n64s6": {"gluon": True, "consumers": 2, "gluon_block_n": 64, "gluon_stages": 6},
         "g2n64s8": {"gluon": True, "consumers": 2, "gluon_block_n": 64, "gluon_stages": 8},
         "g3n64s6": {"gluon": True, "consumers": 3, "gluon_block_n": 64, "gluon_stages": 6},
         "g3n128": {"gluon": True, "consumers": 3, "gluon_block_n": 128, "gluon_stages": 3}},
    128: {"table": {}, "triton": {"gluon": False}, "g2n128": {"gluon": True, "consumers": 2, "gluon_block_n": 128, "gluon_stages": 3},
          "g2n64s4": {"gluon": True, "consumers": 2, "gluon_block_n": 64, "gluon_stages": 4},
          "g2n64s5": {"gluon": True, "consumers": 2, "gluon_block_n": 64, "gluon_stages": 5}},
}


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


def run(change, sets, params, cfg):
    launch._plans.clear()
    cfg = dataclasses.replace(cfg, **change)
    out, _ = attention_forward(*sets[0], params, cfg)
    return out, timed(lambda *s: attention_forward(*s, params, cfg), sets)


for rnd in range(1, rounds + 1):
    for d in hdims:
        for n in seqlens:
            for causal in causals:
                b, h = max(1, 16384 // n), 2048 // d
                params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
                sets = [tuple(torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                        for _ in range(4)]
                cfg = forward_config(sets[0][0], d, n, causal)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                [tuple(t.transpose(1, 2) for t in s) for s in sets])
                names = [name for name in VARIANTS[d] if chosen is None or name in chosen]
                times = {name: [] for name in names}
                first, differs = None, []
                for name in names + names[::-1]:
                    out, ms = run(VARIANTS[d][name], sets, params, cfg)
                    if first is None:
                        first = out
                    elif not torch.allclose(out.float(), first.float(), atol=1e-2, rtol=0):
                        differs.append(name)
                    times[name].append(ms)
                rates = "  ".join(f"{name} {flops / (sum(t) / 2) / 1e9:5.1f} ({t[0]:.3f}/{t[1]:.3f})"
                                  for name, t in times.items())
                print(f"round {rnd} D={d:3d} N={n:5d} causal={causal!s:5} cudnn {flops / ref / 1e9:5.1f}  {rates}"
                      f"{'  DIFFERS: ' + ','.join(differs) if differs else ''}", flush=True)
launch._plans.clear()
