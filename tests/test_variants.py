"""The training variants on the CPU (blocked PyTorch path and the Triton kernels through the
interpreter): sliding window, ALiBi, softcap, varlen, dropout, SDPA attention masks, each forward
and backward against the float64 oracle."""
import pytest
import torch
import torch.nn.functional as F

import cuflash
from attn_testing import BOUNDS, check_against_oracle, make_qkv, paged_cache, rel_err, run_and_grad, seed_of, \
    varlen_batch, varlen_reference
from cuflash.reference import attention_reference

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("window,causal", [((3, 0), False), ((4, 2), False), ((0, 1), False), ((-1, 5), False),
                                           ((6, -1), False), ((5, 7), True), ((40, 40), False)])
@pytest.mark.parametrize("seqlens", [(37, 37), (20, 45), (45, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sliding_window(backend, window, causal, seqlens, dtype):
    torch.manual_seed(seed_of(window, causal, seqlens))
    q, k, v = make_qkv(2, *seqlens, 4, 2, 24, dtype, "cpu")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, window_size=window),
                         q, k, v, causal, with_sdpa=False, window_size=window)


WINDOW_FORMS = {"tuple": lambda left, right: (left, right), "list": lambda left, right: [left, right],
                "tensor": lambda left, right: torch.tensor([left, right]),
                "int32_tensor": lambda left, right: torch.tensor([left, right]).int(),
                "0d_tensors": lambda left, right: (torch.tensor(left), torch.tensor(right))}


@pytest.mark.parametrize("form", WINDOW_FORMS)
def test_window_size_in_every_form_and_entry_point(backend, form):
    """window_size as flash-attn reads it (window_size[0], window_size[1]): a list, a 2-element
    integer tensor or a pair of 0-d tensors works in every entry point, against the oracle."""
    if backend == "triton" and form != "0d_tensors":
        pytest.skip("the forms become the same ints before any backend runs: one form through the interpreter")
    torch.manual_seed(len(form))
    window = WINDOW_FORMS[form](5, 2)
    q, k, v = make_qkv(2, 19, 23, 4, 2, 16, torch.float32, "cpu")
    ref, _ = attention_reference(q, k, v, window_size=(5, 2))
    assert rel_err(cuflash.flash_attn_func(q, k, v, window_size=window), ref) < 1e-5
    kv = torch.stack((k, v), dim=2)
    assert rel_err(cuflash.flash_attn_kvpacked_func(q, kv, window_size=window), ref) < 1e-5
    out, _ = cuflash.forward(q, k, v, window_size=window)
    assert rel_err(out, ref) < 1e-5
    grads = cuflash.backward(torch.ones_like(out), q, k, v, *cuflash.forward(q, k, v, window_size=(5, 2)),
                             window_size=window)
    assert torch.equal(grads[0], cuflash.backward(torch.ones_like(out), q, k, v,
                                                  *cuflash.forward(q, k, v, window_size=(5, 2)),
                                                  window_size=(5, 2))[0])
    qkv = torch.stack((q, q, q), dim=2)
    self_ref, _ = attention_reference(q, q, q, window_size=(5, 2))
    assert rel_err(cuflash.flash_attn_qkvpacked_func(qkv, window_size=window), self_ref) < 1e-5
    cu_q = torch.tensor([0, 19, 38], dtype=torch.int32)
    cu_k = torch.tensor([0, 23, 46], dtype=torch.int32)
    out = cuflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 19, 23,
                                         window_size=window)
    assert rel_err(out, ref.flatten(0, 1)) < 1e-5
    out = cuflash.flash_attn_varlen_kvpacked_func(q.flatten(0, 1), kv.flatten(0, 1), cu_q, cu_k, 19, 23,
                                                  window_size=window)
    assert rel_err(out, ref.flatten(0, 1)) < 1e-5
    out = cuflash.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu_q, 19, window_size=window)
    assert rel_err(out, self_ref.flatten(0, 1)) < 1e-5
    out = cuflash.flash_attn_with_kvcache(q, k.clone(), v.clone(), window_size=window)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alibi(backend, per_batch, causal, dtype):
    torch.manual_seed(11 + per_batch + 2 * causal)
    q, k, v = make_qkv(2, 23, 41, 4, 2, 16, dtype, "cpu")
    slopes = torch.rand(2, 4) if per_batch else torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, alibi_slopes=slopes),
                         q, k, v, causal, with_sdpa=False, alibi_slopes=slopes)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap(backend, causal, dtype):
    torch.manual_seed(12 + causal)
    q, k, v = make_qkv(2, 30, 30, 2, 2, 32, dtype, "cpu")
    q = q * 3  # logits of several units, so that the cap bends them
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, softcap=2.0),
                         q, k, v, causal, with_sdpa=False, softcap=2.0)


def test_options_together(backend):
    torch.manual_seed(13)
    q, k, v = make_qkv(2, 33, 50, 6, 2, 40, torch.float32, "cpu")
    slopes = torch.rand(6)
    options = dict(window_size=(9, 3), softcap=5.0, alibi_slopes=slopes)
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, softmax_scale=0.4, **options),
                         q, k, v, False, with_sdpa=False, softmax_scale=0.4, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen(backend, causal, dtype):
    torch.manual_seed(14 + causal)
    lens_q, lens_k = [1, 17, 0, 40, 9], [5, 17, 3, 33, 20]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 24, dtype=dtype)
    k, v = (torch.randn(sum(lens_k), 2, 24, dtype=dtype) for _ in range(2))
    slopes = torch.rand(5, 4)
    dout = torch.randn_like(q)

    def ours(a, b, c):
        return cuflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                              window_size=(12, -1), alibi_slopes=slopes)

    def oracle(a, b, c):
        return varlen_reference(a, b, c, cu_q.tolist(), cu_k.tolist(), causal=causal, window_size=(12, -1),
                                 alibi_slopes=slopes)

    got = run_and_grad(ours, q, k, v, dout)
    ref = run_and_grad(oracle, q.double(), k.double(), v.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(x, r) < BOUNDS[dtype], name
    out, lse, probs = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                     return_attn_probs=True)
    assert lse.shape == (4, sum(lens_q)) and probs.shape == (5, 4, max(lens_q), max(lens_k))


PAGED_CASES = {  # (page size, nheads, nheads_k, head dim, options)
    "page1_causal_mqa": (1, 4, 1, 16, dict(causal=True)),
    "page5_window_alibi_softcap_gqa": (5, 4, 2, 24, dict(window_size=(9, 2), softcap=4.0, alibi=True)),
    "page16_plain": (16, 2, 2, 40, dict()),
    "page7_local_causal_interleaved": (7, 6, 3, 16, dict(causal=True, window_size=(5, 0), interleaved=True)),
    "page256_causal": (256, 2, 1, 32, dict(causal=True)),
}


@pytest.mark.parametrize("case", PAGED_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_paged_kv(backend, case, dtype):
    """flash_attn_varlen_func with block_table: k and v as pages of a cache read in place, against
    the float64 oracle on the same keys packed; causal with seqlen_q != seqlen_k, windows, ALiBi,
    softcap, GQA/MQA, any page size, a sequence of 1 key, unused pages and table columns."""
    page, nheads, nheads_k, d, options = PAGED_CASES[case]
    options = dict(options)
    torch.manual_seed(seed_of(case, str(dtype)))
    lens_q, lens_k = [3, 17, 1, 12], [11, 17, 1, 40]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, nheads, nheads_k, d, dtype, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page, interleaved=options.pop("interleaved", False))
    slopes = torch.rand(len(lens_q), nheads) if options.pop("alibi", False) else None
    out, lse, probs = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                                     alibi_slopes=slopes, block_table=table, return_attn_probs=True,
                                                     **options)
    ref = varlen_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), alibi_slopes=slopes, **options)
    assert rel_err(out, ref) < BOUNDS[dtype]
    dense = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), alibi_slopes=slopes,
                                           return_attn_probs=True, **options)
    assert torch.allclose(lse, dense[1], atol=1e-5) and torch.equal(probs, dense[2])


def test_varlen_paged_kv_bad_tables_and_no_backward(backend):
    q, k, v, cu_q, cu_k = varlen_batch([2, 3], [9, 20], 2, 2, 16, torch.float32, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, 8)  # 2 and 3 pages: table (2, 4)

    def call(block_table, **kwargs):
        return cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 20, block_table=block_table,
                                              **kwargs)

    outside = table.clone()
    outside[1, 2] = k_cache.shape[0]
    for bad, code, words in ((outside, "INVALID_ARGUMENT", ["block_table[1, 2]", "outside"]),
                             (table[:, :2], "SHAPE_MISMATCH", ["block_table", "2 columns", "3 pages"]),
                             (table.long(), "UNSUPPORTED_DTYPE", ["block_table", "int32"]),
                             (table[:1], "SHAPE_MISMATCH", ["block_table", "batch"])):
        with pytest.raises(RuntimeError) as info:  # (a FlashAttentionError, caught as flash-attn's RuntimeError)
            call(bad)
        assert info.value.code.name == code and all(w in str(info.value) for w in words), str(info.value)
    q.requires_grad_()
    out = call(table)  # the forward runs; a backward through the pages raises, naming block_table
    with pytest.raises(cuflash.FlashAttentionError, match="block_table"):
        out.sum().backward()


def test_varlen_packed_and_no_padding_compute(backend):
    """The packed variants are views onto flash_attn_varlen_func; a varlen batch gives what the
    same sequences give one at a time through flash_attn_func."""
    torch.manual_seed(15)
    lens = [7, 19, 2]
    cu = torch.tensor([0, 7, 26, 28], dtype=torch.int32)
    qkv = torch.randn(28, 3, 2, 16)
    out = cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = cuflash.flash_attn_func(qkv[None, s:e, 0], qkv[None, s:e, 1], qkv[None, s:e, 2], causal=True)
        assert torch.allclose(out[s:e], alone[0], atol=1e-6), f"sequence {b}"
    q, kv = qkv[:, 0], qkv[:, 1:]
    packed = cuflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(packed, out)


def test_rows_without_keys(backend):
    """Windows and varlen leave rows with no visible key: out 0, lse +inf, zero finite gradients."""
    torch.manual_seed(16)
    # seqlen_q > seqlen_k with a window entirely right of the diagonal: rows i < 10 see nothing.
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 30, 20, 2, 2, 16, torch.float32, "cpu"))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True)
    out.backward(torch.randn_like(out))
    assert torch.equal(out[:, :10], torch.zeros_like(out[:, :10]))
    assert torch.isinf(lse[..., :10]).all() and (lse[..., :10] > 0).all()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :10], torch.zeros_like(q.grad[:, :10]))
    # a varlen sequence with queries but no keys
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 6], dtype=torch.int32)
    q2 = torch.randn(9, 2, 16, requires_grad=True)
    k2, v2 = (torch.randn(6, 2, 16, requires_grad=True) for _ in range(2))
    out2 = cuflash.flash_attn_varlen_func(q2, k2, v2, cu_q, cu_k, 5, 6)
    out2.sum().backward()
    assert torch.equal(out2[:4], torch.zeros_like(out2[:4])) and torch.isfinite(q2.grad).all()


@pytest.mark.parametrize("mask_kind", ["bool_2d", "bool_per_batch", "additive_per_head", "additive_full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_attn_mask(backend, mask_kind, dtype):
    """attn_mask against torch's own SDPA in float64, forward and backward, broadcast masks read
    through their strides."""
    torch.manual_seed(17)
    b, h, hk, lq, lk, d = 2, 4, 2, 19, 27, 16
    query = torch.randn(b, h, lq, d, dtype=dtype)
    key, value = (torch.randn(b, hk, lk, d, dtype=dtype) for _ in range(2))
    mask = {
        "bool_2d": torch.rand(lq, lk) > 0.3,
        "bool_per_batch": torch.rand(b, 1, lq, lk) > 0.5,
        "additive_per_head": torch.randn(h, 1, lk, dtype=dtype),
        "additive_full": torch.randn(b, h, lq, lk, dtype=dtype).transpose(-1, -2).contiguous().transpose(-1, -2),
    }[mask_kind]
    if mask.dtype == torch.bool:
        mask[..., 0] = True  # torch gives NaN for rows without any key; that case is tested below
    dout = torch.randn_like(query)
    ours = run_and_grad(lambda a, b_, c: cuflash.scaled_dot_product_attention(a, b_, c, attn_mask=mask,
                                                                               enable_gqa=True),
                        query, key, value, dout)
    ref = run_and_grad(lambda a, b_, c: F.scaled_dot_product_attention(
        a, b_, c, attn_mask=mask if mask.dtype == torch.bool else mask.double(), enable_gqa=True),
        query.double(), key.double(), value.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(x, r) < BOUNDS[dtype], name


def test_sdpa_mask_hiding_a_whole_row(backend):
    query, key, value = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out = cuflash.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    out.sum().backward()
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.isfinite(query.grad).all() and torch.equal(query.grad[:, :, 2], torch.zeros_like(query.grad[:, :, 2]))


def _dropout_case(dtype, seed=18):
    torch.manual_seed(seed)
    return make_qkv(2, 29, 35, 4, 2, 16, dtype, "cpu")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_exact_given_the_mask(backend, causal, dtype):
    """Output and gradients equal the oracle's given the same keep mask, which return_attn_probs
    reveals (dropped probabilities come back negated)."""
    q, k, v = _dropout_case(dtype)
    p = 0.3
    torch.manual_seed(100)
    _, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=p, causal=causal, return_attn_probs=True)
    keep = probs >= 0

    def ours(a, b, c):
        torch.manual_seed(100)  # the same seed draws the same mask
        return cuflash.flash_attn_func(a, b, c, dropout_p=p, causal=causal)

    check_against_oracle(ours, q, k, v, causal, with_sdpa=False, dropout_p=p, dropout_keep=keep)


def test_dropout_statistics_and_seeding(backend):
    q, k, _ = _dropout_case(torch.float32)
    v = torch.ones_like(k)
    p = 0.25
    torch.manual_seed(5)
    out, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    kept = (probs >= 0).double().mean().item()
    n = probs.numel()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, f"keep rate {kept:.4f} for p={p}"
    # With V = 1 each output is sum_j P_ij Z_ij / (1 - p): 1 in expectation over the mask.
    assert abs(out.mean().item() - 1.0) < 0.02
    torch.manual_seed(5)
    again = cuflash.flash_attn_func(q, k, v, dropout_p=p)
    assert torch.equal(out, again), "torch.manual_seed must reproduce a run"
    other = cuflash.flash_attn_func(q, k, v, dropout_p=p)
    assert not torch.equal(out, other)


@pytest.mark.interpret
def test_dropout_mask_same_on_both_backends(monkeypatch):
    """The kernels and the CPU path draw the same mask from the same seed."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    q, k, v = _dropout_case(torch.float32)
    outs = []
    for name in ("cpu", "triton"):
        monkeypatch.setenv("CUFLASH_BACKEND", name)
        torch.manual_seed(6)
        outs.append(cuflash.flash_attn_func(q, k, v, dropout_p=0.4, causal=True))
    assert rel_err(outs[1], outs[0].double()) < 1e-5


def test_sdpa_dropout(backend):
    """SDPA's dropout draws the mask flash_attn_func draws from the same seed (its layout
    transposed), and its output is the oracle's given that mask."""
    torch.manual_seed(19)
    query, key, value = (torch.randn(2, 2, 16, 8) for _ in range(3))
    torch.manual_seed(7)
    out = cuflash.scaled_dot_product_attention(query, key, value, dropout_p=0.5)
    torch.manual_seed(7)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    _, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    keep = probs >= 0
    assert 0.3 < keep.float().mean().item() < 0.7
    ref, _ = attention_reference(q, k, v, dropout_p=0.5, dropout_keep=keep)
    assert rel_err(out.transpose(1, 2), ref) < 1e-5
