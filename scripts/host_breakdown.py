"""Where a tiny call's host time goes, piece by piece, on a GPU: the compiled kernel's C launcher
alone, Triton's runner around it, the launch plan's own work, the public functions; then cProfile's
top entries for a forward, a forward+backward step and a decode step. Usage, on a GPU:
PYTHONPATH=src python3 scripts/host_breakdown.py [OUT_DIR]"""
import cProfile
import io
import pstats
import sys
import time

import torch
import triton
from triton.runtime import driver

import cuflash
from cuflash.kernels import attention as ka
from cuflash.kernels import launch as kl
from cuflash.params import AttentionParams


def per_call_us(fn, calls=1000, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
dout = torch.randn_like(q)
p = AttentionParams(0.125, window_right=0)
out, lse = ka.attention_forward(q, k, v, p)
(full_key, plan), = kl._plans.items()
one, = plan.launches
tensors = dict(Q=q, K=k, V=v, Out=out, Lse=lse)
kernel, grid, kwargs = ka._forward(dict(tensors), p, None)
compiled = kernel[grid](**kwargs)
grid = (*grid, 1, 1)[:3]
args = one.args.copy()
for i, j in one.slots:
    args[i] = tuple(tensors.values())[j]
plans: dict = {}
ka.attention_forward(q, k, v, p, plans=plans)
ka.attention_backward(dout, q, k, v, out, lse, p, plans=plans)
device = driver.active.get_current_device()
stream = driver.active.get_current_stream(device)
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
qgt, kgt, vgt = (t.transpose(1, 2) for t in (qg, kg, vg))
FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION


def sdpa_flash():
    with torch.nn.attention.sdpa_kernel(FLASH):
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def sdpa_flash_step():
    with torch.nn.attention.sdpa_kernel(FLASH):
        out = torch.nn.functional.scaled_dot_product_attention(qgt, kgt, vgt, is_causal=True)
    torch.autograd.grad(out, (qg, kg, vg), dout.transpose(1, 2))


def cuflash_step():
    torch.autograd.grad(cuflash.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), dout)


q1, k1, v1 = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
k_pages, v_pages = (torch.randn(16, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
table = torch.arange(16, device="cuda", dtype=torch.int32)[None]
seqlens = torch.tensor([100], device="cuda", dtype=torch.int32)


def decode_paged():
    cuflash.flash_attn_with_kvcache(q1, k_pages, v_pages, k1, v1, cache_seqlens=seqlens, block_table=table,
                                    causal=True)


pieces = {
    "C launcher alone (compiled.run, stream given)": lambda: compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args),
    "Triton runner (compiled[grid](*args))": lambda: compiled[grid](*args),
    "plan launcher (compat.compiled_launcher)": lambda: one.run(*args),
    "current device + stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
    "plan step: _Launch(values)": lambda: one(tuple(tensors.values())),
    "plan signature()": lambda: kl.signature(tensors.values()),
    "params.key()": p.key,
    "out + lse allocation": lambda: (torch.empty_like(q, memory_format=torch.contiguous_format),
                                     torch.empty(p.lse_shape(q), dtype=torch.float32, device="cuda")),
    "kernels.attention_forward": lambda: ka.attention_forward(q, k, v, p),
    "kernels.attention_forward, the signature's plans": lambda: ka.attention_forward(q, k, v, p, plans=plans),
    "kernels.attention_backward, the signature's plans": lambda: ka.attention_backward(
        dout, q, k, v, out, lse, p, plans=plans),
    "flash_attn_func": lambda: cuflash.flash_attn_func(q, k, v, causal=True),
    "flash_attn_func, inputs requiring grad": lambda: cuflash.flash_attn_func(qg, kg, vg, causal=True),
    "torch SDPA flash backend": sdpa_flash,
    "flash_attn_func forward+backward": cuflash_step,
    "torch SDPA flash forward+backward": sdpa_flash_step,
    "decode step, paged": decode_paged,
}
lines = [f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
         f"{len(args)} launcher arguments"]
for name, fn in pieces.items():
    lines.append(f"{per_call_us(fn, 300 if 'backward' in name or 'decode' in name else 1000):8.2f} us  {name}")
for name in ("flash_attn_func", "flash_attn_func forward+backward", "decode step, paged"):
    fn = pieces[name]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    lines.append(f"== cProfile, 500 calls: {name}\n{text.getvalue()}")
report = "\n".join(lines)
print(report)
if len(sys.argv) > 1:
    with open(f"{sys.argv[1]}/host_breakdown.txt", "w") as f:
        f.write(report)
