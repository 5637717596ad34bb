"""fp32 exactness against float64: torch's efficient kernel, cuflash with the table's backward launches
(IEEE before this change) and with tf32x3 in both backward kernels. From the repository root:
PYTHONPATH=src python3 benchmarks/results/2026-11-22-h200-fp32/fp32_err.py"""
import dataclasses
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from cuflash.kernels import attention_backward, attention_forward
from cuflash.kernels.config import backward_configs
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

def err(x, ref):
    n = ref.norm().item(); d = (x.double() - ref).norm().item()
    return d / n if n > 0 else d

def run(name, B, Nq, Nk, H, Hk, D, causal, qscale=1.0):
    torch.manual_seed(Nq * 1000 + D)
    q = torch.randn(B, Nq, H, D, device="cuda") * qscale
    k, v = (torch.randn(B, Nk, Hk, D, device="cuda") for _ in range(2))
    do = torch.randn(B, Nq, H, D, device="cuda")
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, causal=causal)
    ref.backward(do.double())
    refs = (ref.detach(), qd.grad, kd.grad, vd.grad)
    rows = {}
    if (Nq == Nk or not causal) and H == Hk:
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != Hk)
            o.backward(do.transpose(1, 2))
        rows["torch-efficient"] = (o.transpose(1, 2), qt.grad.transpose(1, 2), kt.grad.transpose(1, 2), vt.grad.transpose(1, 2))
    params = AttentionParams(D ** -0.5, window_right=0 if causal else -1)
    out, lse = attention_forward(q, k, v, params)
    dkdv, dq = backward_configs(q, D, max(Nq, Nk), causal)
    rows["cuflash-table"] = (out,) + attention_backward(do, q, k, v, out, lse, params, (dkdv, dq))
    x3 = tuple(dataclasses.replace(c, input_precision="tf32x3") for c in (dkdv, dq))
    rows["cuflash-tf32x3"] = (out,) + attention_backward(do, q, k, v, out, lse, params, x3)
    print(f"== {name}: B={B} Nq={Nq} Nk={Nk} H={H}/{Hk} D={D} causal={causal} qscale={qscale}"
          f"  (ref zero: {[n for n, r in zip(('out','dq','dk','dv'), refs) if not r.any()]})")
    for k_, vals in rows.items():
        print(f"  {k_:15s} " + "  ".join(f"{n} {err(a, r):.2e}" for n, a, r in zip(("out", "dq", "dk", "dv"), vals, refs)))

run("test seqlen 1", 2, 1, 1, 4, 4, 128, False)
run("test seqlen 1", 2, 1, 1, 4, 4, 64, True)
run("larger seqlen 1", 8, 1, 1, 16, 16, 128, False)
run("seqlen 17", 2, 17, 17, 4, 4, 64, True)
run("seqlen 1000", 1, 1000, 1000, 2, 2, 128, True)
run("seqlen 4096", 1, 4096, 4096, 2, 2, 64, False)
run("gqa 1 x 1000", 2, 1, 1000, 8, 2, 64, False)
run("peaked", 1, 1000, 1000, 4, 4, 128, False, qscale=6.0)
run("peaked", 1, 2048, 2048, 4, 4, 64, True, qscale=6.0)
