"""Whole backward with dQ / dK/dV kernel variants, one process, beside cuDNN."""
import argparse, dataclasses, sys
sys.path.insert(0, "scripts")
import torch
from tune import cases, bench, _sdpa_ms
from cuflash.kernels import attention_backward, attention_forward, backward, launch
from cuflash.kernels import hopper_backward as new, _hb_base as base
from cuflash.kernels.config import backward_configs

def patched(module, dq=None, dkdv=None):
    class M:  # the module with launch keyword arguments overridden
        accepts = staticmethod(module.accepts)
        @staticmethod
        def dq_launch(*a):
            k, g, kw = module.dq_launch(*a); kw.update(dq or {}); return k, g, kw
        @staticmethod
        def dkdv_launch(*a):
            k, g, kw = module.dkdv_launch(*a); kw.update(dkdv or {}); return k, g, kw
    return M

VARIANTS = {
    "base": (base, {}, {}, None),
    "lse-smem": (new, {}, {}, None),
    "base again": (base, {}, {}, None),
    "lse-smem again": (new, {}, {}, None),
}
p = argparse.ArgumentParser()
p.add_argument("--seqlen", default="1024,4096,16384")
p.add_argument("--hdims", default="128,64")
args = p.parse_args()
for n, d, causal, b, h, q, k, v, do, flops, params in cases(args, torch.bfloat16):
    _, anchor_bwd = _sdpa_ms(q, k, v, do, causal)
    out, lse = attention_forward(q, k, v, params)
    dkdv0, dq0 = backward_configs(q, d, n, causal)
    print(f"D={d:3d} N={n:5d} causal={causal!s:5}  cudnn {2.5 * flops / anchor_bwd / 1e9:6.1f} TFLOP/s", flush=True)
    for name, (module, dq_kw, dkdv_kw, gluon_dq) in VARIANTS.items():
        backward.hopper_backward = patched(module, dq_kw, dkdv_kw)
        launch._plans.clear()
        configs = (dkdv0, dq0 if gluon_dq is None else dataclasses.replace(dq0, gluon=gluon_dq))
        ms = bench(lambda: attention_backward(do, q, k, v, out, lse, params, configs))
        print(f"  {name:22s} {ms:7.3f} ms {2.5 * flops / ms / 1e9:6.1f} TFLOP/s {anchor_bwd / ms:5.2f}x", flush=True)
