"""Sweeps launch configurations of the kernels on the GPU at hand and prints the fastest per
case, to fill the table in src/cuflash/kernels/plan.py. Run from the source tree:
PYTHONPATH=src python3 scripts/tune.py [--seqlen 4096[,...]] [--dtype bf16] [--jobs 8]
[--table | --loads plain,tma | --loads ws | --loads triton,gluon [--kernels fwd,dkdv,dq]]
--jobs N compiles the sweep's candidates in N processes first (one launch each, sharing Triton's cache),
then times them one at a time: at head dim 512 a candidate compiles for tens of seconds."""
import argparse
import dataclasses
import itertools
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_backward, attention_forward, gluon
from cuflash.kernels.device import arch, tf32
from cuflash.kernels.plan import Entry, Length, entry
from cuflash.kernels.triton import Tiles
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference


def _launches(*specs, **fields):
    return [Tiles(*c, **fields) for c in specs]


def _cell(q, d, n, causal) -> Entry:
    """The table's entry for the case."""
    return entry(arch(q.device), d, q.dtype == torch.float32, tf32(q), Length.of(n), causal)


def _only(cell: Entry, **passes) -> Entry:
    """The cell with these passes' candidates replaced by one configuration each."""
    return dataclasses.replace(cell, **{name: (cfg,) for name, cfg in passes.items()})


# Candidates (forward, dK/dV, dQ) per kind of input: 16-bit up to D=128, 16-bit D=256, fp32.
CANDIDATES = {
    "16-bit": (_launches((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
                         (128, 64, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2),
                         (128, 32, 4, 2), (64, 32, 4, 2)),
               _launches((32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3),
                         (128, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3)),
               _launches((128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2),
                         (128, 128, 8, 2), (128, 64, 8, 3))),
    # (the forward's one-stage and 64-row launches leave room for two programs an SM: short sequences)
    "d256": (_launches((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2),
                       (128, 32, 8, 3), (64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 4, 1), (64, 32, 4, 1),
                       (64, 32, 4, 2), (128, 32, 8, 1), (128, 64, 8, 1), (64, 32, 8, 2), (32, 64, 4, 2))
             + _launches((128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3), (64, 64, 4, 1), (128, 64, 8, 1),
                         tma=True),
             _launches((32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 1), (32, 64, 4, 3),
                       (64, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2))
             + _launches((64, 64, 8, 2), (32, 64, 4, 2), tma=True),
             _launches((64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2),
                       (128, 32, 8, 3), (64, 32, 4, 3))
             + _launches((64, 64, 8, 2), (128, 32, 8, 2), tma=True)),
    # D=512 (257-512): 64-row tiles hold a 64 x 512 fp32 output in 8 warps; two 512-column tiles a stage
    "d512": (_launches((64, 32, 8, 2), (64, 32, 8, 1), (64, 64, 8, 1), (64, 16, 4, 2), (64, 32, 4, 2),
                       (128, 32, 8, 1), (64, 16, 8, 2), (64, 16, 8, 3))
             + _launches((64, 32, 8, 2), (64, 64, 8, 1), tma=True),
             _launches((32, 32, 8, 2), (32, 32, 8, 1), (16, 32, 8, 2), (32, 64, 8, 1), (16, 64, 8, 1),
                       (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2))
             + _launches((32, 32, 8, 2), (64, 32, 8, 1), tma=True),
             _launches((64, 16, 8, 2), (64, 32, 8, 1), (64, 16, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2),
                       (32, 16, 4, 2), (64, 16, 8, 1))),
    # fp32: three TF32 tensor-core passes per dot (tf32x3); IEEE FMA dots measured 5-25x slower
    # (docs/tuning.md).
    "fp32": (_launches((128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2),
                       (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
                       (32, 16, 4, 2), input_precision="tf32x3"),
             _launches((32, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2),
                       (64, 128, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2),
                       (16, 16, 4, 2), input_precision="tf32x3"),
             _launches((32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2),
                       (64, 32, 4, 3), (128, 32, 8, 3), (32, 64, 4, 2), (32, 16, 4, 2), input_precision="tf32x3")),
}


def kind(dtype, d):
    return "fp32" if dtype == torch.float32 else "d512" if d > 256 else "d256" if d > 128 else "16-bit"


def bench(fn):
    """Median ms, or inf (with the reason printed) for a launch that does not compile or fit."""
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # out of shared memory, a compiler crash
        last = (str(exc).strip().splitlines() or [""])[-1][:200]
        print(f"  (failed: {type(exc).__name__}: {last})", flush=True)
        return float("inf")


def cases(args, dtype):
    """The papers' setting (16k tokens, hidden 2048) per seqlen, head dim and causality:
    (n, d, causal, b, h, q, k, v, do, forward FLOPs, params)."""
    for n, d, causal in itertools.product(map(int, args.seqlen.split(",")), map(int, args.hdims.split(",")),
                                          (False, True)):
        b, h = max(1, 16384 // n), 2048 // d
        q, k, v, do = (torch.randn(b, n, h, d, dtype=dtype, device="cuda") for _ in range(4))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        yield n, d, causal, b, h, q, k, v, do, flops, AttentionParams(d ** -0.5, window_right=0 if causal else -1)


def time_table(args, dtype):
    """TFLOP/s of the forward and backward with the launches the table picks, per case."""
    for n, d, causal, b, h, q, k, v, do, flops, params in cases(args, dtype):
        out, lse = attention_forward(q, k, v, params)
        fwd = bench(lambda: attention_forward(q, k, v, params))
        bwd = bench(lambda: attention_backward(do, q, k, v, out, lse, params))
        print(f"D={d:3d} N={n:5d} causal={causal!s:5}  fwd {flops / fwd / 1e9:6.1f}  bwd {2.5 * flops / bwd / 1e9:6.1f}"
              f" TFLOP/s", flush=True)


def _anchor(dtype, d=128):
    """torch's fastest SDPA backend for the dtype: cuDNN, or the efficient kernel for fp32 and (where
    cuDNN and the flash backend refuse) head dims above 256."""
    return SDPBackend.EFFICIENT_ATTENTION if dtype == torch.float32 or d > 256 else SDPBackend.CUDNN_ATTENTION


def _sdpa_ms(q, k, v, do, causal):
    """SDPA forward and backward (fwd+bwd minus fwd) of the dtype's anchor backend on the same
    data, (B, H, N, D) views."""
    backend = _anchor(q.dtype, q.shape[-1])
    q, k, v, do = (t.transpose(1, 2).detach().requires_grad_(t is not do) for t in (q, k, v, do))
    with sdpa_kernel(backend):
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        both = bench(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                 (q, k, v), do))
    return fwd, both - fwd


def time_loads(args, dtype):
    """The table's launches with each way of loading the loops' tiles (pointers, tensor
    descriptors, descriptors plus warp specialization of the unmasked loop; or the Triton kernel
    against the Gluon one for Hopper where it applies, "gluon2"/"gluon3" the Gluon forward with 2 or
    3 consumer warpgroups, "fused" the Gluon dK/dV computing dQ too: time it as dkdv), one kernel
    changed at a time, beside torch's fastest SDPA backend (_anchor) on the same inputs."""
    tiles = {"plain": {}, "tma": {"tma": True}, "ws": {"tma": True, "warp_specialize": True}}
    kernels = {"gluon": dict(forward=gluon.Forward(), dkdv=gluon.Dkdv(), dq=gluon.Dq()),
               "fused": dict(dkdv=gluon.Dkdv(fuse_dq=True)), "gluon2": dict(forward=gluon.Forward(2)),
               "gluon3": dict(forward=gluon.Forward(3))}
    passes = {"fwd": "forward", "dkdv": "dkdv", "dq": "dq"}
    for n, d, causal, b, h, q, k, v, do, flops, params in cases(args, dtype):
        anchor_fwd, anchor_bwd = _sdpa_ms(q, k, v, do, causal)
        print(f"== D={d} N={n} causal={causal}: {_anchor(dtype, d).name} fwd {flops / anchor_fwd / 1e9:6.1f}"
              f"  bwd {2.5 * flops / anchor_bwd / 1e9:6.1f} TFLOP/s", flush=True)
        cell = _cell(q, d, n, causal)
        out, lse = attention_forward(q, k, v, params)

        def changed(name, kernel):
            """The cell with one pass changed: its Triton tiles loaded another way, or one kernel forced."""
            field = passes[kernel]
            triton_tiles = getattr(cell, field)[-1]
            if name in tiles:
                return _only(cell, **{field: dataclasses.replace(triton_tiles, **tiles[name])})
            if name == "triton":
                return _only(cell, **{field: triton_tiles})
            cfg = kernels[name].get(field)
            return dataclasses.replace(cell, **{field: (cfg, triton_tiles)}) if cfg else cell

        for name in args.loads.split(","):
            runs = {"fwd": lambda: attention_forward(q, k, v, params, changed(name, "fwd")),
                    "dkdv": lambda: attention_backward(do, q, k, v, out, lse, params, changed(name, "dkdv")),
                    "dq": lambda: attention_backward(do, q, k, v, out, lse, params, changed(name, "dq"))}
            for kernel, fn in runs.items():
                if kernel not in args.kernels.split(","):
                    continue
                ms = bench(fn)  # inf, with the reason printed, where warp specialization does not compile
                mult, ref = (1.0, anchor_fwd) if kernel == "fwd" else (2.5, anchor_bwd)
                print(f"  {name:5s} {kernel:4s} {ms:7.3f} ms  {mult * flops / ms / 1e9:6.1f} TFLOP/s"
                      f"  {ref / ms:5.2f}x anchor{'' if kernel == 'fwd' else ' (whole backward)'}", flush=True)


def warm(args, dtype, part: int, parts: int):
    """Compiles every `parts`-th candidate of the sweep from the `part`-th (one launch each, untimed)."""
    for n, d, causal, b, h, q, k, v, do, flops, params in cases(args, dtype):
        cell = _cell(q, d, n, causal)
        out, lse = attention_forward(q, k, v, params)
        fwd_list, dkdv_list, dq_list = CANDIDATES[kind(dtype, d)]
        runs = [lambda c=c: attention_forward(q, k, v, params, _only(cell, forward=c)) for c in fwd_list]
        runs += [lambda c=c: attention_backward(do, q, k, v, out, lse, params, _only(cell, dkdv=c, dq=dq_list[0]))
                 for c in dkdv_list]
        runs += [lambda c=c: attention_backward(do, q, k, v, out, lse, params, _only(cell, dkdv=dkdv_list[0], dq=c))
                 for c in dq_list]
        for run in runs[part::parts]:
            try:
                run()
            except Exception:  # (the timed sweep reports it)
                pass
    torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", default="4096", help="one or more, comma-separated")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--table", action="store_true", help="only time the table's own launches (to compare trees)")
    p.add_argument("--loads", help="time the table's launches with these tile loads: plain, tma, ws; or the "
                                   "kernels: triton, gluon, gluon2, gluon3, fused")
    p.add_argument("--kernels", default="fwd,dkdv,dq", help="which kernels to time (sweep and --loads)")
    p.add_argument("--jobs", type=int, default=1, help="compile the sweep's candidates in this many processes first")
    p.add_argument("--warm", help=argparse.SUPPRESS)  # "part/parts": a --jobs worker
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.warm:
        return warm(args, dtype, *map(int, args.warm.split("/")))
    if args.jobs > 1 and not (args.table or args.loads):
        argv = [a for a in sys.argv[1:] if not a.startswith("--jobs") and a != str(args.jobs)]
        workers = [subprocess.Popen([sys.executable, __file__, *argv, "--warm", f"{i}/{args.jobs}"])
                   for i in range(args.jobs)]
        for w in workers:
            w.wait()
    if args.table:
        return time_table(args, dtype)
    if args.loads:
        return time_loads(args, dtype)
    for n, d, causal, b, h, q, k, v, do, flops, params in cases(args, dtype):
        fwd_list, dkdv_list, dq_list = CANDIDATES[kind(dtype, d)]
        cell = _cell(q, d, n, causal)
        fwd0, dkdv0, dq0 = cell.forward[-1], cell.dkdv[-1], cell.dq[-1]  # the table's Triton tiles
        out, lse = attention_forward(q, k, v, params)
        wanted = args.kernels.split(",")
        fwd = {c: bench(lambda: attention_forward(q, k, v, params, _only(cell, forward=c))) for c in [fwd0] + fwd_list
               if "fwd" in wanted}
        dq_partner = dq_list[0]  # the dK/dV sweep runs beside the first dQ candidate
        dkdv = {c: bench(lambda: attention_backward(do, q, k, v, out, lse, params, _only(cell, dkdv=c, dq=dq_partner)))
                for c in [dkdv0] + dkdv_list if "dkdv" in wanted}
        best_dkdv = min(dkdv, key=dkdv.get) if dkdv else dkdv0
        dq = {c: bench(lambda: attention_backward(do, q, k, v, out, lse, params, _only(cell, dkdv=best_dkdv, dq=c)))
              for c in [dq0] + dq_list if "dq" in wanted}
        anchor_fwd, anchor_bwd = _sdpa_ms(q, k, v, do, causal)
        print(f"\n== D={d} causal={causal} N={n} B={b} H={h} {args.dtype} (table: {fwd0} / {dkdv0} / {dq0})"
              f"\n  {_anchor(dtype, d).name}: fwd {flops / anchor_fwd / 1e9:6.1f}"
              f"  bwd {2.5 * flops / anchor_bwd / 1e9:6.1f} TFLOP/s")
        for name, res, mult in (("fwd", fwd, 1.0), ("bwd dkdv sweep", dkdv, 2.5), ("bwd dq sweep", dq, 2.5)):
            for c, ms in sorted(res.items(), key=lambda kv: kv[1]):
                err = "" if ms == float("inf") else f"  err {_error(c, name, dtype, d, causal):.1e}"
                print(f"  {name:15s} BM={c.block_m:3d} BN={c.block_n:3d} warps={c.num_warps} stages={c.num_stages}"
                      f" {c.input_precision:6s} tma={c.tma:d}  {ms:7.3f} ms"
                      f"  {mult * flops / ms / 1e9:6.1f} TFLOP/s{err}",
                      flush=True)


def _error(cfg, name, dtype, d, causal):
    """Largest relative error (out, or the gradients of a backward sweep) of a launch against the
    float64 oracle on a 1k problem, the other kernels with the table's launches (nan where they fail)."""
    try:
        return _error_of(cfg, name, dtype, d, causal)
    except Exception as exc:  # the table's own launch not fitting (while its cell is being tuned)
        print(f"  (error not computed: {type(exc).__name__})")
        return float("nan")


def _error_of(cfg, name, dtype, d, causal):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 1024, 4, d, dtype=dtype, device="cuda") for _ in range(4))
    params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
    cell = _cell(q, d, 1024, causal)
    out, lse = attention_forward(q, k, v, params, _only(cell, forward=cfg) if name == "fwd" else cell)
    grads = attention_backward(do, q, k, v, out, lse, params, _only(cell, dkdv=cfg) if "dkdv" in name
                               else _only(cell, dq=cfg) if "dq" in name else cell)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, causal=causal)
    ref.backward(do.double())
    pairs = [(out, ref)] if name == "fwd" else list(zip(grads, (qd.grad, kd.grad, vd.grad)))
    return max(((a.double() - b).norm() / b.norm()).item() for a, b in pairs)


if __name__ == "__main__":
    main()
