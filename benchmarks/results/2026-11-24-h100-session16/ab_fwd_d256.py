"""The D=256 forward: the table's Triton launch against the Gluon forward (kernels/hopper_forward.py) with
2 consumers and (key tile, K/V buffers) = (64, 2: one Q buffer), (32, 3: two), (32, 4: one), in one
process, each timed twice per case in the order triton, gluon..., gluon... reversed, triton, each a do_bench
median over 4 input sets rotated through the L2; sdpa-cudnn and sdpa-flash on the same inputs; outputs
compared with the Triton kernel's to 1e-2 absolute. bf16, 16k tokens, hidden 2048 (8 heads).
PYTHONPATH=src python3 ab_fwd_d256.py [seqlens] [rounds]"""
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

seqlens = [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "128,256,512,1024,2048,4096,16384").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
GLUON = {"g64x2": (64, 2), "g32x3": (32, 3), "g32x4": (32, 4)}


def timed(fn, sets):
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=100, return_mode="median")


for rnd in range(1, rounds + 1):
    for n in seqlens:
        for causal in (False, True):
            b, h, d = max(1, 16384 // n), 8, 256
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            sets = [tuple(torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                    for _ in range(4)]
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            anchors = {}
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    anchors[name] = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                          [tuple(t.transpose(1, 2) for t in s) for s in sets])
            base = dataclasses.replace(forward_config(sets[0][0], d, n, causal), gluon=False)
            configs = {"triton": base, **{name: dataclasses.replace(base, gluon=True, consumers=2, gluon_block_n=bn,
                                                                     gluon_stages=st)
                                          for name, (bn, st) in GLUON.items()}}
            launch._plans.clear()
            ref, _ = attention_forward(*sets[0], params, configs["triton"])
            times = {name: [] for name in configs}
            same = {}
            order = list(configs)
            for name in order + order[::-1]:
                out, _ = attention_forward(*sets[0], params, configs[name])
                same[name] = torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=0)
                times[name].append(timed(lambda *s: attention_forward(*s, params, configs[name]), sets))
            rate = {name: flops / (sum(t) / len(t)) / 1e9 for name, t in times.items()}
            cells = "  ".join(f"{name} {r:5.1f}{'' if same[name] else '(DIFFERS)'} ({r / rate['triton'] - 1:+5.1%}, "
                              f"{r * anchors['flash'] / flops * 1e9:4.2f}x flash)" for name, r in rate.items())
            print(f"round {rnd} N={n:5d} causal={causal!s:5}  cudnn {flops / anchors['cudnn'] / 1e9:5.1f}  flash "
                  f"{flops / anchors['flash'] / 1e9:5.1f}  {cells}", flush=True)
