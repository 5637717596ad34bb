"""Variable-length batches (cu_seqlens), also over paged K/V, against the oracle: the CPU path and
the Triton kernels through the interpreter, and on the GPU."""
import pytest
import torch

import cuflash
from attn_testing import BOUNDS, CPU_DTYPES, GPU_DTYPES, paged_cache, rel_err, run_and_grad, seed_of, strided_view, \
    varlen_batch, varlen_reference



@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
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
    # Sequence by sequence, in float64: probs is the softmax of the scaled scores (GQA: query head h
    # reads KV head h // 2; causal: bottom-right), zero past the sequence's lengths; lse its log-sum-exp,
    # +inf for a row that sees no key (flash-attn 2).
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q_b = q[cu_q[b]:cu_q[b + 1]].double()
        k_b = k[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k_b) / 24 ** 0.5
        if causal:
            scores = scores.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, float("-inf"))
        expected = torch.zeros(4, max(lens_q), max(lens_k), dtype=torch.float64)
        expected[:, :lq, :lk] = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        assert torch.allclose(probs[b].double(), expected, atol=tol), f"probs of sequence {b}"
        expected_lse = torch.logsumexp(scores, dim=-1)
        expected_lse[torch.isneginf(expected_lse)] = float("inf")
        assert torch.allclose(lse[:, cu_q[b]:cu_q[b + 1]].double(), expected_lse, atol=tol), f"lse of sequence {b}"


PAGED_CASES = {  # (page size, nheads, nheads_k, head dim, options)
    "page1_causal_mqa": (1, 4, 1, 16, dict(causal=True)),
    "page5_window_alibi_softcap_gqa": (5, 4, 2, 24, dict(window_size=(9, 2), softcap=4.0, alibi=True)),
    "page16_plain": (16, 2, 2, 40, dict()),
    "page7_local_causal_interleaved": (7, 6, 3, 16, dict(causal=True, window_size=(5, 0), interleaved=True)),
    "page256_causal": (256, 2, 1, 32, dict(causal=True)),
}


@pytest.mark.parametrize("case", PAGED_CASES)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
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


def test_varlen_empty_inputs(backend):
    """A batch whose sequences have no key at all (max_seqlen_k = 0, as flash-attn takes it) gives out 0,
    softmax_lse +inf and zero gradients, also through pages nobody reads; one with no query rows gives
    empty results. Sequences of no key beside others: test_varlen."""
    check_varlen_empty("cpu")


@pytest.mark.gpu
def test_varlen_empty_inputs_on_gpu():
    check_varlen_empty("cuda")


def check_varlen_empty(device):
    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    cu_q, no_keys = ints(0, 3, 3, 8), ints(0, 0, 0, 0)
    q, dout = (torch.randn(8, 4, 16, device=device) for _ in range(2))
    k, v = (torch.randn(0, 2, 16, device=device) for _ in range(2))
    got = run_and_grad(lambda a, b, c: cuflash.flash_attn_varlen_func(a[0], b[0], c[0], cu_q, no_keys, 5, 0,
                                                                      causal=True)[None],
                       q[None], k[None], v[None], dout[None])
    assert torch.equal(got[0], torch.zeros_like(q)[None]) and torch.equal(got[1], torch.zeros_like(q)[None])
    assert got[2].shape == got[3].shape == (1, 0, 2, 16)
    _, lse, probs = cuflash.flash_attn_varlen_func(q, k, v, cu_q, no_keys, 5, 0, return_attn_probs=True)
    assert torch.equal(lse, torch.full((4, 8), float("inf"), device=device)) and probs.shape == (3, 4, 5, 0)
    pool = torch.randn(4, 16, 2, 16, device=device)
    paged = cuflash.flash_attn_varlen_func(q, pool, pool, cu_q, no_keys, 5, 0, block_table=ints(0, 0, 0)[:, None])
    assert torch.equal(paged, torch.zeros_like(q))
    keys = torch.randn(6, 2, 16, device=device)
    assert cuflash.flash_attn_varlen_func(q[:0], keys, keys, ints(0, 0), ints(0, 6), 0, 6).shape == (0, 4, 16)


def test_varlen_strided_cu_seqlens_and_block_table(backend):
    """cu_seqlens and block_table given as strided views give the output and gradients of contiguous
    ones (the kernels address them by position)."""
    torch.manual_seed(16)
    cu = torch.tensor([0, 7, 26, 28], dtype=torch.int32)
    q, k, v = (torch.randn(28, 2, 16) for _ in range(3))
    results = []
    for make in (lambda t: t, strided_view):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cuflash.flash_attn_varlen_func(*leaves, make(cu), make(cu), 19, 19, causal=True)
        out.backward(torch.ones_like(out))
        results.append((out, *(t.grad for t in leaves)))
    pages, table = torch.randn(2, 6, 8, 2, 16), torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 41], dtype=torch.int32)
    for make in (lambda t: t, strided_view):
        results.append((cuflash.flash_attn_varlen_func(q[:8], pages[0], pages[1], make(cu[:3] // 3), make(cu_k), 6,
                                                       21, block_table=make(table), causal=True),))
    assert not strided_view(cu).is_contiguous()
    for contiguous, strided in ((results[0], results[1]), (results[2], results[3])):
        for a, b in zip(contiguous, strided):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_varlen_on_gpu(dtype, causal):
    torch.manual_seed(20 + causal)
    lens_q, lens_k = [1, 17, 1000, 0, 513, 64], [5, 17, 1000, 9, 1030, 1]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, 128, dtype, "cuda")
    dout = torch.randn_like(q)
    got = run_and_grad(lambda a, b, c: cuflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                      causal=causal), q, k, v, dout)
    ref = run_and_grad(lambda a, b, c: varlen_reference(a, b, c, cu_q.tolist(), cu_k.tolist(), causal=causal),
                       q.double(), k.double(), v.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(x, r) < BOUNDS[dtype], name


@pytest.mark.gpu
@pytest.mark.parametrize("page,head_dim,options", [
    (16, 128, dict(causal=True)), (256, 64, dict()), (3, 96, dict(window_size=(100, 7), alibi=True, softcap=8.0)),
    (64, 256, dict(causal=True, interleaved=True))], ids=["p16_d128_causal", "p256_d64", "p3_d96_variants",
                                                          "p64_d256_interleaved"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_varlen_paged_kv_on_gpu(dtype, page, head_dim, options):
    """flash_attn_varlen_func reading K/V pages in place (GQA 8:2) against the float64 oracle."""
    options = dict(options)
    torch.manual_seed(seed_of(page, head_dim, str(dtype)))
    lens_q, lens_k = [1, 17, 1000, 300, 64], [5, 17, 1000, 1030, 1]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, head_dim, dtype, "cuda")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page, interleaved=options.pop("interleaved", False))
    slopes = torch.rand(len(lens_q), 8, device="cuda") if options.pop("alibi", False) else None
    out = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                         alibi_slopes=slopes, block_table=table, **options)
    ref = varlen_reference(q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), alibi_slopes=slopes,
                           **options)
    assert rel_err(out, ref) < BOUNDS[dtype]
