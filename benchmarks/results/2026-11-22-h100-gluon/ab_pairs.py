"""A/B: Triton forward, Gluon forward as committed (round-robin persistent non-causal, one program
per item causal) and Gluon with paired work items (persistent everywhere), beside cuDNN."""
import sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from cuflash.kernels import hopper_forward as hf, _hf_rr as rr
from cuflash.kernels.config import Launch
from cuflash.kernels.forward import attention_forward
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

def gluon(mod, q, k, v, params):
    out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
    kernel, grid, kw = mod.launch_args(dict(Q=q, K=k, V=v, Out=out, Lse=lse), problem(q, k, v, params), params)
    kernel[grid](**kw)
    return out, lse

torch.manual_seed(0)
bad = 0
for d in (64, 128):
    for causal in (False, True):
        for b, h, hk, nq, nk in ((2, 8, 2, 1025, 1025), (1, 1, 1, 300, 300), (1, 3, 1, 600, 3000), (2, 8, 8, 3000, 600), (3, 5, 5, 1000, 1000)):
            q = torch.randn(b, nq, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, nk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
            ref, ref_lse = attention_reference(q, k, v, causal=causal)
            o, lse = gluon(hf, q, k, v, params)
            e = ((o.double() - ref).norm() / ref.norm()).item()
            fin = torch.isfinite(ref_lse)
            ok = e < 5e-3 and torch.equal(torch.isinf(lse), ~fin) and torch.allclose(lse[fin].double(), ref_lse[fin], atol=1e-3)
            bad += not ok
            print(f"check D={d} causal={causal} B={b} H={h}/{hk} {nq}x{nk}: err {e:.2e} {'ok' if ok else 'BAD'}", flush=True)
print("FAILURES", bad, flush=True)
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
            row["committed"] = triton.testing.do_bench(lambda: gluon(rr, q, k, v, params), rep=200)
            row["paired"] = triton.testing.do_bench(lambda: gluon(hf, q, k, v, params), rep=200)
            tf = {name: flops / ms / 1e9 for name, ms in row.items()}
            print(f"D={d} causal={causal:d} N={n:5d} " + "  ".join(f"{name} {t:6.1f} ({t / tf['cudnn']:.2f}x)" for name, t in tf.items()), flush=True)
