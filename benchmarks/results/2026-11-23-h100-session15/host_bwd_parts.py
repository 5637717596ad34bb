"""Where the host's time goes in the backward step that `cuflash bench` times (torch.autograd.grad
through cuflash.scaled_dot_product_attention; D=128, 512 keys, 16k tokens, bf16): host time per call
(no synchronization but every 8 calls; medians of 200, three rounds) of
- sdpa-cudnn: the same step through torch's cuDNN attention (the anchor);
- cuflash-sdpa: the step as the bench runs it ((B, H, N, D) inputs, views to (B, N, H, D));
- cuflash-flash: the same through flash_attn_func on (B, N, H, D) leaves (no views);
- identity-fn: a Python autograd.Function on the same (B, N, H, D) leaves whose backward returns
  its gradient three times (the engine with a Python node, no kernel of ours);
- stub-bwd: cuflash-flash with kernels.attention_backward replaced by three empty_like (our Function's
  Python around the kernels);
- kernels-bwd: kernels.attention_backward alone.
PYTHONPATH=src python3 host_bwd_parts.py"""
import statistics
import time

import torch

import cuflash
from cuflash import kernels
from cuflash.kernels import attention_backward, attention_forward
from cuflash.params import AttentionParams

B, H, N, D = 32, 16, 512, 128
dev = torch.device("cuda")


def leaves(shape):
    return [[torch.randn(shape, dtype=torch.bfloat16, device=dev, requires_grad=i < 3) for i in range(4)]
            for _ in range(4)]


def grad_step(fn, sets):
    outs = [fn(*s[:3]) for s in sets]
    return lambda i: torch.autograd.grad(outs[i % 4], sets[i % 4][:3], sets[i % 4][3], retain_graph=True)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.detach().clone()

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return g, g, g


def host_us(fn, calls=200):
    for i in range(20):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e6)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times)


bhnd, bnhd = leaves((B, H, N, D)), leaves((B, N, H, D))
steps = {}
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
    steps["sdpa-cudnn"] = grad_step(torch.nn.functional.scaled_dot_product_attention, bhnd)
steps["cuflash-sdpa"] = grad_step(cuflash.scaled_dot_product_attention, bhnd)
steps["cuflash-flash"] = grad_step(cuflash.flash_attn_func, bnhd)
steps["identity-fn"] = grad_step(Identity.apply, bnhd)
q, k, v, do = (t.detach() for t in bnhd[0])
params = AttentionParams(D ** -0.5)
out, lse = attention_forward(q, k, v, params)
steps["kernels-bwd"] = lambda i: attention_backward(do, q, k, v, out, lse, params)
real = kernels.attention_backward
stub_outs = [cuflash.flash_attn_func(*s[:3]) for s in bnhd]


def stub_step(i):
    return torch.autograd.grad(stub_outs[i % 4], bnhd[i % 4][:3], bnhd[i % 4][3], retain_graph=True)


for rnd in range(3):
    row = {name: host_us(fn) for name, fn in steps.items()}
    kernels.attention_backward = lambda dout, q, k, v, *a: tuple(torch.empty_like(t) for t in (q, k, v))
    row["stub-bwd"] = host_us(stub_step)
    kernels.attention_backward = real
    print(f"round {rnd}: " + ", ".join(f"{name} {us:.1f}" for name, us in row.items()) + " (us, host, median)",
          flush=True)
