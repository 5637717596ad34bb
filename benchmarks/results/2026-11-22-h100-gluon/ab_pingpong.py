"""A/B: Triton forward vs Gluon forward without / with ping-pong turns, beside cuDNN, one process."""
import sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from cuflash.kernels import hopper_forward as hf
from cuflash.kernels.config import Launch
from cuflash.kernels.forward import attention_forward
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

def gluon(q, k, v, params, pingpong):
    out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
    kernel, grid, kw = hf.launch_args(dict(Q=q, K=k, V=v, Out=out, Lse=lse), problem(q, k, v, params), params)
    kw["PINGPONG"] = pingpong
    kernel[grid](**kw)
    return out

torch.manual_seed(0)
# correctness of the ping-pong variant first
for d in (64, 128):
    for causal in (False, True):
        for nq, nk in ((1025, 1025), (600, 3000), (3000, 600)):
            q = torch.randn(2, nq, 8, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, nk, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            ref, _ = attention_reference(q, k, v, causal=causal)
            for pp in (False, True):
                o = gluon(q, k, v, params, pp)
                e = ((o.double() - ref).norm() / ref.norm()).item()
                print(f"check D={d} causal={causal} {nq}x{nk} pingpong={pp}: err {e:.2e} {'ok' if e < 5e-3 else 'BAD'}", flush=True)
for d in map(int, sys.argv[1].split(",")):
    h = 2048 // d
    for causal in (False, True):
        for n in (1024, 2048, 4096, 8192, 16384):
            b = 16384 // n
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                row["cudnn"] = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), rep=200)
            tri = Launch(128, 64, 8, 3) if (d == 128 or not causal) else Launch(128, 64, 4, 3, tma=True)
            row["triton"] = triton.testing.do_bench(lambda: attention_forward(q, k, v, params, tri), rep=200)
            row["gluon"] = triton.testing.do_bench(lambda: gluon(q, k, v, params, False), rep=200)
            row["pingpong"] = triton.testing.do_bench(lambda: gluon(q, k, v, params, True), rep=200)
            tf = {name: flops / ms / 1e9 for name, ms in row.items()}
            print(f"D={d} causal={causal:d} N={n:5d} " + "  ".join(f"{name} {t:6.1f} ({t / tf['cudnn']:.2f}x)" for name, t in tf.items()), flush=True)
