"""The long-key backward, kernel by kernel: one causal sequence (B=1, bf16, --dim) at each length and
count of query and KV heads; cuflash's backward with the table's plan, with dQ fused into the Gluon
dK/dV kernel and unfused (the Gluon dQ pass after it), beside cuDNN's: TFLOP/s of each, the
milliseconds of each kernel in a profiled call, and how far the fused and unfused gradients differ.
For the backward's cliff between 128k and 256k keys (docs/tuning.md).

    PYTHONPATH=src python scripts/long_keys.py --cases 16x16x131072,16x16x262144,32x8x131072,32x8x262144
"""
import argparse
import contextlib
import dataclasses
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.kernels import attention_backward, attention_forward, gluon, plan
from cuflash.kernels.device import arch
from cuflash.kernels.plan import Length, entry
from cuflash.params import AttentionParams


def timed(fn, reps: int) -> float:
    """Median ms of reps calls after one warm-up, CUDA events around each."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn) -> dict[str, float]:
    """Milliseconds of each CUDA kernel in one profiled call of fn."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:40]] = out.get(e.name[:40], 0.0) + e.device_time_total / 1e3
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="16x16x131072,16x16x262144,32x8x262144",
                   help="HEADSxKV_HEADSxKEYS, comma-separated")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    for case in args.cases.split(","):
        print(one_case(*map(int, case.split("x")), args.dim, args.reps), flush=True)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def fused_at_any_size():
    """dQ fused whatever the call's size: plan.select's bound for GQA (FUSED_DQ_MAX_PAIRS) lifted."""
    bound = plan.FUSED_DQ_MAX_PAIRS
    plan.FUSED_DQ_MAX_PAIRS = float("inf")
    try:
        yield
    finally:
        plan.FUSED_DQ_MAX_PAIRS = bound


def one_case(heads: int, heads_k: int, n: int, dim: int, reps: int) -> str:
    q, k, v, do = (torch.randn(1, n, h, dim, dtype=torch.bfloat16, device="cuda")
                   for h in (heads, heads_k, heads_k, heads))
    params = AttentionParams(dim ** -0.5, window_right=0)
    cell = entry(arch(q.device), dim, False, False, Length.of(n), True)
    fused = dataclasses.replace(cell, dkdv=(gluon.Dkdv(fuse_dq=True),), dq=(gluon.Dq(),))
    unfused = dataclasses.replace(cell, dkdv=(gluon.Dkdv(),), dq=(gluon.Dq(),))
    out, lse = attention_forward(q, k, v, params)
    flops = 2 * 2 * heads * n * n * dim / 2  # the forward's (causal); the backward does 2.5 times as many
    fwd = timed(lambda: attention_forward(q, k, v, params), reps)
    # the two backwards' gradients against each other (both bf16 sums of fp32 products)
    with fused_at_any_size():
        fused_grads = attention_backward(do, q, k, v, out, lse, params, fused)
    differ = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in
                 zip(fused_grads, attention_backward(do, q, k, v, out, lse, params, unfused)))
    del fused_grads
    row = [f"D={dim} H={heads:2d}/{heads_k:2d} N={n // 1024:4d}k  fwd {flops / fwd / 1e9:5.0f}"]
    for name, entry_, scope in (("bwd (table)", None, contextlib.nullcontext), ("fused", fused, fused_at_any_size),
                                ("unfused", unfused, contextlib.nullcontext)):
        def run(entry_=entry_, scope=scope):
            with scope():
                return attention_backward(do, q, k, v, out, lse, params, entry_)
        ms = timed(run, reps)
        parts = ", ".join(f"{kname} {kms:.0f}" for kname, kms in kernel_ms(run).items())
        row.append(f"{name} {2.5 * flops / ms / 1e9:5.0f} ({parts} ms)")
    # cuDNN on K/V repeated to every query head (torch's cuDNN backend takes no GQA)
    k, v = (t.repeat_interleave(heads // heads_k, dim=2) for t in (k, v))
    qt, kt, vt, dot = (t.transpose(1, 2).detach().requires_grad_(t is not do) for t in (q, k, v, do))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        ms = timed(lambda: torch.autograd.grad(ref, (qt, kt, vt), dot, retain_graph=True), reps)
    row.append(f"cuDNN bwd {2.5 * flops / ms / 1e9:5.0f} TFLOP/s  (fused vs unfused gradients {differ:.1e})")
    return "  ".join(row)

if __name__ == "__main__":
    main()
