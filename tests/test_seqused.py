"""seqused_q / seqused_k in flash_attn_varlen_func (FlashAttention-3's): sequence b uses only the first
seqused_q[b] / seqused_k[b] of the rows cu_seqlens (or a padded batch, or its pages) give it. Against the
float64 oracle of each sequence over its used rows alone (tests/attn_testing.varlen_oracle), on the CPU
path and the Triton kernels through the interpreter, and on the GPU; the rows past them come out exactly
0 (lse +inf) with gradient exactly 0."""
import pytest
import torch

import cuflash
from cuflash import ErrorCode, FlashAttentionError

from attn_testing import BOUNDS, CPU_DTYPES, GPU_DTYPES, interpret, paged_cache, poison_allocations, rel_err, seed_of, \
    strided_view, varlen_batch, varlen_oracle

# Lengths with sequences of 1 and 17 rows, one whose keys are all unused (seqused_k 0), one using all its
# rows, and used lengths giving seqlen_q > seqlen_k and seqlen_q < seqlen_k under causal.
LENS_Q, LENS_K = [3, 17, 1, 12, 9], [11, 17, 2, 40, 9]
USED_Q, USED_K = [2, 17, 1, 12, 4], [7, 0, 1, 33, 9]


def ints(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def unused_rows(cu: torch.Tensor, used: list[int]) -> torch.Tensor:
    """A bool mask of the packed rows past each sequence's used ones."""
    rows = torch.ones(int(cu[-1]), dtype=torch.bool)
    for b, n in enumerate(used):
        rows[int(cu[b]):int(cu[b]) + n] = False
    return rows


def check_seqused(call, lens_q, lens_k, used_q, used_k, heads, dtype, device="cpu", **options):
    """call(q, k, v, cu_q, cu_k, seqused_q, seqused_k) -> (out, lse) against varlen_oracle on the used
    rows (options: the oracle's), out, lse and the gradients; the unused rows' out 0, lse +inf and
    dq, dk, dv 0 exactly."""
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, *heads, dtype, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = call(*leaves, cu_q, cu_k, ints(used_q, device), ints(used_k, device))
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = varlen_oracle(*ref_leaves, cu_q.tolist(), cu_k.tolist(), used_q, used_k, **options)
    ref.backward(dout.double())
    unused_q, unused_k = unused_rows(cu_q, used_q).to(device), unused_rows(cu_k, used_k).to(device)
    assert torch.equal(out[unused_q], torch.zeros_like(out[unused_q]))
    assert torch.isposinf(lse[:, unused_q]).all()
    assert not leaves[0].grad[unused_q].any() and not leaves[1].grad[unused_k].any()
    assert not leaves[2].grad[unused_k].any()
    assert rel_err(out.detach(), ref) < BOUNDS[dtype], f"out {rel_err(out.detach(), ref):.3g}"
    used = ~torch.isposinf(ref_lse)  # (rows that see a key)
    assert torch.equal(torch.isposinf(lse), ~used)
    assert torch.allclose(lse[used].double(), ref_lse[used], atol=1e-5 if dtype == torch.float32 else 2e-3)
    for name, ours, theirs in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert rel_err(ours.grad, theirs.grad) < BOUNDS[dtype], f"{name} {rel_err(ours.grad, theirs.grad):.3g}"


def varlen_call(**options):
    """flash_attn_varlen_func with seqused and these options, returning (out, softmax_lse)."""
    def call(q, k, v, cu_q, cu_k, used_q, used_k):
        lens_q, lens_k = cu_q.diff().tolist(), cu_k.diff().tolist()
        out, lse, _ = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                     return_attn_probs=True, seqused_q=used_q, seqused_k=used_k,
                                                     **options)
        return out, lse
    return call


def chunk_mask(chunk: int, used_q, used_k):
    """attention_chunk's mask for the oracle: the keys of the chunk of a query's key position, placed
    bottom-right among each sequence's used keys."""
    offset = torch.tensor(used_k) - torch.tensor(used_q)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + offset.to(b.device)[b]) // chunk == kv_idx // chunk
    return mask_mod


def every_third(b, h, q_idx, kv_idx):  # a mask_mod reading b, h and both positions; key 0 always seen
    return ((q_idx + kv_idx + h + b) % 3 != 0) | (kv_idx == 0)


CASES = {  # (heads (nheads, nheads_k), head dim, options, the oracle's options beyond them)
    "plain_gqa": ((4, 2), 16, {}, {}),
    "causal_mqa": ((4, 1), 24, dict(causal=True), {}),
    "window_softcap_alibi": ((2, 2), 16, dict(window_size=(5, 2), softcap=3.0,
                                              alibi_slopes=torch.tensor([0.3, 0.1])), {}),
    "causal_mask_mod": ((2, 1), 16, dict(causal=True, mask_mod=every_third), {}),
    "causal_chunk": ((2, 2), 16, dict(causal=True, attention_chunk=4),
                     dict(mask_mod=chunk_mask(4, USED_Q, USED_K))),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_seqused_against_the_oracle(backend, case, dtype):
    heads, head_dim, options, oracle_options = CASES[case]
    torch.manual_seed(seed_of(case, str(dtype)))
    call_options = dict(options)
    oracle = {name: value for name, value in options.items() if name != "attention_chunk"} | oracle_options
    check_seqused(varlen_call(**call_options), LENS_Q, LENS_K, USED_Q, USED_K, (*heads, head_dim), dtype,
                  **oracle)


def check_one_launch(device, dtype, head_dim, monkeypatch):
    """Short sequences, whose backward the table gives to the one-launch dK/dV kernel (computing delta and
    dQ too, and zeroing the dQ rows no query tile visits): check_seqused's checks, with the outputs'
    memory poisoned (NaN) where the kernels' allocations leave it unwritten, and that the backward ran in
    one launch."""
    from cuflash.kernels import attention, launch
    poison_allocations(monkeypatch)
    torch.manual_seed(seed_of("one launch", str(dtype), head_dim))
    check_seqused(varlen_call(causal=True), [5, 20, 3, 1], [9, 32, 7, 17], [2, 20, 0, 1], [0, 30, 7, 17],
                  (4, 2, head_dim), dtype, device, causal=True)
    backward = [p for key, p in launch.PLANS.items() if key[0][0] is attention.attention_backward]
    assert backward and all(len(p.launches) == 1 for p in backward)


@interpret
def test_seqused_one_launch_backward(monkeypatch):
    check_one_launch("cpu", torch.float32, 32, monkeypatch)


def test_seqused_of_every_row_is_no_seqused(backend):
    """seqused equal to each sequence's full lengths gives exactly what no seqused gives."""
    torch.manual_seed(31)
    q, k, v, cu_q, cu_k = varlen_batch(LENS_Q, LENS_K, 4, 2, 16, torch.float32, "cpu")
    results = []
    for used in ({}, dict(seqused_q=cu_q.diff().int(), seqused_k=cu_k.diff().int())):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = cuflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, 17, 40, causal=True,
                                                     return_attn_probs=True, **used)
        out.backward(torch.ones_like(out))
        results.append((out, lse, *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def compacted(t: torch.Tensor, cu: torch.Tensor, used: list[int]) -> torch.Tensor:
    """The used rows of each sequence of a packed t, packed."""
    return torch.cat([t[int(cu[b]):int(cu[b]) + n] for b, n in enumerate(used)])


@interpret
def test_seqused_with_dropout_is_the_compacted_batch():
    """With dropout (no oracle: the kept probabilities are drawn), a call with seqused gives the call on
    the batch of the used rows alone, packed (the draw is per sequence, row and key, as dense), on each
    backend; and the Triton kernels through the interpreter give what the CPU path gives."""
    torch.manual_seed(32)
    q, k, v, cu_q, cu_k = varlen_batch(LENS_Q, LENS_K, 2, 1, 16, torch.float32, "cpu")
    cu = [ints([0] + used).cumsum(0, dtype=torch.int32) for used in (USED_Q, USED_K)]
    dout = torch.randn_like(q)
    runs = {}
    for backend in ("cpu", "triton"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CUFLASH_BACKEND", backend)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(5)
            out = cuflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, 17, 40, dropout_p=0.3, causal=True,
                                                 seqused_q=ints(USED_Q), seqused_k=ints(USED_K))
            out.backward(dout)
            small = [compacted(t, c, used).detach().requires_grad_()
                     for t, c, used in ((q, cu_q, USED_Q), (k, cu_k, USED_K), (v, cu_k, USED_K))]
            torch.manual_seed(5)
            alone = cuflash.flash_attn_varlen_func(*small, *cu, 17, 33, dropout_p=0.3, causal=True)
            alone.backward(compacted(dout, cu_q, USED_Q))
            used_rows = (compacted(out, cu_q, USED_Q), compacted(leaves[0].grad, cu_q, USED_Q),
                         *(compacted(t.grad, cu_k, USED_K) for t in leaves[1:]))
            for name, a, b in zip(("out", "dq", "dk", "dv"), used_rows, (alone, *(t.grad for t in small))):
                assert torch.allclose(a, b, atol=1e-6), f"{backend} {name}"
            runs[backend] = used_rows
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs["cpu"], runs["triton"]):
        assert torch.allclose(a, b, atol=1e-5), name


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_seqused_over_pages(backend, dtype):
    """seqused_k over a paged cache, with cu_seqlens_k (the keys used of those it gives), and without it
    (FlashAttention-3's paged call: each sequence's pages hold max_blocks_per_seq * page keys, seqused_k
    says how many are used), a table entry past a sequence's used pages never read; against the oracle."""
    torch.manual_seed(seed_of("paged", str(dtype)))
    q, k, v, cu_q, cu_k = varlen_batch(LENS_Q, LENS_K, 4, 2, 16, dtype, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, 5)  # 9 columns, the last an index outside the pool
    ref, ref_lse = varlen_oracle(q, k, v, cu_q.tolist(), cu_k.tolist(), USED_Q, USED_K, causal=True)
    table[3, 7] = 10**6  # sequence 3 uses 7 of its 8 pages: its last one is never read
    for cu_seqlens_k, max_seqlen_k in ((cu_k, 40), (None, None)):
        out, lse, probs = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_seqlens_k, 17, max_seqlen_k,
                                                         causal=True, block_table=table, return_attn_probs=True,
                                                         seqused_q=ints(USED_Q), seqused_k=ints(USED_K))
        assert rel_err(out, ref) < BOUNDS[dtype]
        assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
        assert probs.shape == (5, 4, 17, 40 if cu_seqlens_k is not None else 45)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_seqused_in_a_padded_batch(backend, dtype):
    """FlashAttention-3's padded batch: cu_seqlens None and q (or k, v) (batch, seqlen, heads, dim),
    sequence b its row b; out and lse come in flash_attn_func's layouts. Against the oracle (q padded, k
    packed; q and k padded), and without seqused against flash_attn_func."""
    torch.manual_seed(seed_of("padded", str(dtype)))
    q, k, v = (torch.randn(5, n, h, 16, dtype=dtype) for n, h in ((17, 4), (40, 2), (40, 2)))
    used_q, used_k = ints(USED_Q), ints(USED_K)
    cu_q, cu_k = (torch.arange(6, dtype=torch.int32) * n for n in (17, 40))
    ref, ref_lse = varlen_oracle(*(t.flatten(0, 1).double() for t in (q, k, v)), cu_q.tolist(), cu_k.tolist(),
                                 USED_Q, USED_K, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = cuflash.flash_attn_varlen_func(*leaves, None, None, None, None, causal=True,
                                                 return_attn_probs=True, seqused_q=used_q, seqused_k=used_k)
    assert out.shape == q.shape and lse.shape == (5, 4, 17)
    assert rel_err(out.flatten(0, 1), ref) < BOUNDS[dtype]
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse.view(4, 5, 17).transpose(0, 1)))
    out.sum().backward()
    assert not leaves[1].grad[4, 9:].any() and not leaves[0].grad[0, 2:].any()
    mixed = cuflash.flash_attn_varlen_func(q, k.flatten(0, 1), v.flatten(0, 1), None, cu_k, 17, 40, causal=True,
                                           seqused_q=used_q, seqused_k=used_k)
    assert torch.equal(mixed, out.detach())
    plain = cuflash.flash_attn_varlen_func(q, k, v, None, None, None, None, causal=True)
    assert rel_err(plain, cuflash.flash_attn_func(q, k, v, causal=True).double()) < BOUNDS[dtype]


def test_seqused_through_the_packed_variants(backend):
    torch.manual_seed(33)
    q, k, v, cu, _ = varlen_batch([7, 19, 2], [7, 19, 2], 2, 2, 16, torch.float32, "cpu")
    used = dict(seqused_q=ints([7, 3, 0]), seqused_k=ints([2, 19, 1]))
    out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True, **used)
    assert torch.equal(cuflash.flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), 1), cu, 19, causal=True,
                                                                **used), out)
    assert torch.equal(cuflash.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu, cu, 19, 19,
                                                               causal=True, **used), out)


def test_strided_seqused(backend):
    """A strided seqused gives what a contiguous one gives (the kernels address it by position)."""
    torch.manual_seed(34)
    q, k, v, cu_q, cu_k = varlen_batch(LENS_Q, LENS_K, 2, 2, 16, torch.float32, "cpu")
    outs = [cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, seqused_q=make(ints(USED_Q)),
                                           seqused_k=make(ints(USED_K))) for make in (lambda t: t, strided_view)]
    assert torch.equal(*outs)


def test_bad_seqused():
    """Errors name seqused_q / seqused_k and, for a bad value, the sequence and its rows."""
    q, k, v, cu_q, cu_k = varlen_batch([3, 5], [4, 6], 2, 2, 16, torch.float32, "cpu")
    pool, table = torch.randn(4, 8, 2, 16), ints([[0, 1], [2, 3]])

    def call(**kwargs):
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6) | kwargs
        return cuflash.flash_attn_varlen_func(**args)

    cases = [
        (dict(seqused_k=[4, 6]), ErrorCode.INVALID_ARGUMENT, ["seqused_k", "tensor"]),
        (dict(seqused_k=ints([4, 6]).long()), ErrorCode.UNSUPPORTED_DTYPE, ["seqused_k", "int32"]),
        (dict(seqused_q=ints([3])), ErrorCode.SHAPE_MISMATCH, ["seqused_q", "(2,)"]),
        (dict(seqused_k=ints([4, 7])), ErrorCode.INVALID_ARGUMENT, ["seqused_k[1] = 7", "sequence 1", "6 keys",
                                                                    "cu_seqlens_k"]),
        (dict(seqused_q=ints([-1, 0])), ErrorCode.INVALID_ARGUMENT, ["seqused_q[0] = -1", "3 query rows"]),
        (dict(q=q.view(1, 8, 2, 16), cu_seqlens_q=None, cu_seqlens_k=ints([0, 10]), max_seqlen_k=10,
              seqused_q=ints([9])), ErrorCode.INVALID_ARGUMENT, ["seqused_q[0] = 9", "8 query rows", "q's seqlen_q"]),
        (dict(k=pool, v=pool, cu_seqlens_k=None, block_table=table, seqused_k=ints([4, 17])),
         ErrorCode.INVALID_ARGUMENT, ["seqused_k[1] = 17", "16 keys", "block_table's 2 pages of 8 keys"]),
        (dict(cu_seqlens_q=None), ErrorCode.INVALID_DIMENSION, ["q", "without cu_seqlens_q"]),
        (dict(k=k.view(2, 5, 2, 16), v=v.view(2, 5, 2, 16), cu_seqlens_k=None, max_seqlen_k=1.5),
         ErrorCode.INVALID_ARGUMENT, ["max_seqlen_k", "None or an int"]),
        (dict(k=k.view(1, 10, 2, 16), v=v.view(1, 10, 2, 16), cu_seqlens_k=None), ErrorCode.SHAPE_MISMATCH,
         ["k has batch 1", "2 sequences"]),
    ]
    for kwargs, code, words in cases:
        with pytest.raises(FlashAttentionError) as info:
            call(**kwargs)
        assert info.value.code == code and all(w in str(info.value) for w in words), str(info.value)


def test_seqused_under_torch_compile(monkeypatch):
    """Through the custom ops under torch.compile(fullgraph=True): the output and gradients of the eager
    call (the CPU backend: the op layer is the same for every backend)."""
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    torch.manual_seed(35)
    q, k, v, cu_q, cu_k = varlen_batch(LENS_Q, LENS_K, 2, 1, 16, torch.float32, "cpu")
    used_q, used_k = ints(USED_Q), ints(USED_K)

    def attend(q, k, v):
        return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True, seqused_q=used_q,
                                              seqused_k=used_k)
    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.sum().backward()
        results.append((out, *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_seqused_on_gpu(dtype, causal):
    """The compiled kernels (GQA 8:2, head dim 128) with sequences of 1 to 1030 rows, some cut by seqused
    (seqlen_q > and < seqlen_k), one with seqused_k 0, one using every row; the unused rows exactly 0."""
    torch.manual_seed(40 + causal)
    lens_q, lens_k = [1, 17, 1000, 300, 513, 64], [5, 17, 1000, 1030, 1030, 1]
    used_q, used_k = [1, 9, 1000, 299, 100, 64], [5, 0, 999, 40, 1030, 1]
    check_seqused(varlen_call(causal=causal), lens_q, lens_k, used_q, used_k, (8, 2, 128), dtype, "cuda",
                  causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_seqused_one_launch_backward_on_gpu(dtype, head_dim, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the table takes the one-launch backward from sm_90 on")
    check_one_launch("cuda", dtype, head_dim, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_seqused_variants_on_gpu(dtype):
    """Windows, softcap and ALiBi, a mask_mod and attention_chunk with seqused, at head dim 64."""
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.2], device="cuda")
    options = dict(causal=True, window_size=(50, 0), softcap=8.0, alibi_slopes=slopes, mask_mod=every_third)
    torch.manual_seed(42)
    lens_q, lens_k = [300, 17, 1], [700, 17, 90]
    used_q, used_k = [250, 17, 1], [600, 3, 0]
    check_seqused(varlen_call(**options), lens_q, lens_k, used_q, used_k, (4, 2, 64), dtype, "cuda", **options)
    check_seqused(varlen_call(causal=True, attention_chunk=64), lens_q, lens_k, used_q, used_k, (4, 4, 64), dtype,
                  "cuda", causal=True, mask_mod=chunk_mask(64, used_q, used_k))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_seqused_paged_on_gpu(dtype, page):
    """FlashAttention-3's paged call (cu_seqlens_k None, seqused_k) against the oracle."""
    torch.manual_seed(seed_of("paged gpu", page, str(dtype)))
    lens_q, lens_k = [1, 17, 300], [5, 17, 1030]
    used_k = [5, 1, 700]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, 128, dtype, "cuda")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page)
    out = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 300, None, causal=True,
                                         block_table=table[:, :-1], seqused_k=ints(used_k, "cuda"))
    ref, _ = varlen_oracle(q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), None, used_k,
                           causal=True)
    assert rel_err(out, ref) < BOUNDS[dtype]
