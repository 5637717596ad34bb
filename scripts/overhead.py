"""Host time per call of each layer of cuflash's forward, of one autograd step (forward and backward),
beside torch SDPA (its flash backend), and of a flash_attn_with_kvcache decode step (one token
appended, contiguous or paged cache; by default a step with index tensors waits for the GPU once to
raise a bad value at the call, deferred it does not), on problems small enough that the GPU
finishes first (so the wall time of many back-to-back calls is the host's). Usage, on a GPU:
PYTHONPATH=src python3 scripts/overhead.py (fastest of 5 interleaved rounds per layer); with --pieces,
the forward's launch path piece by piece (the compiled kernel's C launcher alone, Triton's runner, our
launcher, the plan lookup, the allocations) and cProfile's top entries of a forward, an autograd step
and a paged decode step."""
import cProfile
import io
import pstats
import sys
import time

import torch
import triton

import cuflash
from cuflash import ops
from cuflash.kernels import attention as ka
from cuflash.kernels.variant import variant_tensors
from cuflash.params import AttentionParams


def per_call_us(fn, calls=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
p = AttentionParams(0.125, window_right=0)
out, lse = ka.attention_forward(q, k, v, p)
dout = torch.randn_like(out)
(kernel, grid, kwargs), = ka.forward_launches(dict(Q=q, K=k, V=v, Out=out, Lse=lse, **variant_tensors(p)), p, None)


def _no_grad_sdpa():
    with torch.no_grad():
        return cuflash.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True)



# A decode step: one token of 8 heads (D=128) appended to a 256-position cache and attended.
q1, k1, v1 = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
k_cache, v_cache = (torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k_pages, v_pages = (torch.randn(16, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
table = torch.arange(16, device="cuda", dtype=torch.int32)[None]
seqlens = torch.tensor([100], device="cuda", dtype=torch.int32)


FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION


def _deferred(step):
    """A decode step with its index errors deferred (no wait for the GPU; cuflash.set_decode_errors)."""
    previous = cuflash.set_decode_errors("defer")
    try:
        return step()
    finally:
        cuflash.set_decode_errors(previous)


def _sdpa_flash_forward():
    with torch.nn.attention.sdpa_kernel(FLASH):
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), is_causal=True)


def _sdpa_flash_step():
    with torch.nn.attention.sdpa_kernel(FLASH):
        out = torch.nn.functional.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2),
                                                               vg.transpose(1, 2), is_causal=True)
    torch.autograd.grad(out, (qg, kg, vg), dout.transpose(1, 2))


def _sdpa_flash_decode():
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q1.transpose(1, 2), k_cache[:, :101].transpose(1, 2),
                                                                v_cache[:, :101].transpose(1, 2))


def _sdpa_flash_decode_step():
    # The step as torch code writes it: the new token into the cache (two slice copies), then attention.
    k_cache[:, 100:101] = k1
    v_cache[:, 100:101] = v1
    return _sdpa_flash_decode()


layers = {
    "Triton JIT launch (_attn_fwd[grid](**kwargs))": lambda: kernel[grid](**kwargs),
    "launcher (kernels.attention_forward: a launch plan)": lambda: ka.attention_forward(q, k, v, p),
    "backward launcher (kernels.attention_backward)":
        lambda: ka.attention_backward(dout, q, k, v, out, lse, p),
    "custom op (torch.library dispatch)": lambda: ops.attention_forward(q, k, v, *ops.op_args(p)),
    "ops.forward (eager: autograd.Function)": lambda: ops.forward(q, k, v, p),
    "ops.forward, top-left causal (SDPA's)": lambda: ops.forward(q, k, v, AttentionParams(0.125, window_right=0,
                                                                                           bottom_right=False)),
    "flash_attn_func (validation + op)": lambda: cuflash.flash_attn_func(q, k, v, causal=True),
    "flash_attn_func, inputs requiring grad": lambda: cuflash.flash_attn_func(qg, kg, vg, causal=True),
    "scaled_dot_product_attention": lambda: cuflash.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
    "scaled_dot_product_attention, no grad": lambda: _no_grad_sdpa(),
    "torch SDPA (flash backend choice)": lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
    "torch SDPA, flash backend": _sdpa_flash_forward,
    "flash_attn_func forward+backward (autograd.grad)": lambda: torch.autograd.grad(
        cuflash.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), dout),
    "torch SDPA flash backend forward+backward (autograd.grad)": _sdpa_flash_step,
    "decode step, contiguous, int cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(
        q1, k_cache, v_cache, k1, v1, cache_seqlens=100, causal=True),
    "decode step, contiguous, tensor cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(
        q1, k_cache, v_cache, k1, v1, cache_seqlens=seqlens, causal=True),
    "decode step, paged, tensor cache_seqlens": lambda: cuflash.flash_attn_with_kvcache(
        q1, k_pages, v_pages, k1, v1, cache_seqlens=seqlens, block_table=table, causal=True),
    "decode step, contiguous, tensor cache_seqlens, deferred errors": lambda: _deferred(
        lambda: cuflash.flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=seqlens, causal=True)),
    "decode step, paged, tensor cache_seqlens, deferred errors": lambda: _deferred(
        lambda: cuflash.flash_attn_with_kvcache(q1, k_pages, v_pages, k1, v1, cache_seqlens=seqlens,
                                                block_table=table, causal=True)),
    "torch SDPA flash, the decode step's attention only": _sdpa_flash_decode,
    "torch SDPA flash, a decode step (two slice copies, attention)": _sdpa_flash_decode_step,
}
PROFILED = ("flash_attn_func (validation + op)", "flash_attn_func forward+backward (autograd.grad)",
            "decode step, paged, tensor cache_seqlens")


def _pieces() -> dict:
    """The forward's launch path, piece by piece, on the signature's plans (kernels/attention.py)."""
    from triton.runtime import driver

    from cuflash.kernels import launch
    plans: dict = {}
    ka.attention_forward(q, k, v, p, plans=plans)
    ka.attention_backward(dout, q, k, v, out, lse, p, plans=plans)
    one, = next(plan for key, plan in plans.items() if key[0] == "forward").launches
    tensors = dict(Q=q, K=k, V=v, Out=out, Lse=lse)
    values = tuple(tensors.values())
    args = one.args.copy()
    for i, j in one.slots:
        args[i] = values[j]
    compiled, grid3 = kernel[grid](**kwargs), (*grid, 1, 1)[:3]
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    print(f"{len(args)} launcher arguments")
    return {
        "the C launcher alone (compiled.run, stream given)": lambda: compiled.run(
            *grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *args),
        "Triton's runner (compiled[grid](*args))": lambda: compiled[grid3](*args),
        "our launcher (compat.compiled_launcher)": lambda: one.run(*args),
        "launch()'s tensor_signature": lambda: launch.tensor_signature(values),
        "params.key()": p.key,
        "out + lse allocation": lambda: (torch.empty_like(q, memory_format=torch.contiguous_format),
                                         torch.empty(p.lse_shape(q), dtype=torch.float32, device="cuda")),
        "kernels.attention_forward, launch()'s lookup": lambda: ka.attention_forward(q, k, v, p),
        "kernels.attention_forward, the signature's plans": lambda: ka.attention_forward(q, k, v, p, plans=plans),
        "kernels.attention_backward, the signature's plans": lambda: ka.attention_backward(
            dout, q, k, v, out, lse, p, plans=plans),
        **{name: layers[name] for name in PROFILED},
    }


print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
timed = _pieces() if "--pieces" in sys.argv else layers
# Host timings drift by up to 2x within a process (clocks, other tenants): every layer is timed in
# 5 interleaved rounds and the fastest round reported.
best = {name: per_call_us(fn, 500) for name, fn in timed.items()}
for _ in range(4):
    for name, fn in timed.items():
        best[name] = min(best[name], per_call_us(fn, 500))
for name, us in best.items():
    print(f"{us:8.1f} us  {name}")
if "--pieces" in sys.argv:
    for name in PROFILED:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            layers[name]()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"== cProfile, 500 calls: {name}\n{text.getvalue()}")
