"""The compiled Triton kernels on a CUDA GPU (marker `gpu`; skipped without one)."""
import pytest
import torch

import cuflash
from attn_testing import check_against_oracle, make_qkv, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [32, 40, 64, 96, 128, 256]
SEQLENS = [1, 17, 128, 1000, 4096]


@pytest.fixture(autouse=True)
def poison_allocator():
    """Leaves NaN in the memory the caching allocator hands out next, so that any output element
    a kernel fails to write shows up as NaN (the checks reject non-finite values)."""
    if torch.cuda.is_available():
        buf = torch.full((256 * 2**20,), float("nan"), dtype=torch.float32, device="cuda")
        del buf
    yield


def _flash(causal):
    return lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal)


@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_oracle(dtype, causal, head_dim, seqlen):
    torch.manual_seed(seqlen * 1000 + head_dim)
    batch, nheads = (1, 2) if seqlen >= 1000 else (2, 4)
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1000), (17, 128), (1000, 17), (128, 4096), (4096, 1000)])
@pytest.mark.parametrize("nheads,nheads_k", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_and_unequal_seqlens(dtype, causal, nheads, nheads_k, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q + seqlen_k + nheads)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 64, dtype, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("head_dim", [40, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, head_dim):
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 300, 517, 4, 2, head_dim, dtype, "cuda", layout="bhnd")
    assert not q.is_contiguous()
    check_against_oracle(_flash(True), q, k, v, True)


def test_sdpa_interface_on_gpu():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 8, 1000, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                           is_causal=True)
    assert ((ours.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_tf32_only_when_allowed():
    """fp32 is exact IEEE by default; with allow_tf32 it runs on TF32 tensor cores, with an error
    no more than 2x that of torch's own attention computed with TF32 matmuls."""
    torch.manual_seed(1)
    q, k, v = make_qkv(1, 512, 512, 2, 2, 64, torch.float32, "cuda")
    from cuflash.reference import attention_reference
    ref, _ = attention_reference(q, k, v)
    exact = cuflash.flash_attn_func(q, k, v)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        fast = cuflash.flash_attn_func(q, k, v)
        torch_tf32, _ = attention_reference(q, k, v, dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err_exact, err_fast, err_torch = (rel_err(x, ref) for x in (exact, fast, torch_tf32))
    assert err_exact < 1e-5
    assert err_fast > 10 * err_exact, "allow_tf32 had no effect"
    assert err_fast < 1e-3, f"TF32 error {err_fast:.2e} above DESIGN.md's 1e-3"
    assert err_fast <= 2 * err_torch, f"TF32 error {err_fast:.2e} vs torch's TF32 attention {err_torch:.2e}"


def test_deterministic_backward_on_gpu():
    torch.manual_seed(2)
    q, k, v = make_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    out, lse = cuflash.forward(q, k, v, causal=True)
    first = cuflash.backward(dout, q, k, v, out, lse, causal=True)
    for _ in range(3):
        again = cuflash.backward(dout, q, k, v, out, lse, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_memory_is_linear_in_seqlen():
    """Forward + backward at seqlen 32k: the N x N scores alone would take 8 * 32k^2 * 2 bytes
    = 16 GB; we allow at most 3x the bytes of q, k, v and out."""
    torch.manual_seed(3)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 32768, 32768, 8, 8, 128, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = cuflash.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * q.element_size()
    assert extra <= 3 * inputs, f"peak extra memory {extra / 1e9:.2f} GB > 3x q+k+v+out ({inputs / 1e9:.2f} GB)"
    assert torch.isfinite(q.grad).all()
