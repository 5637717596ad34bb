"""Learnable attention sinks (learnable_sink, gpt-oss; FlashAttention-4's semantics): one more logit per
query head in every row's softmax, with no value. Forward (out, softmax_lse) and gradients (dq, dk, dv and
the sink's, with a gradient of softmax_lse too) against the float64 oracle (reference.py's sink column,
differentiated by torch) on the CPU path and the Triton kernels through the interpreter, with every option;
gpu tests for the Triton and Gluon kernels in 16-bit."""
import functools

import pytest
import torch

import cuflash
from attn_testing import BOUNDS, CPU_DTYPES, case_id, interpret, make_qkv, paged_cache, rel_err, seed_of, \
    varlen_batch, varlen_oracle
from cuflash import ErrorCode, FlashAttentionError, ops
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

NAMES = ("out", "lse", "dq", "dk", "dv", "dsink")


def _grads(fn, inputs, dout, dlse):
    """(out, lse, then the gradients of `inputs`) of fn(*inputs) -> (out, lse), the loss's gradients being
    dout and dlse (None: out's only)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    torch.autograd.backward((out, lse) if dlse is not None else (out,), (dout, dlse) if dlse is not None else (dout,))
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def _flash(q, k, v, sink, **options):
    """flash_attn_func's out and its differentiable softmax_lse."""
    out, lse, _ = cuflash.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **options)
    return out, lse


def _oracle(q, k, v, sink, **options):
    return attention_reference(q, k, v, learnable_sink=sink, **options)


def check_sink(fn, q, k, v, sink, lse_grad=True, oracle=_oracle, **options):
    """fn(q, k, v, sink) -> (out, lse) and its gradients against oracle(...) in float64 (given `options`):
    relative errors under the dtype's bound. lse_grad: the loss has a gradient of lse too (without,
    the backward may be the one-launch one, which computes delta itself). Returns the errors by name."""
    dout = torch.randn_like(q)
    dlse = None
    if lse_grad:
        with torch.no_grad():
            dlse = torch.randn_like(fn(q, k, v, sink)[1])
    got = _grads(fn, (q, k, v, sink), dout, dlse)
    ref = _grads(functools.partial(oracle, **options), [t.double() for t in (q, k, v, sink)], dout.double(),
                 None if dlse is None else dlse.double())
    errors = {name: rel_err(a, b) for name, a, b in zip(NAMES, got, ref)}
    bound = BOUNDS[q.dtype]
    assert all(err < bound for err in errors.values()), f"errors {errors} above the {q.dtype} bound {bound}"
    return errors


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim), flash_attn_func's options, whether lse has a
# gradient (without, up to 32 keys, the interpreter's table takes the one-launch backward)
CASES = {
    "causal, more queries": ((2, 45, 20, 4, 2, 24), dict(causal=True), False),  # rows with no key: lse = sink
    "causal, more keys": ((1, 17, 50, 4, 4, 40), dict(causal=True), True),
    "window": ((2, 37, 37, 4, 2, 16), dict(window_size=(5, 3)), True),
    "mqa, softcap, alibi, scale": ((2, 30, 41, 6, 1, 32), dict(softcap=3.0, alibi_slopes="per_head",
                                                                softmax_scale=0.4), True),
    "one query, one key": ((3, 1, 1, 2, 1, 8), dict(), False),
    "hdim 96, ragged": ((1, 65, 129, 2, 2, 96), dict(causal=True), True),
}


def _case(name, dtype, device="cpu"):
    shape, options, _ = CASES[name]
    torch.manual_seed(seed_of(name))
    q, k, v = make_qkv(*shape, dtype, device)
    sink = torch.randn(shape[3], device=device) * 2
    options = dict(options)
    if options.get("alibi_slopes") == "per_head":
        options["alibi_slopes"] = torch.rand(shape[3], device=device)
    return q, k, v, sink, options


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_sink_against_oracle(backend, case, dtype):
    q, k, v, sink, options = _case(case, dtype)
    check_sink(functools.partial(_flash, **options), q, k, v, sink, CASES[case][2], **options)


@pytest.mark.parametrize("sink_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_sink_dtypes(backend, sink_dtype):
    """A 16-bit sink (gpt-oss's in a bf16 model) is read as it is, and its gradient comes in its dtype;
    fp64 on the CPU path only (validate.check_learnable_sink)."""
    q, k, v, sink, _ = _case("causal, more queries", torch.float32)
    if sink_dtype == torch.float64 and backend == "triton":
        pytest.skip("fp64 is the CPU path's")
    sink = sink.to(sink_dtype)
    leaf = sink.clone().requires_grad_()
    out = cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=leaf)
    out.sum().backward()
    assert leaf.grad.dtype == sink_dtype
    ref = attention_reference(*(t.double() for t in (q, k, v)), causal=True, learnable_sink=sink.double())[0]
    assert rel_err(out, ref) < BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_sink_with_score_mod_and_mask_mod(backend, dtype):
    """With a score_mod the kernels' logits are natural until score_tile takes them to base 2: the sink
    enters in the running max's units (and is not modded itself)."""
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 33, 40, 4, 2, 16, dtype, "cpu")
    sink = torch.randn(4) * 2
    table = torch.randn(4, 80) * 2

    def bias(score, b, h, q_idx, kv_idx):
        return score * 1.5 + table[h, (q_idx - kv_idx).abs().clamp(max=79)]

    def stripes(b, h, q_idx, kv_idx):
        return (kv_idx % 3 != 1) | (q_idx == kv_idx)
    options = dict(softmax_scale=0.3, causal=True)
    check_sink(functools.partial(_flash, score_mod=bias, mask_mod=stripes, **options), q, k, v, sink,
               score_mod=bias, mask_mod=stripes, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_sink_with_dropout(backend, causal, dtype):
    """Dropout drops key probabilities only: the oracle given the keep mask (return_attn_probs reveals
    it, negated where dropped), forward and backward; the softmax sum counts the dropped ones and the sink."""
    torch.manual_seed(18)
    q, k, v = make_qkv(2, 29, 35, 4, 2, 16, dtype, "cpu")
    sink = torch.randn(4)
    p = 0.3
    torch.manual_seed(100)
    probs = cuflash.flash_attn_func(q, k, v, dropout_p=p, causal=causal, learnable_sink=sink,
                                    return_attn_probs=True)[2]
    assert (probs.double().abs().sum(-1) < 1).all()  # (the sink takes its share of every row)

    def dropped(a, b, c, s):
        torch.manual_seed(100)  # the same seed draws the same mask
        return _flash(a, b, c, s, dropout_p=p, causal=causal)
    check_sink(dropped, q, k, v, sink, causal=causal, dropout_p=p, dropout_keep=probs >= 0)


@interpret
def test_sink_and_dropout_same_on_both_backends(monkeypatch):
    """The kernels and the CPU path give the same output and gradients from the same seed."""
    torch.manual_seed(19)
    q, k, v = make_qkv(2, 29, 35, 4, 2, 16, torch.float32, "cpu")
    sink, dout = torch.randn(4), torch.randn_like(q)
    results = []
    for name in ("cpu", "triton"):
        monkeypatch.setenv("CUFLASH_BACKEND", name)

        def dropped(a, b, c, s):
            torch.manual_seed(6)
            return _flash(a, b, c, s, dropout_p=0.4, causal=True)
        results.append(_grads(dropped, (q, k, v, sink), dout, None))
    for name, theirs, ours in zip(NAMES, *results):
        assert rel_err(ours, theirs.double()) < 1e-5, name


def _varlen_oracle(q, k, v, sink, cu_q, cu_k, used_q=None, used_k=None, **options):
    """varlen_oracle with the sink: out (total_q, H, D) and lse (H, total_q)."""
    return varlen_oracle(q, k, v, cu_q, cu_k, used_q, used_k, learnable_sink=sink, **options)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_sink_varlen(backend, dtype):
    """Packed sequences, one without keys (out 0, lse = sink) and one without queries, causal, GQA; the
    packed variants give the same."""
    torch.manual_seed(7)
    lens_q, lens_k = [5, 20, 0, 3], [0, 32, 4, 7]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, 24, dtype, "cpu")
    sink = torch.randn(4) * 2
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=32)

    def ours(a, b, c, s):
        out, lse, _ = cuflash.flash_attn_varlen_func(a, b, c, learnable_sink=s, causal=True, return_attn_probs=True,
                                                     **varlen)
        return out, lse
    check_sink(ours, q, k, v, sink, oracle=functools.partial(_varlen_oracle, cu_q=cu_q.tolist(), cu_k=cu_k.tolist()),
               causal=True)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, k, v, learnable_sink=sink, causal=True, return_attn_probs=True,
                                                 **varlen)
    assert not out[:5].any() and torch.allclose(lse[:, :5], sink[:, None].expand(4, 5))
    kv = torch.stack((k, v), dim=1)
    packed = cuflash.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 20, 32, causal=True, learnable_sink=sink)
    assert torch.equal(packed, out)
    same = [7, 20, 0, 3]
    q2, _, _, cu, _ = varlen_batch(same, same, 4, 4, 24, dtype, "cpu")
    qkv = torch.stack((q2, q2, q2), dim=1)
    assert torch.equal(cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, 20, learnable_sink=sink),
                       cuflash.flash_attn_varlen_func(q2, q2, q2, cu, cu, 20, 20, learnable_sink=sink))


def check_sink_seqused(lens_q, lens_k, used_q, used_k, heads, dtype, device="cpu", lse_grad=True, **options):
    """flash_attn_varlen_func with seqused_q / seqused_k and a sink against the oracle of each sequence over
    its used rows (out, lse, dq, dk, dv, dsink; heads: (nheads, nheads_k, head_dim)), dO and the lse's
    gradient NaN on the rows past seqused_q: they are not read, and add nothing to any gradient, the
    sink's included. Those rows have out 0, lse +inf (not the sink: they are no rows of the softmax)
    and dq, dk, dv 0 exactly."""
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, *heads, dtype, device)
    sink = torch.randn(heads[0], device=device) * 2
    seqused = {name: torch.tensor(used, dtype=torch.int32, device=device)
               for name, used in (("seqused_q", used_q), ("seqused_k", used_k))}

    def ours(a, b, c, s):
        out, lse, _ = cuflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k), learnable_sink=s,
                                                     return_attn_probs=True, **seqused, **options)
        return out, lse
    unused_q, unused_k = (torch.ones(int(cu[-1]), dtype=torch.bool, device=device) for cu in (cu_q, cu_k))
    for b in range(len(lens_q)):
        unused_q[cu_q[b]:cu_q[b] + used_q[b]] = False
        unused_k[cu_k[b]:cu_k[b] + used_k[b]] = False
    dout = torch.randn_like(q)
    dlse = torch.randn(heads[0], q.shape[0], device=device) if lse_grad else None
    got = _grads(ours, (q, k, v, sink), dout.masked_fill(unused_q[:, None, None], float("nan")),
                 None if dlse is None else dlse.masked_fill(unused_q, float("nan")))
    oracle = functools.partial(_varlen_oracle, cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), used_q=used_q, used_k=used_k,
                               **options)
    ref = _grads(oracle, [t.double() for t in (q, k, v, sink)], dout.double(),
                 None if dlse is None else dlse.double())
    out, lse, dq, dk, dv, _ = got
    assert not out[unused_q].any() and torch.isposinf(lse[:, unused_q]).all()
    assert not dq[unused_q].any() and not dk[unused_k].any() and not dv[unused_k].any()
    assert torch.equal(torch.isposinf(ref[1]), torch.isposinf(lse))  # (the used rows' lse: finite, the sink's)
    got, ref = list(got), list(ref)
    got[1], ref[1] = lse[:, ~unused_q], ref[1][:, ~unused_q]
    errors = {name: rel_err(a, b) for name, a, b in zip(NAMES, got, ref)}
    assert all(err < BOUNDS[dtype] for err in errors.values()), f"errors {errors} above the bound {BOUNDS[dtype]}"


# (lens_q, lens_k, used_q, used_k), options, whether lse has a gradient. Sequences cut by seqused_q and
# seqused_k, one using no query row, one no key (its rows: out 0, lse = sink), one with more used queries
# than keys (causal: rows with no key); the short one's keys (up to 32) take the one-launch backward
# without an lse gradient, which computes delta itself.
SEQUSED_CASES = {
    "causal": (([3, 17, 1, 12, 9], [11, 17, 2, 40, 9], [2, 17, 0, 12, 9], [7, 0, 1, 33, 4]), dict(causal=True),
               True),
    "window softcap, short": (([5, 20, 3, 1], [9, 32, 7, 17], [2, 20, 0, 1], [0, 30, 7, 17]),
                              dict(window_size=(5, 2), softcap=3.0), False),
}


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", SEQUSED_CASES)
def test_sink_with_seqused(backend, case, dtype):
    lens, options, lse_grad = SEQUSED_CASES[case]
    torch.manual_seed(seed_of(case, str(dtype)))
    check_sink_seqused(*lens, (4, 2, 24), dtype, lse_grad=lse_grad, **options)


def test_sink_with_seqused_and_no_key(backend):
    """No key in the whole batch (nothing launched): the used query rows' lse is the sink, whose gradient
    is their lse's summed; the rows past seqused_q keep lse +inf and add nothing (NaN there unread)."""
    q = torch.randn(7, 4, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    sink = torch.randn(4, requires_grad=True)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, q[:0], q[:0], cu_q, cu_k, 4, 0, learnable_sink=sink,
                                                 seqused_q=torch.tensor([1, 4], dtype=torch.int32),
                                                 seqused_k=torch.zeros(2, dtype=torch.int32), return_attn_probs=True)
    used = torch.tensor([True, False, False, True, True, True, True])
    assert not out.any() and torch.isposinf(lse[:, ~used]).all()
    assert torch.equal(lse[:, used], sink.detach()[:, None].expand(4, 5))
    dlse = torch.randn_like(lse).masked_fill(~used, float("nan"))
    lse.backward(dlse)
    assert torch.allclose(sink.grad, dlse[:, used].sum(1))


def test_sink_packed_dense_variants(backend):
    q, k, v, sink, _ = _case("window", torch.float32)
    out = cuflash.flash_attn_func(q, k, v, learnable_sink=sink)
    assert torch.equal(cuflash.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), learnable_sink=sink), out)
    qkv = torch.stack((q, q, q), dim=2)
    assert torch.equal(cuflash.flash_attn_qkvpacked_func(qkv, learnable_sink=sink),
                       cuflash.flash_attn_func(q, q, q, learnable_sink=sink))


DECODE_CASES = {  # nheads, nheads_k, seqlen_q, head_dim, dtype, cache_seqlens, page (0: contiguous), options
    "gqa_causal": (4, 2, 3, 16, torch.float32, [40, 7, 64], 0, dict(causal=True)),
    "paged_window_softcap": (4, 1, 2, 16, torch.float32, [33, 64], 16, dict(causal=True, window_size=(5, 0),
                                                                             softcap=3.0)),
    "fewer_keys_than_queries": (2, 1, 4, 16, torch.float16, [0, 2], 0, dict(causal=True)),
    "paged_pages_of_12": (2, 2, 1, 40, torch.float16, [20, 1, 64], 12, dict()),
}


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_sink_kvcache(backend, case, num_splits):
    """flash_attn_with_kvcache counts the sink once whatever the split count (the kernels: in the combine
    with splits, in the decode kernel without), contiguous and paged caches, new tokens appended; out
    and softmax_lse against the oracle sequence by sequence (rows that see no key: out 0, lse = sink)."""
    nheads, nheads_k, seqlen_q, d, dtype, seqlens, page, options = DECODE_CASES[case]
    torch.manual_seed(seed_of(case, num_splits))
    batch, capacity = len(seqlens), 80
    k_new, v_new = (torch.randn(batch, 2, nheads_k, d, dtype=dtype) for _ in range(2))
    lengths = [n + 2 for n in seqlens]
    keys, values = (torch.randn(sum(lengths), nheads_k, d, dtype=dtype) for _ in range(2))
    cu_k = torch.tensor([0] + lengths).cumsum(0).int()
    for b, n in enumerate(seqlens):  # the appended tokens, as the cache will hold them
        keys[cu_k[b] + n:cu_k[b + 1]], values[cu_k[b] + n:cu_k[b + 1]] = k_new[b], v_new[b]
    if page:  # (its table's last column, past every sequence's pages, is never read)
        k_cache, v_cache, block_table = paged_cache(keys, values, cu_k, page)
    else:
        k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, d, dtype=dtype) for _ in range(2))
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = keys[cu_k[b]:cu_k[b + 1]], values[cu_k[b]:cu_k[b + 1]]
        block_table = None
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    sink = torch.randn(nheads) * 2
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=torch.tensor(seqlens).int(), block_table=block_table,
                                               num_splits=num_splits, return_softmax_lse=True, learnable_sink=sink,
                                               **options)
    for b in range(batch):
        rows = slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None, rows], values[None, rows], learnable_sink=sink,
                                           **options)
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype], b
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-5), b


def test_rows_without_keys_and_a_sink_of_minus_infinity(backend):
    """A row that sees no key has out 0 and lse = sink (finite gradients, the sink's own); a head whose
    sink is -inf computes as without a sink (lse +inf on such rows, its sink's gradient 0)."""
    torch.manual_seed(16)
    q, k, v = make_qkv(1, 30, 20, 2, 2, 16, torch.float32, "cpu")
    sink = torch.tensor([1.5, float("-inf")])
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv, dsink = _grads(functools.partial(_flash, window_size=(0, 0)), (q, k, v, sink), dout,
                                         torch.ones(1, 2, 30))
    assert not out[:, :10].any()  # rows 0..9 see no key (the window lies right of the diagonal)
    assert torch.allclose(lse[0, 0, :10], torch.tensor(1.5)) and torch.isposinf(lse[0, 1, :10]).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv)) and dsink[1] == 0
    plain = cuflash.flash_attn_func(q, k, v, window_size=(0, 0))
    assert torch.equal(out[:, :, 1], plain[:, :, 1])
    ref_sink = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    ref_out, ref_lse = attention_reference(q[:, :, :1].double(), k[:, :, :1].double(), v[:, :, :1].double(),
                                           window_size=(0, 0), learnable_sink=ref_sink)
    torch.autograd.backward((ref_out, ref_lse), (dout[:, :, :1].double(), torch.ones(1, 1, 30, dtype=torch.float64)))
    assert rel_err(dsink[:1], ref_sink.grad) < 1e-5


def test_empty_inputs(backend):
    """No key (seqlen_k 0): out 0, softmax_lse the sink, whose gradient is lse's summed (as FlashAttention-4);
    a head whose sink is -inf has none (lse +inf, as rows that see no key without a sink; gradient 0); no
    query: no gradient. The explicit backward returns the sink's gradient too."""
    q = torch.randn(2, 5, 4, 16)
    empty = torch.randn(2, 0, 2, 16)
    sink = torch.randn(4)
    sink[2] = float("-inf")
    sink.requires_grad_()
    out, lse, _ = cuflash.flash_attn_func(q, empty, empty, learnable_sink=sink, return_attn_probs=True)
    expected = sink.detach()[None, :, None].expand(2, 4, 5).clone()
    expected[:, 2] = float("inf")
    assert not out.any() and torch.equal(lse, expected)
    dlse = torch.randn_like(lse)
    lse.backward(dlse)
    assert torch.allclose(sink.grad, dlse.sum((0, 2)).masked_fill(torch.arange(4) == 2, 0.0))
    none = cuflash.flash_attn_func(q[:, :0], empty, empty, learnable_sink=sink)
    assert none.shape == (2, 0, 4, 16)
    grads = cuflash.backward(q, q, empty, empty, q, lse.detach(), learnable_sink=sink.detach())
    assert len(grads) == 4 and not grads[3].any()


def test_explicit_passes(backend):
    """cuflash.forward with a sink gives flash_attn_func's out and lse; cuflash.backward returns (dq, dk,
    dv, dsink) (FlashAttention-4's backward), autograd's, and a deterministic backward repeats bitwise."""
    q, k, v, sink, options = _case("causal, more keys", torch.float32)
    out, lse = cuflash.forward(q, k, v, learnable_sink=sink, **options)
    dout = torch.randn_like(q)
    auto = _grads(functools.partial(_flash, **options), (q, k, v, sink), dout, None)
    assert torch.equal(out, auto[0]) and torch.equal(lse, auto[1])
    grads = cuflash.backward(dout, q, k, v, out, lse, learnable_sink=sink, deterministic=True, **options)
    assert len(grads) == 4 and all(torch.equal(a, b) for a, b in zip(grads, auto[2:]))
    again = cuflash.backward(dout, q, k, v, out, lse, learnable_sink=sink, deterministic=True, **options)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_gradcheck_fp64():
    """torch.autograd.gradcheck of the CPU path in fp64, the sink among the inputs (and lse an output)."""
    torch.manual_seed(3)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 6, 9, 2, 1, 4, torch.float64, "cpu"))
    sink = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(functools.partial(_flash, causal=True, window_size=(3, 0)), (q, k, v, sink))


def test_custom_ops_and_torch_compile():
    """The custom ops carry the sink (opcheck: schema, fake implementations, autograd registration), and
    flash_attn_func with it compiles fullgraph with the same output and gradients as eagerly."""
    torch.manual_seed(4)
    q, k, v = make_qkv(1, 12, 12, 2, 1, 8, torch.float64, "cpu")
    sink = torch.randn(2, dtype=torch.float64, requires_grad=True)
    params = AttentionParams(0.3, window_right=0, learnable_sink=sink)
    args = (q, k, v, *ops.op_args(params))
    assert all(result == "SUCCESS" for result in torch.library.opcheck(torch.ops.cuflash.fwd.default, args).values())
    out, lse = (t.detach() for t in ops.attention_forward(*args))
    backward_args = (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), *args[3:])
    checks = torch.library.opcheck(torch.ops.cuflash.bwd.default, backward_args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert all(result == "SUCCESS" for result in checks.values())
    def fn(q, k, v, sink):
        out = cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        return out, out  # (_grads' pair: out's gradient only)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    dout = torch.randn_like(q)
    for ours, theirs in zip(_grads(compiled, (q, k, v, sink), dout, None), _grads(fn, (q, k, v, sink), dout, None)):
        assert torch.allclose(ours, theirs, atol=1e-12)


@pytest.mark.parametrize("bad,code", [
    (torch.randn(2), ErrorCode.SHAPE_MISMATCH),  # nheads_k's count, not q's heads
    (torch.randn(1, 4), ErrorCode.SHAPE_MISMATCH),
    (torch.zeros(4, dtype=torch.int32), ErrorCode.UNSUPPORTED_DTYPE),
    ([0.0] * 4, ErrorCode.INVALID_ARGUMENT),
    (torch.randn(4, device="meta"), ErrorCode.DEVICE_MISMATCH),
], ids=["nheads_k", "2d", "int32", "list", "device"])
def test_validation_names_learnable_sink(bad, code):
    q, k, v = make_qkv(1, 5, 5, 4, 2, 16, torch.float32, "cpu")
    calls = [lambda: cuflash.flash_attn_func(q, k, v, learnable_sink=bad),
             lambda: cuflash.flash_attn_varlen_func(q[0], k[0], v[0], *[torch.tensor([0, 5], dtype=torch.int32)] * 2,
                                                    5, 5, learnable_sink=bad),
             lambda: cuflash.flash_attn_with_kvcache(q, k, v, learnable_sink=bad),
             lambda: cuflash.forward(q, k, v, learnable_sink=bad)]
    for call in calls:
        with pytest.raises(FlashAttentionError, match="learnable_sink") as info:
            call()
        assert info.value.code == code


# GPU: 16-bit and fp32 through the Gluon forward (Hopper: plain attention at D=64/128/256) and the Triton one
# (forced; and every option the Gluon kernels do not take), the backward of the table and the deterministic one.
GPU_SHAPES = [(2, 1000, 1000, 8, 2, 128), (1, 517, 1030, 4, 4, 64), (2, 300, 300, 4, 2, 256), (2, 1030, 17, 4, 2, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["table", "triton"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sink_on_gpu(dtype, shape, causal, family, monkeypatch):
    """The table's kernels (on Hopper the Gluon forward where it takes the call, which the test asserts)
    and the Triton forward forced, forward and backward with the lse's gradient, against float64."""
    from attn_testing import force_candidates, table_cell
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import forward as gluon_forward
    torch.manual_seed(seed_of(shape, causal))
    q, k, v = make_qkv(*shape, dtype, "cuda")
    sink = torch.randn(shape[3], device="cuda") * 2
    head_dim, length = shape[-1], max(shape[1], shape[2])
    launched, launch_args = [], gluon_forward.launch_args
    monkeypatch.setattr(gluon_forward, "launch_args", lambda *args: launched.append(args[-1]) or launch_args(*args))
    cell = table_cell(q, head_dim, length, causal)
    # (the table's entry or its Triton forward, in launch plans of their own: every launch builds its arguments)
    force_candidates(monkeypatch, **(dict(forward=cell.forward[-1:]) if family == "triton" else {}))
    # (with lse's gradient or not: without, up to 128 keys, the one-launch backward)
    check_sink(functools.partial(_flash, causal=causal), q, k, v, sink, lse_grad=causal, causal=causal)
    # (the Gluon kernels take head dims 64, 128 and 256: at 96 the table's cell for 128 runs Triton)
    gluon_expected = (family == "table" and torch.cuda.get_device_capability() == (9, 0)
                      and isinstance(cell.forward[0], gluon.Forward) and head_dim in (64, 128, 256))
    assert bool(launched) == gluon_expected


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["window", "softcap_alibi", "dropout", "varlen", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sink_variants_on_gpu(dtype, variant):
    torch.manual_seed(seed_of(variant))
    q, k, v = make_qkv(2, 700, 900, 8, 2, 64, dtype, "cuda")
    sink = torch.randn(8, device="cuda") * 2
    options = dict(window=dict(causal=True, window_size=(256, 0)),
                   softcap_alibi=dict(softcap=20.0, alibi_slopes=torch.rand(8, device="cuda")),
                   deterministic=dict(causal=True)).get(variant, {})
    if variant == "dropout":
        torch.manual_seed(7)
        probs = cuflash.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, learnable_sink=sink,
                                        return_attn_probs=True)[2]

        def dropped(a, b, c, s):
            torch.manual_seed(7)
            return _flash(a, b, c, s, dropout_p=0.2, causal=True)
        check_sink(dropped, q, k, v, sink, causal=True, dropout_p=0.2, dropout_keep=probs >= 0)
    elif variant == "varlen":
        lens_q, lens_k = [300, 1, 0, 517], [400, 0, 33, 1030]
        q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, 64, dtype, "cuda")

        def ours(a, b, c, s):
            out, lse, _ = cuflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 517, 1030, causal=True,
                                                         learnable_sink=s, return_attn_probs=True)
            return out, lse
        check_sink(ours, q, k, v, sink, causal=True,
                   oracle=functools.partial(_varlen_oracle, cu_q=cu_q.tolist(), cu_k=cu_k.tolist()))
    elif variant == "deterministic":
        dout = torch.randn_like(q)
        runs = [_grads(functools.partial(_flash, deterministic=True, **options), (q, k, v, sink), dout, None)
                for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        check_sink(functools.partial(_flash, deterministic=True, **options), q, k, v, sink, **options)
    else:
        check_sink(functools.partial(_flash, **options), q, k, v, sink, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sink_with_seqused_on_gpu(dtype, lse_grad):
    """check_sink_seqused on the compiled kernels (GQA 8:2, head dim 128): sequences of 1 to 1030 rows cut
    by seqused (seqlen_q > and < seqlen_k), one with seqused_k 0, one using every row."""
    torch.manual_seed(50 + lse_grad)
    check_sink_seqused([1, 17, 1000, 300, 513, 64], [5, 17, 1000, 1030, 1030, 1], [1, 9, 1000, 299, 100, 64],
                       [5, 0, 999, 40, 1030, 1], (8, 2, 128), dtype, "cuda", lse_grad=lse_grad, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5, 0])
@pytest.mark.parametrize("paged", [False, True])
def test_sink_decode_on_gpu(paged, num_splits):
    """The decode kernel (one split: the sink in it) and the combine (splits: the sink there), bf16."""
    torch.manual_seed(num_splits + paged)
    lengths = [1000, 3, 4097]
    keys, values = (torch.randn(sum(lengths), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    cu_k = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    if paged:
        k_cache, v_cache, table = paged_cache(keys, values, cu_k, 256)
    else:
        k_cache, v_cache = (torch.zeros(3, 4100, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = keys[cu_k[b]:cu_k[b + 1]], values[cu_k[b]:cu_k[b + 1]]
        table = None
    q = torch.randn(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    sink = torch.randn(8, dtype=torch.bfloat16, device="cuda") * 2
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths).int().cuda(),
                                               block_table=table, num_splits=num_splits, causal=True,
                                               learnable_sink=sink, return_softmax_lse=True)
    for b in range(3):
        rows = slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None, rows], values[None, rows], causal=True,
                                           learnable_sink=sink)
        assert rel_err(out[b:b + 1], ref) < BOUNDS[torch.bfloat16], b
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-4), b
