"""score_mod / mask_mod on flash_attn_func and flash_attn_varlen_func (FlashAttention-4's form: flash-attn
layout, b the batch or sequence index, h the query head, positions from 0 within each sequence) and
attention_chunk (FlashAttention-3's chunked local attention, a built-in mask_mod), against a float64
oracle that applies each mod elementwise, one sequence at a time."""
import math

import pytest
import torch

import cuflash
from cuflash import ErrorCode, FlashAttentionError

from attn_testing import paged_cache, rel_err, seed_of, varlen_batch

BOUND = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
GPU_BOUND = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def taken(backend: str, dtype: torch.dtype) -> torch.dtype:
    """dtype, where the backend computes in it (the kernels take no float64: those cases skip)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the kernels take float16, bfloat16 and float32")
    return dtype


def oracle(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None,
           mask_mod=None, attention_chunk=0, first_batch=0):
    """float64 flash-attn attention of q (B, Nq, H, D), k, v (B, Nk, Hk, D) with the mods applied to the
    materialized scores, b counted from first_batch: out (B, Nq, H, D), lse (B, H, Nq) (+inf where a row
    sees no key) and the probabilities (B, H, Nq, Nk). The chunk is written as FlashAttention-3's
    reference writes it: keys [p - p mod chunk, p - p mod chunk + chunk) for a query at key position p."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bmhd,bnhd->bhmn", q, k) * head_dim ** -0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    b = torch.arange(first_batch, first_batch + batch, dtype=torch.int32, device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, dtype=torch.int32, device=q.device).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, dtype=torch.int32, device=q.device)[:, None]
    j = torch.arange(seqlen_k, dtype=torch.int32, device=q.device)[None, :]
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    position = i + seqlen_k - seqlen_q  # flash-attn's bottom-right alignment
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.double().view(1, -1, 1, 1) * (position - j).abs()
    left, right = window_size[0], 0 if causal else window_size[1]
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        seen = seen & (j <= position + right)
    if left >= 0:
        seen = seen & (j >= position - left)
    if attention_chunk:
        start = position - position % attention_chunk
        seen = seen & (j >= start) & (j < start + attention_chunk)
    if mask_mod is not None:
        seen = seen & mask_mod(b, h, i, j)
    scores = scores.masked_fill(~seen, -math.inf)
    empty = (scores == -math.inf).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    lse = scores.detach().logsumexp(-1)
    return torch.einsum("bhmn,bnhd->bmhd", probs, v), lse.masked_fill(lse == -math.inf, math.inf), probs


def varlen_oracle(q, k, v, cu_q, cu_k, **options):
    """The oracle one sequence at a time (b its index): out (total_q, H, D) and lse (H, total_q)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out, lse, _ = oracle(q[None, rows_q], k[None, rows_k], v[None, rows_k], first_batch=b, **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def inputs(shape_q, shape_k, dtype, device="cpu", *key):
    torch.manual_seed(seed_of(shape_q, shape_k, dtype, *key))
    return (torch.randn(shape_q, dtype=dtype, device=device), torch.randn(shape_k, dtype=dtype, device=device),
            torch.randn(shape_k, dtype=dtype, device=device))


def check(fn, ref_fn, tensors, bound, extra=()):
    """fn(*tensors) (and its gradients, for the tensors and the `extra` captured tensors that require grad)
    against ref_fn on float64 copies (ref_fn(tensors, extras) -> out)."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in tensors]
    ref_extra = [t.detach().double().requires_grad_() for t in extra]
    ref = ref_fn(ref_leaves, ref_extra)
    ref.backward(dout.double())
    assert rel_err(out.detach(), ref) < bound, f"out: {rel_err(out.detach(), ref):.3g}"
    for name, ours, theirs in zip(("dq", "dk", "dv", "captured"), [*leaves, *extra], [*ref_leaves, *ref_extra]):
        assert ours.grad.dtype == ours.dtype
        assert rel_err(ours.grad, theirs.grad) < bound, f"{name}: {rel_err(ours.grad, theirs.grad):.3g}"


# The mods, as a FlashAttention-4 / Flex user writes them; factories take what they capture, so that the
# oracle makes them again over float64 copies.

def relative_bias(table, seqlen_k):  # (H, Nq + Nk - 1): a learnable bias per query head and distance
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k - 1]
    return score_mod


def stripes(b, h, q_idx, kv_idx):  # reads b, h and both positions; keeps key 0 seen
    return ((q_idx + kv_idx + h + b) % 3 != 0) | (kv_idx == 0)


def prefix_lm(prefix):  # (batch,) int32: the keys every query of sequence b sees
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)
    return mask_mod


SCORE_OPTIONS = {
    "plain": {},
    "causal_softcap_deterministic": dict(causal=True, softcap=2.0, deterministic=True),
    "window_alibi": dict(window_size=(6, 3), alibi_slopes=torch.tensor([0.3, 0.1, 0.05, 0.2])),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", SCORE_OPTIONS)
def test_score_mod_learnable_bias(backend, options, dtype):
    """A relative-position bias table that requires grad gets the oracle's gradient, with q, k, v's;
    the score_mod sees the logits after softcap and before ALiBi, GQA heads as the query head."""
    q, k, v = inputs((2, 23, 4, 16), (2, 31, 2, 16), taken(backend, dtype), "cpu", options)
    table = torch.randn(4, 23 + 31 - 1, dtype=dtype, requires_grad=True)
    kwargs = SCORE_OPTIONS[options]
    oracle_kwargs = {name: value for name, value in kwargs.items() if name != "deterministic"}
    check(lambda *t: cuflash.flash_attn_func(*t, **kwargs, score_mod=relative_bias(table, 31)),
          lambda t, extra: oracle(*t, **oracle_kwargs, score_mod=relative_bias(extra[0], 31))[0],
          (q, k, v), BOUND[dtype], extra=(table,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lengths", [(19, 27), (27, 11)])
def test_mask_mod_with_bottom_right_causal(backend, lengths, dtype):
    """A mask_mod on top of causal with seqlen_q != seqlen_k (bottom-right; with more queries than keys
    the first rows see no key: 0 and lse +inf), GQA, the kv-packed form and the probabilities
    return_attn_probs gives."""
    seqlen_q, seqlen_k = lengths
    q, k, v = inputs((2, seqlen_q, 6, 16), (2, seqlen_k, 2, 16), taken(backend, dtype), "cpu", lengths)
    check(lambda *t: cuflash.flash_attn_func(*t, causal=True, mask_mod=stripes),
          lambda t, _: oracle(*t, causal=True, mask_mod=stripes)[0], (q, k, v), BOUND[dtype])
    out, lse, probs = cuflash.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), causal=True, mask_mod=stripes,
                                                       return_attn_probs=True)
    ref, ref_lse, ref_probs = oracle(q, k, v, causal=True, mask_mod=stripes)
    assert rel_err(out, ref) < BOUND[dtype] and rel_err(probs, ref_probs) < 1e-6  # (computed in fp32)
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and rel_err(lse[lse.isfinite()], ref_lse[lse.isfinite()]) < 1e-6
    assert lse.isinf().any() == (seqlen_q > seqlen_k)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_varlen_mods_see_each_sequence(backend, dtype):
    """Varlen: b is the sequence's index (a prefix length per sequence) and q_idx / kv_idx count from 0
    in every sequence; with a score_mod whose table requires grad, and the packed form."""
    lens_q, lens_k = [5, 17, 1, 9], [9, 17, 12, 4]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, 16, taken(backend, dtype), "cpu")
    prefix = torch.tensor([3, 0, 7, 2], dtype=torch.int32)
    table = torch.randn(4, 17 + 17 - 1, dtype=dtype, requires_grad=True)
    cu = (cu_q.tolist(), cu_k.tolist())
    check(lambda *t: cuflash.flash_attn_varlen_func(*t, cu_q, cu_k, 17, 17, mask_mod=prefix_lm(prefix),
                                                    score_mod=relative_bias(table, 17)),
          lambda t, extra: varlen_oracle(*t, *cu, mask_mod=prefix_lm(prefix),
                                         score_mod=relative_bias(extra[0], 17))[0],
          (q, k, v), BOUND[dtype], extra=(table,))
    same_lens = [7, 12, 3]
    q, k, v, cu, _ = varlen_batch(same_lens, same_lens, 2, 2, 16, dtype, "cpu")
    packed = cuflash.flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), 1), cu, 12, causal=True,
                                                      mask_mod=prefix_lm(prefix))
    assert rel_err(packed, varlen_oracle(q, k, v, cu.tolist(), cu.tolist(), causal=True,
                                         mask_mod=prefix_lm(prefix))[0]) < BOUND[dtype]


CHUNK_CASES = {  # (seqlen_q, seqlen_k, attention_chunk, options)
    "bidirectional": (30, 30, 8, {}),
    "causal_more_keys": (21, 37, 10, dict(causal=True)),
    "causal_more_queries": (37, 21, 6, dict(causal=True)),
    "window": (30, 41, 12, dict(window_size=(4, 2))),
    "causal_window_mask_mod": (26, 26, 9, dict(causal=True, window_size=(5, -1), mask_mod=stripes)),
    "chunk_beyond_keys": (9, 13, 1000, dict(causal=True)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_attention_chunk(backend, case, dtype):
    """FlashAttention-3's attention_chunk: chunks of keys, queries placed bottom-right among them, alone
    (each query sees its whole chunk), within causal, a window and a user's mask_mod; forward and
    backward."""
    seqlen_q, seqlen_k, chunk, options = CHUNK_CASES[case]
    q, k, v = inputs((2, seqlen_q, 4, 16), (2, seqlen_k, 2, 16), taken(backend, dtype), "cpu", case)
    check(lambda *t: cuflash.flash_attn_func(*t, attention_chunk=chunk, **options),
          lambda t, _: oracle(*t, attention_chunk=chunk, **options)[0], (q, k, v), BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_chunk_varlen(backend, dtype):
    """Varlen: each sequence's chunks start at its first key, its queries placed bottom-right in it."""
    lens_q, lens_k = [5, 17, 14, 9], [9, 17, 6, 20]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, 16, taken(backend, dtype), "cpu")
    cu = (cu_q.tolist(), cu_k.tolist())
    for chunk, options in ((4, dict(causal=True)), (7, {})):
        check(lambda *t: cuflash.flash_attn_varlen_func(*t, cu_q, cu_k, 17, 20, attention_chunk=chunk, **options),
              lambda t, _: varlen_oracle(*t, *cu, attention_chunk=chunk, **options)[0], (q, k, v), BOUND[dtype])


def test_paged_varlen_with_mods(backend):
    """A paged K/V cache (forward only) with a mask_mod and attention_chunk."""
    lens_q, lens_k = [3, 8, 1], [11, 8, 20]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, 16, torch.float32, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page=16)
    prefix = torch.tensor([2, 5, 0], dtype=torch.int32)
    out = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 8, 20, block_table=table, causal=True,
                                         attention_chunk=5, mask_mod=prefix_lm(prefix))
    ref, _ = varlen_oracle(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True, attention_chunk=5,
                           mask_mod=prefix_lm(prefix))
    assert rel_err(out, ref) < 1e-5


def test_dropout_with_mods(backend):
    """Dropout on top of the mods: the output is the kept probabilities (return_attn_probs, dropped ones
    negated, from the same call) times V, and those probabilities are the oracle's."""
    q, k, v = inputs((2, 20, 4, 16), (2, 24, 2, 16), torch.float32)
    table = torch.randn(4, 20 + 24 - 1)
    out, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, score_mod=relative_bias(table, 24),
                                            attention_chunk=8, return_attn_probs=True)
    _, _, ref_probs = oracle(q, k, v, causal=True, score_mod=relative_bias(table.double(), 24), attention_chunk=8)
    assert (probs < 0).any() and rel_err(probs.abs(), ref_probs) < 1e-5
    kept = probs.clamp(min=0).double() / 0.7
    expected = torch.einsum("bhmn,bnhd->bmhd", kept, v.double().repeat_interleave(2, 2))
    assert rel_err(out, expected) < 1e-5


def test_memo_never_serves_a_call_with_mods(backend):
    """flash_attn_func remembers the checked options of plain calls per signature (memo.py): a call of the
    same signature with mods gets its own, and the plain call's stay as they were."""
    q, k, v = inputs((1, 16, 2, 16), (1, 16, 2, 16), torch.float32)
    plain = cuflash.flash_attn_func(q, k, v, causal=True)
    masked = cuflash.flash_attn_func(q, k, v, causal=True, mask_mod=stripes)
    chunked = cuflash.flash_attn_func(q, k, v, causal=True, attention_chunk=5)
    assert rel_err(masked, oracle(q, k, v, causal=True, mask_mod=stripes)[0]) < 1e-5
    assert rel_err(chunked, oracle(q, k, v, causal=True, attention_chunk=5)[0]) < 1e-5
    assert torch.equal(cuflash.flash_attn_func(q, k, v, causal=True), plain)


def test_bad_arguments():
    q = torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    table = torch.randn(2, 10)

    def int_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 4]
    cases = [
        (dict(score_mod=stripes), ErrorCode.UNSUPPORTED_FEATURE, "score_mod 'stripes' failed .*5 were given"),
        (dict(mask_mod=relative_bias(table, 8)), ErrorCode.UNSUPPORTED_FEATURE, "mask_mod .*score_mod.* failed"),
        (dict(mask_mod=int_mask), ErrorCode.UNSUPPORTED_FEATURE, "mask_mod '.*int_mask' returns a torch.int32"),
        (dict(mask_mod=3), ErrorCode.INVALID_ARGUMENT, "mask_mod must be a function, got int"),
        (dict(score_mod="bias"), ErrorCode.INVALID_ARGUMENT, "score_mod must be a function, got str"),
        (dict(score_mod=relative), ErrorCode.INVALID_ARGUMENT, "'.*relative' indexes dimension 1 .* from -3 to 11"),
        (dict(score_mod=relative_bias(table.to("meta"), 8)), ErrorCode.DEVICE_MISMATCH, "captures a tensor on meta"),
        (dict(attention_chunk=-1), ErrorCode.INVALID_ARGUMENT, r"attention_chunk must be an int from 0 \(off\)"),
        (dict(attention_chunk=4.0), ErrorCode.INVALID_ARGUMENT, "attention_chunk must be an int.*got 4.0"),
        (dict(attention_chunk=True), ErrorCode.INVALID_ARGUMENT, "attention_chunk must be an int.*got True"),
        (dict(attention_chunk=2**31), ErrorCode.INVALID_ARGUMENT, "attention_chunk must be an int .* 2147483647"),
    ]
    for options, code, message in cases:
        with pytest.raises(FlashAttentionError, match=message) as error:
            cuflash.flash_attn_func(q, q, q, **options)
        assert error.value.code == code
        with pytest.raises(FlashAttentionError, match=message):  # (varlen bounds: max_seqlen_q and _k)
            cuflash.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, **options)


def test_mods_refused_under_torch_func():
    """The custom ops have no functorch rules: torch.func, which goes through them, says so (torch.compile
    takes the mods: test_flex_compile.py)."""
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(FlashAttentionError, match="not supported under torch.func transforms"):
        torch.func.grad(lambda x: cuflash.flash_attn_func(x, q, q, mask_mod=stripes).sum())(q)
    compiled = torch.compile(lambda x: cuflash.flash_attn_func(x, x, x, attention_chunk=4), backend="eager")
    assert torch.equal(compiled(q), cuflash.flash_attn_func(q, q, q, attention_chunk=4))


# The GPU kernels in 16-bit (the interpreter has no bf16 dot): the same features, larger shapes.

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_mods_on_gpu(dtype):
    q, k, v = inputs((2, 300, 8, 128), (2, 517, 2, 128), dtype, "cuda")
    table = torch.randn(8, 300 + 517 - 1, device="cuda", requires_grad=True)
    check(lambda *t: cuflash.flash_attn_func(*t, causal=True, softcap=20.0, score_mod=relative_bias(table, 517),
                                             mask_mod=stripes),
          lambda t, extra: oracle(*t, causal=True, softcap=20.0, score_mod=relative_bias(extra[0], 517),
                                  mask_mod=stripes)[0], (q, k, v), GPU_BOUND[dtype], extra=(table,))
    for case in ("causal_more_queries", "window", "causal_window_mask_mod"):
        seqlen_q, seqlen_k, chunk, options = CHUNK_CASES[case]
        q, k, v = inputs((2, 8 * seqlen_q, 4, 64), (2, 8 * seqlen_k, 2, 64), dtype, "cuda", case)
        check(lambda *t: cuflash.flash_attn_func(*t, attention_chunk=8 * chunk, **options),
              lambda t, _: oracle(*t, attention_chunk=8 * chunk, **options)[0], (q, k, v), GPU_BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_mods_on_gpu(dtype):
    lens_q, lens_k = [50, 170, 1, 300], [90, 170, 120, 40]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, 64, dtype, "cuda")
    prefix = torch.tensor([30, 0, 70, 20], dtype=torch.int32, device="cuda")
    cu = (cu_q.tolist(), cu_k.tolist())
    check(lambda *t: cuflash.flash_attn_varlen_func(*t, cu_q, cu_k, 300, 170, mask_mod=prefix_lm(prefix),
                                                    attention_chunk=64, causal=True),
          lambda t, _: varlen_oracle(*t, *cu, mask_mod=prefix_lm(prefix), attention_chunk=64, causal=True)[0],
          (q, k, v), GPU_BOUND[dtype])
