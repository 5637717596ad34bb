"""flash_attn_with_kvcache on the CPU (blocked path and the Triton kernels through the
interpreter): in-place append, rotary, paged caches, cache_batch_idx, cache_leftpad, against the
float64 oracle computed on the updated cache; bad input leaves the cache untouched."""
import contextlib
import heapq
import os
import subprocess
import sys

import pytest
import torch

import cuflash
from attn_testing import BOUNDS, GPU_DTYPES, count_plan_lookups, interpret, rel_err, rotary_reference, strided_view
from cuflash.reference import attention_reference


def _expected(q, k_seqs, v_seqs, causal, **options):
    """The oracle, sequence by sequence: (B, Sq, H, D) float64."""
    return torch.cat([attention_reference(q[b:b + 1], k_seqs[b][None], v_seqs[b][None], causal=causal,
                                          **options)[0] for b in range(q.shape[0])])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_append_rotary_and_attend(backend, paged, seqlen_q, rotary):
    torch.manual_seed(seqlen_q + 2 * paged)
    batch, nheads, nheads_k, d, page = 3, 4, 2, 32, 16
    cache_seqlens = torch.tensor([5, 0, 37], dtype=torch.int32)
    capacity = 64
    if paged:
        num_blocks = 16
        k_cache = torch.randn(num_blocks, page, nheads_k, d)
        block_table = torch.randperm(num_blocks)[:batch * 4].view(batch, 4).int()
    else:
        k_cache = torch.randn(batch, capacity, nheads_k, d)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads, d)
    k, v = (torch.randn(batch, seqlen_q, nheads_k, d) for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(80, 8) * 6.28
        cos, sin = angles.cos(), angles.sin()

    def logical(cache, b):  # sequence b's positions 0..capacity-1 as a (capacity, Hk, D) tensor
        return cache[block_table[b].long()].flatten(0, 1) if paged else cache[b]

    before_k = [logical(k_cache, b).clone() for b in range(batch)]
    before_v = [logical(v_cache, b).clone() for b in range(batch)]
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=cache_seqlens, block_table=block_table, causal=True,
                                               rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    k_seqs, v_seqs = [], []
    q_ref = q.double()
    for b in range(batch):
        n = int(cache_seqlens[b])
        new_pos = torch.arange(n, n + seqlen_q)[None]
        k_new = rotary_reference(k[b:b + 1], cos, sin, new_pos, rotary == "interleaved")[0] if rotary else k[b].double()
        # the cache now holds the (rotated) new keys right after the old ones, and nothing else changed
        assert torch.allclose(logical(k_cache, b)[n:n + seqlen_q].double(), k_new, atol=1e-6)
        assert torch.equal(logical(v_cache, b)[n:n + seqlen_q], v[b])
        assert torch.equal(logical(k_cache, b)[:n], before_k[b][:n])
        assert torch.equal(logical(k_cache, b)[n + seqlen_q:], before_k[b][n + seqlen_q:])
        assert torch.equal(logical(v_cache, b)[:n], before_v[b][:n])
        k_seqs.append(logical(k_cache, b)[:n + seqlen_q].double())
        v_seqs.append(logical(v_cache, b)[:n + seqlen_q].double())
        if rotary:
            q_ref[b:b + 1] = rotary_reference(q[b:b + 1], cos, sin, new_pos, rotary == "interleaved")
    ref = _expected(q_ref, k_seqs, v_seqs, True)
    assert out.shape == q.shape and lse.shape == (batch, nheads, seqlen_q)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("seqlen_q,window", [(1, (1, 0)), (4, (-1, -1)), (4, (2, 0))])
@pytest.mark.parametrize("page", [0, 8])
def test_appended_tokens_land_whatever_the_split_and_band(backend, page, seqlen_q, window, num_splits):
    """The decode kernel writes the new tokens before it reads them: all of them land, through the
    page table or the cache row, where they straddle splits, outnumber a key tile (20 new keys, the
    interpreter's 16-key tiles), lie outside every query's band (a window of 1 or 2 keys) or are read
    by two query tiles of a GQA group (8 heads x 4 tokens); the output is the oracle's on the updated
    cache."""
    torch.manual_seed(28 + page + seqlen_q + num_splits)
    batch, nheads, nheads_k, d, seqlen_new, capacity = 2, 16, 2, 16, 20, 64
    seqlens = torch.tensor([3, 40], dtype=torch.int32)
    if page:
        k_cache = torch.randn(batch * capacity // page + 2, page, nheads_k, d)
        table = torch.randperm(k_cache.shape[0])[:batch * capacity // page].view(batch, -1).int()
    else:
        k_cache, table = torch.randn(batch, capacity, nheads_k, d), None
    v_cache = torch.randn_like(k_cache)

    def logical(cache, b):
        return cache[table[b].long()].flatten(0, 1) if page else cache[b]

    before = [(logical(k_cache, b).clone(), logical(v_cache, b).clone()) for b in range(batch)]
    q = torch.randn(batch, seqlen_q, nheads, d)
    k, v = (torch.randn(batch, seqlen_new, nheads_k, d) for _ in range(2))
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                          window_size=window, num_splits=num_splits)
    for b, n in enumerate(seqlens.tolist()):
        for cache, new, old in ((k_cache, k[b], before[b][0]), (v_cache, v[b], before[b][1])):
            assert torch.equal(logical(cache, b)[n:n + seqlen_new], new)
            assert torch.equal(logical(cache, b)[:n], old[:n])
            assert torch.equal(logical(cache, b)[n + seqlen_new:], old[n + seqlen_new:])
        keys, values = (logical(c, b)[:n + seqlen_new][None] for c in (k_cache, v_cache))
        ref, _ = attention_reference(q[b:b + 1], keys, values, window_size=window)
        assert rel_err(out[b:b + 1], ref) < 1e-5, b


def test_batch_idx_leftpad_window_and_no_new_tokens(backend):
    torch.manual_seed(3)
    batch_cache, batch, nheads, d = 4, 2, 2, 16
    k_cache, v_cache = (torch.randn(batch_cache, 40, nheads, d) for _ in range(2))
    q = torch.randn(batch, 2, nheads, d)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    seqlens = torch.tensor([30, 9], dtype=torch.int32)
    leftpad = torch.tensor([4, 0], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.1])
    saved = k_cache.clone()
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=idx,
                                         cache_leftpad=leftpad, causal=True, window_size=(10, 0), softcap=5.0,
                                         alibi_slopes=slopes)
    assert torch.equal(k_cache, saved)  # no new tokens: nothing written
    k_seqs = [k_cache[3, 4:30].double(), k_cache[1, :9].double()]
    v_seqs = [v_cache[3, 4:30].double(), v_cache[1, :9].double()]
    ref = _expected(q.double(), k_seqs, v_seqs, True, window_size=(10, 0), softcap=5.0, alibi_slopes=slopes)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("layout", ["heads_first", "every_other_row", "heads_first_paged"])
def test_caches_of_any_strides(backend, layout):
    """A cache given as a view with any strides but the last dim's (a (B, H, S, D) cache transposed,
    as transformers keeps it, or every other cache row) is read and appended to in place: the output
    and the cache equal those of a contiguous cache (flash-attn takes such views)."""
    torch.manual_seed(6)
    batch, nheads, nheads_k, d = 2, 4, 2, 16
    q = torch.randn(batch, 1, nheads, d)
    k, v = (torch.randn(batch, 2, nheads_k, d) for _ in range(2))
    index = dict(cache_seqlens=torch.tensor([5, 13], dtype=torch.int32))
    if layout == "heads_first":
        store = [torch.randn(3, nheads_k, 24, d) for _ in range(2)]  # (rows, Hk, S, D)
        view = lambda t: t.transpose(1, 2)  # noqa: E731
        index["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
    elif layout == "every_other_row":
        store = [torch.randn(6, 24, nheads_k, d) for _ in range(2)]
        view = lambda t: t[::2]  # noqa: E731
    else:
        store = [torch.randn(6, nheads_k, 8, d) for _ in range(2)]  # (pages, Hk, page size, D)
        view = lambda t: t.transpose(1, 2)  # noqa: E731
        index["block_table"] = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    strided = [view(t.clone()) for t in store]
    contiguous = [view(t.clone()).contiguous() for t in store]
    assert not strided[0].is_contiguous()
    outs = [cuflash.flash_attn_with_kvcache(q, *caches, k, v, causal=True, **index) for caches in (strided, contiguous)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    for a, b in zip(strided, contiguous):
        assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True])
def test_strided_index_tensors(backend, paged):
    """cache_seqlens, cache_batch_idx, cache_leftpad and block_table given as strided views give the
    output and the cache of contiguous ones (the kernels address them by position)."""
    torch.manual_seed(5)
    batch, nheads, d = 2, 2, 16
    q, k, v = torch.randn(batch, 1, nheads, d), torch.randn(batch, 2, nheads, d), torch.randn(batch, 2, nheads, d)
    index = dict(cache_seqlens=torch.tensor([5, 13], dtype=torch.int32))
    if paged:
        caches = [torch.randn(6, 8, nheads, d) for _ in range(2)]
        index["block_table"] = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    else:
        caches = [torch.randn(3, 24, nheads, d) for _ in range(2)]
        index.update(cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
                     cache_leftpad=torch.tensor([1, 3], dtype=torch.int32))
    results = []
    for make in (lambda t: t, strided_view):
        k_cache, v_cache = (c.clone() for c in caches)
        out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True,
                                             **{name: make(t) for name, t in index.items()})
        results.append((out, k_cache, v_cache))
    assert all(not strided_view(t).is_contiguous() for t in index.values())
    for contiguous, strided in zip(*results):
        assert torch.equal(contiguous, strided)


@pytest.mark.parametrize("layout", ["leftpad", "batch_idx_leftpad", "paged"])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_positions_count_from_the_cache_row_start(backend, layout, mask, interleaved):
    """Rotary with cache_leftpad (or a paged cache), GQA, causal/local/none: new key i of sequence b
    is rotated at position cache_seqlens[b] + i counted from the start of the cache row, whatever
    the left padding (flash-attn's convention); queries at cache_seqlens[b] + i when causal or
    local, else all at cache_seqlens[b]. The oracle rotates with complex numbers itself."""
    torch.manual_seed(["leftpad", "batch_idx_leftpad", "paged"].index(layout) + 3 * interleaved)
    batch, seqlen_q, nheads, nheads_k, d, rotary_dim, page = 2, 3, 4, 2, 32, 16, 8
    seqlens = torch.tensor([21, 9], dtype=torch.int32)
    leftpad = None if layout == "paged" else torch.tensor([6, 4], dtype=torch.int32)
    rows = torch.tensor([2, 0], dtype=torch.int32) if layout == "batch_idx_leftpad" else None
    if layout == "paged":
        k_cache = torch.randn(9, page, nheads_k, d)
        block_table = torch.tensor([[7, 1, 4, 0], [2, 8, 5, 3]], dtype=torch.int32)
    else:
        k_cache = torch.randn(3, 32, nheads_k, d)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads, d)
    k, v = (torch.randn(batch, seqlen_q, nheads_k, d) for _ in range(2))
    angles = torch.rand(40, rotary_dim // 2) * 6.28
    cos, sin = angles.cos(), angles.sin()
    options = dict(causal=mask == "causal", window_size=(6, 1) if mask == "local" else (-1, -1))
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=seqlens, cache_batch_idx=rows, cache_leftpad=leftpad,
                                         block_table=block_table, rotary_interleaved=interleaved, **options)
    q_ref, k_seqs, v_seqs = q.double().clone(), [], []
    for b in range(batch):
        n, start = int(seqlens[b]), 0 if leftpad is None else int(leftpad[b])
        row = k_cache[block_table[b].long()].flatten(0, 1) if block_table is not None else \
            k_cache[b if rows is None else int(rows[b])]
        v_row = v_cache[block_table[b].long()].flatten(0, 1) if block_table is not None else \
            v_cache[b if rows is None else int(rows[b])]
        new_pos = torch.arange(n, n + seqlen_q)[None]
        k_new = rotary_reference(k[b:b + 1], cos, sin, new_pos, interleaved)[0]
        assert torch.allclose(row[n:n + seqlen_q].double(), k_new, atol=1e-6)
        q_pos = new_pos if mask != "none" else torch.full((1, seqlen_q), n)
        q_ref[b:b + 1] = rotary_reference(q[b:b + 1], cos, sin, q_pos, interleaved)
        k_seqs.append(row[start:n + seqlen_q].double())
        v_seqs.append(v_row[start:n + seqlen_q].double())
    assert rel_err(out, _expected(q_ref, k_seqs, v_seqs, **options)) < 1e-5


# (nheads, nheads_k, seqlen_q, head_dim, dtype, cache_seqlens, page size (0: contiguous), options):
# GQA groups whose packed rows span several query tiles, window + ALiBi per (batch, head) + softcap
# on a paged cache, an odd head dim in fp16, sequences with fewer keys than queries (rows that see
# nothing), pages that key tiles straddle (12) or of one key each.
SPLIT_CASES = {
    "gqa_rows_over_tiles": (8, 1, 3, 32, torch.float32, [50, 17], 0, dict(causal=True)),
    "window_alibi_softcap_paged": (4, 2, 2, 16, torch.float32, [33, 64], 16,
                                   dict(causal=True, window_size=(7, 0), softcap=3.0, alibi=True)),
    "hdim40_fp16": (2, 2, 1, 40, torch.float16, [100, 3], 0, dict()),
    "hdim320_paged": (2, 1, 2, 320, torch.float32, [40, 7], 16, dict(causal=True)),
    "fewer_keys_than_queries": (2, 1, 4, 16, torch.float32, [0, 2], 0, dict(causal=True)),
    # enough sequences x KV heads to fill the interpreter's 4 "SMs": pages read without prefetch
    "pages_of_12_grid_full": (4, 4, 1, 16, torch.float32, [20, 1, 64, 40], 12, dict(causal=True)),
    "pages_of_1": (2, 2, 1, 16, torch.float32, [9, 30], 1, dict()),
}


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_splits_and_gqa_packing_against_oracle(backend, case, num_splits):
    """out and softmax_lse of every split count (the combine step) against the float64 oracle,
    sequence by sequence; rows that see no key give out 0 and lse +inf."""
    nheads, nheads_k, seqlen_q, d, dtype, seqlens, page, options = SPLIT_CASES[case]
    torch.manual_seed(len(case) + num_splits)
    batch, capacity = len(seqlens), 64
    if page:
        pages = -(-capacity // page)
        k_cache = torch.randn(batch * pages + 3, page, nheads_k, d, dtype=dtype)
        block_table = torch.randperm(batch * pages + 3)[:batch * pages].view(batch, pages).int()
    else:
        k_cache = torch.randn(batch, capacity + 48, nheads_k, d, dtype=dtype)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    slopes = torch.rand(batch, nheads) if options.pop("alibi", False) else None
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(seqlens).int(),
                                               block_table=block_table, alibi_slopes=slopes, num_splits=num_splits,
                                               return_softmax_lse=True, **options)
    for b, n in enumerate(seqlens):
        keys = (k_cache[block_table[b].long()].flatten(0, 1) if page else k_cache[b])[:n]
        values = (v_cache[block_table[b].long()].flatten(0, 1) if page else v_cache[b])[:n]
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None], values[None],
                                           alibi_slopes=None if slopes is None else slopes[b], **options)
        assert rel_err(out[b:b + 1], ref) < (1e-5 if dtype == torch.float32 else 5e-3), b
        seen = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isinf(lse[b]), ~seen) and (lse[b][~seen] > 0).all()
        assert torch.allclose(lse[b][seen].double(), ref_lse[0][seen], atol=1e-5)
        assert (out[b].transpose(0, 1)[~seen] == 0).all()


def test_decode_matches_full_attention(backend, monkeypatch):
    """Token by token decoding through the cache gives causal attention over the whole sequence; the
    kernels keep one launch plan for the whole loop (the int cache_seqlens is an argument of it)."""
    from cuflash.kernels import launch
    monkeypatch.setattr(launch, "PLANS", {})
    torch.manual_seed(4)
    n, nheads, d = 12, 2, 16
    q, k, v = (torch.randn(1, n, nheads, d) for _ in range(3))
    k_cache, v_cache = (torch.zeros(1, 16, nheads, d) for _ in range(2))
    outs = [cuflash.flash_attn_with_kvcache(q[:, i:i + 1], k_cache, v_cache, k[:, i:i + 1], v[:, i:i + 1],
                                            cache_seqlens=i, causal=True) for i in range(n)]
    assert len(launch.PLANS) == (1 if backend == "triton" else 0)
    full = cuflash.flash_attn_func(q, k, v, causal=True)
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)


@interpret
def test_decode_steps_launch_their_signature_plans_directly(monkeypatch):
    """flash_attn_with_kvcache keeps the launch plans of the decode and of its value checks per checked
    call signature: a later step launches them without launch()'s lookup and still appends and
    attends right, on new data and new lengths, with the splits' partial results made anew; a query
    off 16-byte alignment or an int cache_seqlens (an argument of its own plans) looks them up."""
    from cuflash.kernels import attention

    looked_up = count_plan_lookups(monkeypatch, attention)
    torch.manual_seed(27)
    k_cache, v_cache = (torch.randn(9, 8, 2, 16) for _ in range(2))
    table = torch.tensor([[4, 0, 7, 1], [2, 8, 5, 3]], dtype=torch.int32)

    def step(seqlens, q=None):
        q = torch.randn(2, 1, 4, 16) if q is None else q
        k, v = (torch.randn(2, 1, 2, 16) for _ in range(2))
        out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                              num_splits=3)
        lengths = [seqlens] * 2 if isinstance(seqlens, int) else seqlens.tolist()
        for b, n in enumerate(lengths):
            keys, values = (c[table[b].long()].flatten(0, 1)[:n + 1] for c in (k_cache, v_cache))
            assert torch.equal(keys[-1], k[b, 0]) and torch.equal(values[-1], v[b, 0])
            assert rel_err(out[b:b + 1], attention_reference(q[b:b + 1], keys[None], values[None])[0]) < 1e-5
        found = list(looked_up)
        looked_up.clear()
        return found

    assert step(torch.tensor([3, 20], dtype=torch.int32)) == ["decode_forward"]  # (the kernel checks the values)
    assert step(torch.tensor([9, 30], dtype=torch.int32)) == []
    shifted = torch.empty(2 * 4 * 16 + 1)[1:].view(2, 1, 4, 16).normal_()  # 4 bytes past 16-byte alignment
    assert step(torch.tensor([10, 1], dtype=torch.int32), shifted) == ["decode_forward"]
    assert step(torch.tensor([11, 2], dtype=torch.int32), shifted) == []
    assert step(12) == ["decode_forward"]
    assert step(13) == []


def _call(**overrides):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(2, 32, 2, 16), v_cache=torch.randn(2, 32, 2, 16),
                k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
                cache_seqlens=torch.tensor([3, 31], dtype=torch.int32))
    args.update(overrides)
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    saved = (k_cache.clone(), v_cache.clone())
    with pytest.raises(cuflash.FlashAttentionError) as info:
        cuflash.flash_attn_with_kvcache(**args)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1]), "the cache must stay untouched"
    return info.value


@pytest.mark.parametrize("overrides,code,word", [
    (dict(cache_seqlens=torch.tensor([3, 32], dtype=torch.int32)), "INVALID_ARGUMENT", "must fit"),
    (dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), "INVALID_ARGUMENT", "must fit"),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),  # a used page at -1
          block_table=torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
          cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), "INVALID_ARGUMENT", "block_table"),
    (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_batch_idx"),
    (dict(cache_batch_idx=torch.tensor([-1, 0])), "INVALID_ARGUMENT", "cache_batch_idx"),
    (dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_leftpad"),
    (dict(cache_seqlens=torch.tensor([3, 31])), "UNSUPPORTED_DTYPE", "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), "SHAPE_MISMATCH", "cache_seqlens"),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),  # sequence 0 reaches page 9
          block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32),
          cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), "INVALID_ARGUMENT", "block_table"),
    (dict(k=torch.randn(2, 1, 2, 16).half()), "DTYPE_MISMATCH", "k"),
    (dict(v=None), "INVALID_ARGUMENT", "both k and v"),
    (dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_batch_idx"),
    (dict(cache_leftpad=torch.tensor([5, 0], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_leftpad"),
    (dict(rotary_cos=torch.ones(8, 8), rotary_sin=torch.zeros(8, 8)), "INVALID_ARGUMENT", "rotary_cos"),
    (dict(rotary_cos=torch.ones(40, 12), rotary_sin=torch.zeros(40, 12)), "SHAPE_MISMATCH", "rotary"),
    (dict(k_cache=torch.randn(2, 32, 2, 32)[..., ::2]), "NOT_CONTIGUOUS", "k_cache"),
    (dict(num_splits=-1), "INVALID_ARGUMENT", "num_splits"),
    (dict(k_cache=torch.randn(1, 32, 2, 16), v_cache=torch.randn(1, 32, 2, 16)), "SHAPE_MISMATCH", "cache rows"),
    (dict(v_cache=torch.randn(2, 32, 16)), "INVALID_DIMENSION", "v_cache"),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),
          block_table=torch.zeros(2, 0, dtype=torch.int32)), "EMPTY_TENSOR", "block_table"),
])
def test_bad_input_leaves_the_cache_untouched(backend, overrides, code, word):
    err = _call(**overrides)
    assert err.code.name == code and word in str(err), str(err)


def _index_case(name: str) -> dict:
    """A decode step's index arguments, bad in the way `name` says (or valid): cache_seqlens,
    cache_leftpad, cache_batch_idx `rows` of `cache_rows`, block_table, seqlen_new new tokens,
    rotary_end (the largest cache_seqlens rotary tables would cover), a window."""
    i32 = dict(dtype=torch.int32)
    case = dict(seqlens=torch.tensor([3, 31, 0], **i32), seqlen_new=1, leftpad=None, rows=None, cache_rows=3,
                table=None, rows_per_seq=32, rotary_end=None, window=(-1, -1))
    if name == "seqlens":  # the new token past the end, a negative length
        case.update(seqlens=torch.tensor([3, 32, -1], **i32))
    elif name == "leftpad":
        case.update(seqlens=torch.tensor([5, 9, 7], **i32), leftpad=torch.tensor([0, 10, 7], **i32))
    elif name == "rows":
        case.update(rows=torch.tensor([2, -1, 5], **i32), cache_rows=4, seqlens=torch.tensor([4, 5, 6], **i32))
    elif name == "repeated_rows":  # new tokens written into one row by two sequences
        case.update(rows=torch.tensor([1, 3, 1], **i32), cache_rows=4)
    elif name == "shared_rows_read_only":  # valid: no new token written
        case.update(rows=torch.tensor([1, 1, 0], **i32), cache_rows=4, seqlen_new=0,
                    seqlens=torch.tensor([3, 31, 5], **i32))
    elif name == "rotary":
        case.update(seqlens=torch.tensor([3, 20, 10], **i32), rotary_end=10)
    elif name == "pages":  # sequence 0 uses page 1 alone (the rest may hold anything); 1 and 2 use bad pages
        case.update(rows_per_seq=8, cache_rows=10, seqlens=torch.tensor([5, 20, 30], **i32),
                    table=torch.tensor([[1, 99, -7, 42], [-3, 3, 7, 55], [4, 5, 6, 12]], **i32))
    elif name == "pages_left_of_the_window":  # a bad page no key tile of the window reads
        case.update(rows_per_seq=16, cache_rows=14, seqlens=torch.tensor([90, 40], **i32), window=(4, 0),
                    table=torch.tensor([[99, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], **i32))
    elif name == "pages_past_a_chunk":  # one-position pages: the kernel checks the table 1024 entries at a time
        table = torch.arange(1500, **i32).view(1, 1500).flip(1).contiguous()
        table[0, 1300] = 1500
        case.update(rows_per_seq=1, cache_rows=1500, seqlens=torch.tensor([1400], **i32), table=table)
    else:
        assert name == "valid"
    return case


def _violations_by_hand(c: dict) -> dict:
    """{IndexKind: {(sequence, value)}} of a case's bad index values, sequence by sequence in plain
    Python, and the bound each kind's message names."""
    from cuflash.cache import IndexKind
    lengths, rows = c["seqlens"].tolist(), c["rows"].tolist() if c["rows"] is not None else None
    capacity = c["rows_per_seq"] * (c["table"].shape[1] if c["table"] is not None else 1)
    found: dict = {}
    for b, n in enumerate(lengths):
        bad = []
        if not 0 <= n <= capacity - c["seqlen_new"]:
            bad.append((IndexKind.SEQLENS, n))
        if c["leftpad"] is not None and not 0 <= c["leftpad"][b] <= n:
            bad.append((IndexKind.LEFTPAD, int(c["leftpad"][b])))
        if rows is not None and not 0 <= rows[b] < c["cache_rows"]:
            bad.append((IndexKind.ROWS, rows[b]))
        if rows is not None and c["seqlen_new"] and rows.count(rows[b]) > 1:
            bad.append((IndexKind.REPEATED, rows[b]))
        if c["rotary_end"] is not None and n > c["rotary_end"]:
            bad.append((IndexKind.ROTARY, n))
        if c["table"] is not None:
            bad += [(IndexKind.PAGES, page) for p, page in enumerate(c["table"][b].tolist())
                    if p * c["rows_per_seq"] < n + c["seqlen_new"] and not 0 <= page < c["cache_rows"]]
        for kind, value in bad:
            found.setdefault(kind, set()).add((b, value))
    bounds = {IndexKind.SEQLENS: capacity - c["seqlen_new"], IndexKind.ROWS: c["cache_rows"],
              IndexKind.ROTARY: c["rotary_end"], IndexKind.PAGES: c["cache_rows"]}
    return {kind: (pairs, bounds.get(kind, 0)) for kind, pairs in found.items()}


INDEX_CASES = ["valid", "seqlens", "leftpad", "rows", "repeated_rows", "shared_rows_read_only", "rotary", "pages",
               "pages_left_of_the_window", "pages_past_a_chunk"]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_host_index_checks_name_the_first_bad_value(case):
    """cache.index_violation (the host's check where the values are on the CPU): the first kind of
    cache.IndexKind with a bad value, its first sequence, the value and the bound, by hand."""
    c = _index_case(case)
    expected = _violations_by_hand(c)
    got = cuflash.cache.index_violation(c["seqlens"], c["seqlen_new"], c["leftpad"], c["rows"], c["cache_rows"],
                                      c["table"], c["rows_per_seq"], c["seqlen_new"] > 0, c["rotary_end"])
    if not expected:
        assert got is None
        return
    kind = min(expected)
    pairs, bound = expected[kind]
    assert got == (kind, *min(pairs), bound)


@pytest.fixture
def deferred():
    """Decode errors in "defer" mode for the test (cuflash.set_decode_errors), restored after it."""
    previous = cuflash.set_decode_errors("defer")
    yield
    cuflash.set_decode_errors(previous)


def check_kernel_index_checks(case: str, device: str, dtype: torch.dtype, num_splits: int, mode: str):
    """The decode kernel checks the index values it reads (kernels.decode_forward, no host check
    before it): every sequence with a bad value writes nothing through the value, the others are
    appended. mode "raise": the call raises the first kind's error for one of its sequences;
    "defer": it returns, the bad sequences NaN and the others right, and raise_decode_errors raises
    that error, naming the step. Then nothing is left to raise."""
    from cuflash.cache import index_error
    from cuflash.params import AttentionParams
    c = _index_case(case)
    expected = _violations_by_hand(c)
    with contextlib.suppress(cuflash.FlashAttentionError):  # what a failed test left
        cuflash.raise_decode_errors()
    torch.manual_seed(31)
    batch, seqlen_new, rps = c["seqlens"].shape[0], c["seqlen_new"], c["rows_per_seq"]
    blocks = c["cache_rows"] if c["table"] is not None or c["rows"] is not None else batch
    k_cache, v_cache = (torch.randn(blocks, rps, 2, 16, dtype=dtype, device=device) for _ in range(2))
    q = torch.randn(batch, 1, 4, 16, dtype=dtype, device=device)
    k_new, v_new = ((torch.randn(batch, seqlen_new, 2, 16, dtype=dtype, device=device) for _ in range(2))
                    if seqlen_new else (None, None))
    index = {name: None if c[name] is None else c[name].to(device) for name in ("seqlens", "leftpad", "rows", "table")}
    saved = (k_cache.clone(), v_cache.clone())
    params = AttentionParams(16 ** -0.5, c["window"][0], c["window"][1])
    previous = cuflash.set_decode_errors(mode)
    try:
        with pytest.raises(cuflash.FlashAttentionError) if expected and mode == "raise" else \
                contextlib.nullcontext() as raised:
            out, lse = cuflash.kernels.decode_forward(q, k_cache, v_cache, index["seqlens"], seqlen_new,
                                                      index["leftpad"], index["rows"], index["table"], params,
                                                      num_splits, k_new, v_new, rotary_end=c["rotary_end"])
    finally:
        cuflash.set_decode_errors(previous)
    if device == "cuda":
        torch.cuda.synchronize()
    bad_by = {kind.name: {b for b, _ in pairs} for kind, (pairs, _) in expected.items()}
    bad = set().union(*bad_by.values())
    # A sequence bad by its pages alone may write a new token through a good page (a split whose
    # share of the keys holds no bad page writes its part).
    may_write = bad_by.get("PAGES", set()) - set().union(*(seqs for name, seqs in bad_by.items() if name != "PAGES"))

    def place(b, pos):  # (block, slot) of position pos of sequence b, or None through a bad page
        if c["table"] is None:
            return (b if c["rows"] is None else int(c["rows"][b])), pos
        page = int(c["table"][b, pos // rps])
        return (page, pos % rps) if 0 <= page < c["cache_rows"] else None

    for cache, old, new in ((k_cache, saved[0], k_new), (v_cache, saved[1], v_new)):
        want = old.clone()
        for b in range(batch) if seqlen_new else ():
            for j in range(seqlen_new):
                at = place(b, int(c["seqlens"][b]) + j)
                if b not in bad or (b in may_write and at is not None and torch.equal(cache[at], new[b, j])):
                    want[at] = new[b, j]
        assert torch.equal(cache, want), "the cache holds the new tokens of the valid sequences, nothing else"
    if expected:
        kind = min(expected)
        pairs, bound = expected[kind]
        if mode == "defer":
            cuflash.raise_decode_errors("cpu" if device == "cuda" else "cuda")  # another device's record: nothing
            with pytest.raises(cuflash.FlashAttentionError) as raised:
                cuflash.raise_decode_errors(device)
        message = str(raised.value)
        assert any(index_error(kind, b, value, bound) in message for b, value in pairs), message
        assert message.startswith("[INVALID_ARGUMENT] decode step ") and f" on {device}" in message, message
        assert ("output and softmax_lse are NaN" in message) == (mode == "defer"), message  # (raise: no output)
    cuflash.raise_decode_errors()  # nothing left
    if mode == "raise" and expected:
        return
    for b in range(batch):
        if b in bad:
            assert out[b].isnan().all() and lse[b].isnan().all(), b
            continue
        first = 0 if c["leftpad"] is None else int(c["leftpad"][b])
        at = [place(b, pos) for pos in range(first, int(c["seqlens"][b]) + seqlen_new)]
        keys, values = (torch.stack([cache[a] for a in at])[None].double() for cache in (k_cache, v_cache))
        ref, _ = attention_reference(q[b:b + 1].double(), keys, values, window_size=c["window"])
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype], b


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("mode", ["raise", "defer"])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("case", INDEX_CASES)
def test_kernel_index_checks(case, num_splits, mode):
    check_kernel_index_checks(case, "cpu", torch.float32, num_splits, mode)


def _bad_then_good_steps(device: str, dtype: torch.dtype):
    """Two decode steps through the kernels (kernels.decode_forward) on one cache: the first with
    cache_seqlens[1] = 9 past its 8 positions, the second valid."""
    from cuflash.params import AttentionParams
    k_cache, v_cache = (torch.randn(2, 8, 1, 16, dtype=dtype, device=device) for _ in range(2))
    q = torch.randn(2, 1, 1, 16, dtype=dtype, device=device)

    def step(lengths):
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        return cuflash.kernels.decode_forward(q, k_cache, v_cache, seqlens, 0, None, None, None, AttentionParams(0.25))
    return lambda: step([2, 9]), lambda: step([2, 8])


def check_deferred_errors_name_their_step(device: str, dtype: torch.dtype):
    """Deferred: the bad step returns; a step that raises its own errors (the default mode) does not
    raise the deferred one; the next deferred step does, naming the bad step's number; and then
    nothing is left."""
    from cuflash.cache import last_decode_step
    bad, good = _bad_then_good_steps(device, dtype)
    previous = cuflash.set_decode_errors("defer")
    try:
        out, _ = bad()
        bad_step = last_decode_step()
        if device == "cuda":
            torch.cuda.synchronize()
        assert out[1].isnan().all() and not out[0].isnan().any()
        cuflash.set_decode_errors("raise")
        assert not good()[0].isnan().any()  # a valid step in the raising mode: not another step's error
        cuflash.set_decode_errors("defer")
        with pytest.raises(cuflash.FlashAttentionError, match=r"cache_seqlens\[1\] = 9") as info:
            good()
        good()  # raised once
        cuflash.raise_decode_errors()
    finally:
        cuflash.set_decode_errors(previous)
    where = out.device  # (cuda:0, not cuda)
    assert str(info.value).startswith(f"[INVALID_ARGUMENT] decode step {bad_step} on {where} read"), str(info.value)
    assert last_decode_step() == bad_step + 3


@interpret
@pytest.mark.interpret
def test_deferred_errors_name_their_step():
    check_deferred_errors_name_their_step("cpu", torch.float32)


@interpret
@pytest.mark.interpret
def test_a_step_raises_its_own_bad_value_by_default():
    """The default mode: the bad step raises, the next one runs."""
    bad, good = _bad_then_good_steps("cpu", torch.float32)
    with pytest.raises(cuflash.FlashAttentionError, match=r"cache_seqlens\[1\] = 9"):
        bad()
    assert not good()[0].isnan().any()
    cuflash.raise_decode_errors()


@interpret
@pytest.mark.interpret
def test_index_errors_at_once_under_cuda_launch_blocking(monkeypatch, deferred):
    """Deferred, with CUDA_LAUNCH_BLOCKING=1 (the kernel done when its launch returns) the step
    raises its own bad value."""
    from cuflash.kernels import attention
    monkeypatch.setattr(attention, "LAUNCH_BLOCKING", True)
    bad, _ = _bad_then_good_steps("cpu", torch.float32)
    with pytest.raises(cuflash.FlashAttentionError, match=r"cache_seqlens\[1\] = 9"):
        bad()
    cuflash.raise_decode_errors()  # raised once


def test_decode_error_modes_are_checked():
    with pytest.raises(cuflash.FlashAttentionError, match="mode must be one of 'raise', 'defer', got 'later'"):
        cuflash.set_decode_errors("later")
    assert cuflash.set_decode_errors("raise") == "raise"


def test_layout_checks_run_once_per_signature(monkeypatch):
    """A decode step whose shapes, dtypes, devices, strides and options passed the checks is not
    checked for them again (memo.py); any part of the signature that differs is, and the values of
    the index tensors are checked on every call."""
    from cuflash import kvcache, memo

    memo.CHECKED.clear()
    layouts = []
    real = kvcache.check_attention_inputs

    def counting(q, k, v, names):
        if names[1] == "k_cache":  # the layout checks' comparison of q with the cache (k, v come after it)
            layouts.append(1)
        real(q, k, v, names)
    monkeypatch.setattr(kvcache, "check_attention_inputs", counting)

    def step(**overrides):
        args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.zeros(2, 32, 2, 16), v_cache=torch.zeros(2, 32, 2, 16),
                    k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
                    cache_seqlens=torch.tensor([3, 30], dtype=torch.int32), causal=True)
        args.update(overrides)
        return cuflash.flash_attn_with_kvcache(**args)

    step()
    step()
    assert len(layouts) == 1
    step(cache_seqlens=5)  # an int instead of a tensor
    step(cache_seqlens=6)
    assert len(layouts) == 2
    with pytest.raises(cuflash.FlashAttentionError, match="must fit"):  # values: every call
        step(cache_seqlens=torch.tensor([3, 32], dtype=torch.int32))
    for bad, word in ((dict(k=torch.randn(2, 1, 2, 16).double()), "k"),
                      (dict(cache_seqlens=torch.tensor([3, 31])), "cache_seqlens"),  # int64
                      (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), "cache_leftpad"),
                      (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int16)), "cache_batch_idx"),
                      (dict(v_cache=torch.zeros(2, 32, 2, 32)[..., ::2]), "v_cache"),  # strides
                      (dict(window_size=(-2, 0)), "window_size"),
                      (dict(num_splits=-1), "num_splits"),
                      (dict(softcap=-1.0), "softcap")):
        with pytest.raises(cuflash.FlashAttentionError, match=word):
            step(**bad)
    monkeypatch.setenv("CUFLASH_BACKEND", "fastest")
    with pytest.raises(cuflash.FlashAttentionError, match="CUFLASH_BACKEND"):
        step()


@pytest.mark.parametrize("flag", ["causal", "rotary_interleaved"])
def test_flags_are_bools(flag):
    """causal="yes" or rotary_interleaved=1 raise naming the flag, before the cache is touched."""
    k_cache, v_cache = (torch.zeros(1, 8, 1, 16) for _ in range(2))
    cos = torch.ones(8, 4)
    with pytest.raises(cuflash.FlashAttentionError, match=f"{flag} must be a bool"):
        cuflash.flash_attn_with_kvcache(torch.randn(1, 1, 1, 16), k_cache, v_cache, torch.ones(1, 1, 1, 16),
                                        torch.ones(1, 1, 1, 16), rotary_cos=cos, rotary_sin=cos * 0,
                                        cache_seqlens=2, **{flag: "yes" if flag == "causal" else 1})
    assert not k_cache.any()


def test_outgrowing_the_block_table_raises_runtime_error_naming_it():
    """flash-attn's paged-cache test expects a RuntimeError matching "block_table" when a sequence
    outgrows its block table; code written for it catches that."""
    k_cache, v_cache = (torch.randn(6, 16, 2, 16) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # 32 positions per sequence
    with pytest.raises(RuntimeError, match="block_table"):
        cuflash.flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), k_cache, v_cache, torch.randn(2, 1, 2, 16),
                                        torch.randn(2, 1, 2, 16), cache_seqlens=torch.tensor([31, 32]).int(),
                                        block_table=table)


def test_unused_block_table_entries_are_not_read(backend):
    """Entries past a sequence's last page may hold anything (flash-attn's contract too)."""
    torch.manual_seed(8)
    k_cache, v_cache = (torch.randn(4, 16, 1, 16) for _ in range(2))
    table = torch.tensor([[2, 99]], dtype=torch.int32)
    q = torch.randn(1, 1, 1, 16)
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, block_table=table)
    ref, _ = attention_reference(q, k_cache[2:3, :10], v_cache[2:3, :10])
    assert rel_err(out, ref) < 1e-5


def _makespan(programs: int, tiles: int, splits: int, sms: int) -> int:
    """Key tiles read by the busiest SM when each of `programs` sequences' `tiles` are split as the
    decode kernel splits them (whole tiles, cdiv(tiles, splits) a split, the last one short or empty)
    and the programs, in launch order, go to whichever SM has read least so far."""
    per_split = -(-tiles // splits)
    shares = [max(0, min(per_split, tiles - s * per_split)) for s in range(splits)]
    loads = [(0, i) for i in range(sms)]
    for _ in range(programs):
        for share in shares:
            load, i = heapq.heappop(loads)
            heapq.heappush(loads, (load + share, i))
    return max(loads)[0]


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("tiles", [32, 256, 2048])
def test_split_heuristic_loads_the_sms_evenly(sms, tiles):
    """The split count the decode launch takes unasked: with programs fewer than two an SM, the busiest
    SM reads within 1 / WAVE_EFFICIENCY of an even share of the tiles, or as little as any split count
    gets it to; the count never exceeds MAX_SPLITS or the tiles, and a GPU full of programs reads unsplit."""
    from cuflash.kernels.plan import MAX_SPLITS, WAVE_EFFICIENCY, even_splits
    for programs in [*range(1, 40), *range(40, 2 * sms + 40, 5)]:
        splits = even_splits(programs, tiles, sms)
        assert 1 <= splits <= min(MAX_SPLITS, tiles)
        if programs >= 2 * sms:
            assert splits == 1
            continue
        makespan = _makespan(programs, tiles, splits, sms)
        if makespan > programs * tiles / sms / WAVE_EFFICIENCY:
            best = min(_makespan(programs, tiles, s, sms) for s in range(1, min(MAX_SPLITS, tiles) + 1))
            assert makespan == best, (programs, splits)
    assert even_splits(64, 512, sms, fewest=5) >= 5


def _kv_caches(layout, batch, capacity, nheads_k, d, dtype):
    """k_cache, v_cache and block_table (None when contiguous) holding `capacity` keys per sequence;
    a layout ending in _heads_first stores each cache as (rows, nheads_k, positions, d), transposed."""
    layout, heads_first = layout.removesuffix("_heads_first"), layout.endswith("_heads_first")

    def cache(rows, positions):
        if heads_first:
            return torch.randn(rows, nheads_k, positions, d, dtype=dtype, device="cuda").transpose(1, 2)
        return torch.randn(rows, positions, nheads_k, d, dtype=dtype, device="cuda")
    if layout == "contiguous":
        return cache(batch, capacity), cache(batch, capacity), None
    page = int(layout[5:])
    blocks = batch * capacity // page + 3
    table = torch.randperm(blocks, device="cuda")[:batch * capacity // page].view(batch, -1).int()
    return cache(blocks, page), cache(blocks, page), table


def _cached(cache, table, b, n):
    return (cache[table[b].long()].flatten(0, 1) if table is not None else cache[b])[:n]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("layout", ["contiguous", "paged256", "paged16", "contiguous_heads_first"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_kvcache_on_gpu(dtype, seqlen_q, layout, num_splits):
    """Appending seqlen_q tokens per sequence and attending (GQA 32/8, D=128) equals attention over
    the updated cache, output and softmax_lse, for every split count."""
    torch.manual_seed(24)
    batch, nheads, nheads_k, d = 4, 32, 8, 128
    seqlens = torch.tensor([0, 700, 4096 - seqlen_q, 255], dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = _kv_caches(layout, batch, 4096, nheads_k, d, dtype)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, seqlen_q, nheads_k, d, dtype=dtype, device="cuda") for _ in range(2))
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=num_splits, return_softmax_lse=True)
    for b in range(batch):
        n = int(seqlens[b]) + seqlen_q
        keys, values = _cached(k_cache, table, b, n), _cached(v_cache, table, b, n)
        assert torch.equal(keys[-seqlen_q:], k[b]) and torch.equal(values[-seqlen_q:], v[b])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None], values[None], causal=True)
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype]
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,nheads,nheads_k,d,dtype,layout", [
    (40, 32, 8, 128, torch.bfloat16, "contiguous"),  # fills the GPU unsplit: the 128-key tiles
    (40, 32, 8, 128, torch.float16, "paged16"),
    (3, 8, 8, 256, torch.float16, "paged256"),
    (3, 8, 2, 512, torch.bfloat16, "paged16"),  # head dims 257-512: 32-row tiles in 8 warps
    (2, 4, 4, 320, torch.float32, "contiguous"),
    (2, 12, 4, 40, torch.float32, "contiguous"),
    (5, 16, 2, 64, torch.bfloat16, "paged1"),  # a page per key
    (8, 32, 8, 128, torch.bfloat16, "contiguous_heads_first"),  # transformers' cache layout, transposed
    (8, 16, 4, 64, torch.float16, "paged16_heads_first"),
])
def test_kvcache_launches_on_gpu(batch, nheads, nheads_k, d, dtype, layout):
    """Each launch configuration of the decode kernel (tile per head dim, dtype, layout, grid size)
    against the oracle, on sequences of random lengths."""
    torch.manual_seed(batch + d)
    k_cache, v_cache, table = _kv_caches(layout, batch, 1024, nheads_k, d, dtype)
    seqlens = torch.randint(1, 1025, (batch,), dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    for b in range(batch):
        n = int(seqlens[b])
        keys, values = _cached(k_cache, table, b, n), _cached(v_cache, table, b, n)
        ref, _ = attention_reference(q[b:b + 1], keys[None], values[None])
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype], b


@pytest.mark.gpu
def test_kvcache_decode_step_in_a_cuda_graph():
    """A decode step captured once and replayed with new cache_seqlens values gives what eager calls
    give; replayed with a bad one, that sequence comes out NaN, the other right, and
    raise_decode_errors names the value."""
    torch.manual_seed(25)
    batch, nheads, nheads_k, d = 2, 16, 4, 64
    k_cache, v_cache, table = _kv_caches("paged16", batch, 1024, nheads_k, d, torch.bfloat16)
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, 1, nheads_k, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([10, 500], dtype=torch.int32, device="cuda")

    def step():
        return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                               causal=True)
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in ([11, 501], [1000, 3]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        assert torch.equal(captured, step())
    seqlens.copy_(torch.tensor([2000, 4], dtype=torch.int32))  # past the 1024 positions of sequence 0's pages
    saved = k_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert captured[0].isnan().all() and not captured[1].isnan().any()
    written = _cached(k_cache, table, 1, 5)[4]
    assert torch.equal(written, k[1, 0])
    assert (k_cache != saved).sum() == written.numel(), "only sequence 1's new key is written"
    seqlens.copy_(torch.tensor([5, 6], dtype=torch.int32))
    assert not step().isnan().any(), "an eager step does not raise the replayed step's error"
    with pytest.raises(cuflash.FlashAttentionError, match=r"replayed from a CUDA graph\) .*cache_seqlens\[0\] = 2000"):
        cuflash.raise_decode_errors()
    graph.replay()
    assert torch.equal(captured, step())


@pytest.mark.gpu
def test_bad_index_values_raise_at_their_own_step_on_gpu():
    """By default a decode step with a bad index value raises it itself (after one wait for the
    GPU), and the next step runs; a step without index tensors does not wait."""
    torch.manual_seed(26)
    k_cache, v_cache = (torch.randn(3, 64, 2, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    q = torch.randn(3, 1, 4, 64, dtype=torch.float16, device="cuda")

    def step(lengths):
        return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                               cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    with pytest.raises(cuflash.FlashAttentionError, match=r"cache_seqlens\[1\] = 65"):
        step([10, 65, 30])
    out = step([10, 20, 30])
    for b, n in ((0, 10), (1, 20), (2, 30)):
        ref, _ = attention_reference(q[b:b + 1].double(), k_cache[b:b + 1, :n].double(), v_cache[b:b + 1, :n].double())
        assert rel_err(out[b:b + 1], ref) < BOUNDS[torch.float16]
    cuflash.raise_decode_errors()


@pytest.mark.gpu
def test_deferred_errors_name_their_step_on_gpu():
    check_deferred_errors_name_their_step("cuda", torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("overflow", ["cache", "appended"])
def test_paged_cache_outgrowing_its_block_table_raises_at_the_call_on_gpu(overflow):
    """flash-attn's paged guard (its test_flash_attn_kvcache_paged_block_table_bounds): cache_seqlens,
    or the keys appended to a full cache, past block_table's columns x page size raise RuntimeError
    naming block_table at the call, which writes nothing through the bad sequence; the next call runs."""
    torch.manual_seed(27)
    page, columns = 16, 2
    k_cache, v_cache = (torch.randn(6, page, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    capacity = page * columns
    lengths = [3, capacity + 5] if overflow == "cache" else [3, capacity]  # one new key past a full cache
    saved = k_cache.clone()
    with pytest.raises(RuntimeError, match="block_table"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table,
                                        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    assert torch.equal(k_cache[2:], saved[2:]), "nothing written through sequence 1's pages"
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                          cache_seqlens=torch.tensor([4, capacity], dtype=torch.int32, device="cuda"))
    assert not out.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", INDEX_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["raise", "defer"])
def test_kernel_index_checks_on_gpu(case, dtype, mode):
    check_kernel_index_checks(case, "cuda", dtype, 0, mode)


@pytest.mark.gpu
def test_index_errors_at_once_under_cuda_launch_blocking_on_gpu():
    """CUDA_LAUNCH_BLOCKING=1 (a process of its own): the bad step itself raises, deferred too."""
    script = ("import torch, cuflash\n"
              "cuflash.set_decode_errors('defer')\n"
              "k = torch.randn(2, 8, 1, 16, device='cuda', dtype=torch.float16)\n"
              "try:\n"
              "    cuflash.flash_attn_with_kvcache(torch.randn(2, 1, 1, 16, device='cuda', dtype=torch.float16), k, k,"
              " cache_seqlens=torch.tensor([2, 9], dtype=torch.int32, device='cuda'))\n"
              "except cuflash.FlashAttentionError as e:\n"
              "    print(e)\n")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "cache_seqlens[1] = 9" in run.stdout, run.stdout + run.stderr
