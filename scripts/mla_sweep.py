"""The Gluon kernels at (192, 128) (DeepSeek's MLA head dims) against D=128 per FLOP: each forward,
dK/dV and dQ candidate of a small sweep timed at 4k and 16k tokens (16k tokens a batch, 16 heads, bf16,
causal and not), beside the table's own plan at (192, 128) and at D=128, as TFLOP/s and as a ratio to
D=128's. For plan.py's _hopper_d192 entry. --jobs N compiles the candidates in N processes first.

    PYTHONPATH=src python scripts/mla_sweep.py --jobs 12
"""
import argparse
import dataclasses
import itertools
import subprocess
import sys

import torch
import triton

from cuflash.kernels import attention_backward, attention_forward, gluon
from cuflash.kernels.device import arch
from cuflash.kernels.plan import Length, entry
from cuflash.params import AttentionParams

FORWARDS = [gluon.Forward(2, n, s, e) for n, s, e in ((64, 3, False), (64, 3, True), (64, 4, False), (64, 4, True),
                                                      (128, 2, False))]
DKDVS = [gluon.Dkdv(stages=s) for s in (2, 3)]
DQS = [gluon.Dq(64, s) for s in (2, 3, 4)]


def cases(seqlens):
    for n, causal in itertools.product(seqlens, (False, True)):
        yield n, causal


def inputs(n, d, dv):
    b, h = max(1, 16384 // n), 16
    q, k, do = (torch.randn(b, n, h, x, dtype=torch.bfloat16, device="cuda") for x in (d, d, dv))
    v = torch.randn(b, n, h, dv, dtype=torch.bfloat16, device="cuda")
    return q, k, v, do


def runs(n, causal, kernels=("fwd", "dkdv", "dq")):
    """(name, fn, FLOPs) of every timed launch of a case: the tables' plans and the candidates of
    these kernels."""
    params = AttentionParams(192 ** -0.5, window_right=0 if causal else -1)
    out = []
    for d, dv in ((128, 128), (192, 128)):
        q, k, v, do = inputs(n, d, dv)
        cell = entry(arch(q.device), 128 if d == 128 else 256, False, False, Length.of(n), causal,
                     None if d == 128 else 128)
        o, lse = attention_forward(q, k, v, params)
        b, h = q.shape[0], q.shape[2]
        fwd_flops = 2 * b * h * n * n * (d + dv) / (2 if causal else 1)
        bwd_flops = 2 * b * h * n * n * (3 * d + 2 * dv) / (2 if causal else 1)
        tag = f"D={d}:{dv}"

        def fwd(c=cell, q=q, k=k, v=v):
            return attention_forward(q, k, v, params, c)

        def bwd(c=cell, q=q, k=k, v=v, o=o, lse=lse, do=do):
            return attention_backward(do, q, k, v, o, lse, params, c)
        out += [(f"{tag} table fwd", fwd, fwd_flops), (f"{tag} table bwd", bwd, bwd_flops)]
        if d == 128:
            continue
        for f in FORWARDS if "fwd" in kernels else ():
            out.append((f"{tag} {f}", lambda c=dataclasses.replace(cell, forward=(f,)), fwd=fwd: fwd(c), fwd_flops))
        for kv in DKDVS if "dkdv" in kernels else ():
            out.append((f"{tag} {kv}", lambda c=dataclasses.replace(cell, dkdv=(kv,)), bwd=bwd: bwd(c), bwd_flops))
        for dq in DQS if "dq" in kernels else ():
            out.append((f"{tag} {dq}", lambda c=dataclasses.replace(cell, dq=(dq,)), bwd=bwd: bwd(c), bwd_flops))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--kernels", default="fwd,dkdv,dq", help="whose candidates to time")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--warm", help=argparse.SUPPRESS)  # "part/parts": a --jobs worker compiling its share
    args = p.parse_args()
    seqlens = [int(s) for s in args.seqlens.split(",")]
    if args.warm:
        part, parts = map(int, args.warm.split("/"))
        for n, causal in cases(seqlens):
            for i, (name, fn, _) in enumerate(runs(n, causal, args.kernels)):
                if i % parts == part:
                    try:
                        fn()
                    except Exception as exc:  # (the timed run reports it)
                        print(f"  warm {name}: {type(exc).__name__}", flush=True)
        torch.cuda.synchronize()
        return
    if args.jobs > 1:
        workers = [subprocess.Popen([sys.executable, __file__, "--seqlens", args.seqlens, "--kernels", args.kernels,
                                     "--warm", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
        for w in workers:
            w.wait()
    for n, causal in cases(seqlens):
        print(f"== N={n} causal={causal}", flush=True)
        ref = {}
        for name, fn, flops in runs(n, causal, args.kernels):
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as exc:
                print(f"  {name:55s} failed: {type(exc).__name__}: {str(exc).splitlines()[-1][:120]}", flush=True)
                continue
            rate = flops / ms / 1e9
            kind = "fwd" if "fwd" in name or "Forward" in name else "bwd"
            if name.startswith("D=128"):
                ref[kind] = rate
            print(f"  {name:55s} {rate:6.1f} TFLOP/s  {rate / ref.get(kind, float('nan')):5.2f}x D=128", flush=True)


if __name__ == "__main__":
    main()
