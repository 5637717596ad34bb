"""Decoding: a few query tokens attending to a long KV cache, read in place ("flash-decoding").

Decoding is bound by memory bandwidth: each cached K/V byte must be read once, with every SM
busy even at batch 1. A program owns one KV head of one sequence together with every query row
that reads it (seqlen_q tokens x the nheads / nheads_k query heads of the GQA group, packed into
one tile, so a K/V tile is loaded once for the whole group), and one split of the sequence's keys.
Splits write their normalized output and log-sum-exp to fp32 partial buffers that a small combine
kernel merges; with one split the kernel writes the result directly. A step's new keys and values
are written into the cache by the programs that read them, before their loop (one launch less).
The launch (tiles, split count, page prefetch) is plan.py's select_decode; attention.py's
decode_forward allocates the outputs and launches launches().

Keys are addressed by position, through the page table of a paged cache or the cache row of the
sequence, so nothing is gathered or copied before the kernel, and no value (sequence lengths,
pages) is read to the host: the launch can be captured in a CUDA graph, and a decode loop never
need not wait for the GPU. The kernel checks those values itself before it reads or writes through
them: a program whose sequence holds a bad one (or, paged, whose share of the sequence's pages
does) reads and writes nothing, the sequence's rows come out NaN, and the value is left in the
step's record (cache.DecodeStep, pinned host memory), which the step itself or a later one raises
(cache.py says which).
"""

import torch
import triton
import triton.language as tl

from ...cache import RECORD_WORDS, IndexKind
from ...params import AttentionParams
from ..constants import LN2, LOG2E, NO_MASK
from ..device import cdiv, next_power_of_2, padded_head_dim
from ..launch import workspace
from ..variant import fast_math, logit_scale
from .mods import forward_function, kernel_args
from . import DecodeLaunch
from .common import mma, score_tile, sink_state, softmax_step

# The decode kernel's optional tensor arguments (the index tensors first, then the new keys and values
# to append), in the launch's tensors only when given.
OPTIONAL_TENSORS = ("CacheSeqlens", "Leftpad", "CacheRows", "BlockTable", "KNew", "VNew")
# cache.IndexKind, as the kernel names them
_SEQLENS, _LEFTPAD, _ROWS, _REPEATED, _ROTARY, _PAGES = (tl.constexpr(int(kind)) for kind in IndexKind)


_WORDS = tl.constexpr(RECORD_WORDS)


@triton.jit
def _report(Errors, step, kind: tl.constexpr, seq, value, bound, bad):
    """Leaves a bad index value (a scalar, or each of a block's where `bad`) in the step's record
    (cache.DecodeStep): sequence + 1 and the value (as int32) packed in one int64, so that programs
    or lanes reporting at once leave one pair whole, then the bound and the step's number."""
    value = tl.minimum(tl.maximum(value.to(tl.int64), -2**31), 2**31 - 1)
    at = Errors + _WORDS * kind + value * 0
    tl.store(at, ((seq.to(tl.int64) + 1) << 32) | (value & 0xFFFFFFFF), mask=bad)
    tl.store(at + 1, bound + value * 0, mask=bad)
    tl.store(at + 2, step + value * 0, mask=bad)


@triton.jit
def _pages_ok(Errors, step, table, lo, hi, rows_per_seq, cache_blocks, seq, BLOCK_P: tl.constexpr,
              CHUNKS: tl.constexpr):
    """Whether the page-table entries of key positions lo .. hi - 1 (at most CHUNKS * BLOCK_P of
    them) all lie in the cache; reports those that do not. Unrolled, with one reduction: a runtime
    loop here slows the decode loop after it (docs/tuning.md)."""
    first = lo // rows_per_seq
    end = tl.where(hi > lo, tl.cdiv(hi, rows_per_seq), first)
    outside = tl.zeros([BLOCK_P], dtype=tl.int32)
    for c in tl.static_range(CHUNKS):
        p = first + c * BLOCK_P + tl.arange(0, BLOCK_P)
        used = p < end
        page = tl.load(table + p, mask=used, other=0)
        bad = used & ((page < 0) | (page >= cache_blocks))
        _report(Errors, step, _PAGES, seq, page, cache_blocks, bad)
        outside = tl.maximum(outside, bad.to(tl.int32))
    return tl.max(outside, 0) == 0


@triton.jit
def _repeated_row(CacheRows, row, off_b, batch, BLOCK_B: tl.constexpr, BATCH_CHUNKS: tl.constexpr):
    """Whether another sequence of the batch has the cache row `row` of sequence off_b too (two
    sequences would write one row). Unrolled, with one reduction, as _pages_ok."""
    shared = tl.zeros([BLOCK_B], dtype=tl.int32)
    for c in tl.static_range(BATCH_CHUNKS):
        others = c * BLOCK_B + tl.arange(0, BLOCK_B)
        rows = tl.load(CacheRows + others, mask=others < batch, other=-1).to(tl.int64)
        shared = tl.maximum(shared, ((rows == row) & (others != off_b)).to(tl.int32))
    return tl.max(shared, 0) > 0


@triton.jit
def _sequence_ok(Errors, step, CacheRows, off_b, first, end, row, batch, seqlens_max, cache_blocks, rotary_end,
                 BLOCK_B: tl.constexpr, BATCH_CHUNKS: tl.constexpr, SEQLENS: tl.constexpr, LEFTPAD: tl.constexpr,
                 BATCH_IDX: tl.constexpr, APPEND: tl.constexpr, ROTARY: tl.constexpr):
    """Whether the index values of sequence off_b are good (its pages aside: _pages_ok): its
    cache_seqlens `end` (an int one was checked by the host), leftpad `first`, cache row (one that
    no other sequence appends to) and `end` within the rotary tables; reports those that are not."""
    ok = (end >= 0) & (end <= seqlens_max)
    if SEQLENS:
        _report(Errors, step, _SEQLENS, off_b, end, seqlens_max, ~ok)
    if LEFTPAD:
        pad_ok = (first >= 0) & (first <= end)
        _report(Errors, step, _LEFTPAD, off_b, first, 0, ~pad_ok)
        ok = ok & pad_ok
    if BATCH_IDX:
        cache_row_ok = (row >= 0) & (row < cache_blocks)
        _report(Errors, step, _ROWS, off_b, row, cache_blocks, ~cache_row_ok)
        ok = ok & cache_row_ok
        if APPEND:
            repeated = _repeated_row(CacheRows, row, off_b, batch, BLOCK_B, BATCH_CHUNKS)
            _report(Errors, step, _REPEATED, off_b, row, 0, repeated)
            ok = ok & ~repeated
    if ROTARY:
        rotary_ok = end <= rotary_end
        _report(Errors, step, _ROTARY, off_b, end, rotary_end, ~rotary_ok)
        ok = ok & rotary_ok
    return ok


@triton.jit
def _key_slots(table, row, first, cols, used, rows_per_seq, PAGED: tl.constexpr):
    """(block, slot) of key positions `cols` (where `used`) in the cache's first two dims: (page,
    slot in the page) through the sequence's page table, else (the sequence's cache row, position)."""
    if PAGED:
        block = tl.load(table + cols // rows_per_seq, mask=used, other=0).to(tl.int64)
        slot = (cols % rows_per_seq).to(tl.int64)
    else:
        block = row
        slot = (first + cols).to(tl.int64)
    return block, slot


@triton.jit
def _append(K, V, KNew, VNew, table, row, first, lo, hi, seqlen_k, seqlen_new, off_b, off_hk, offs_n, dims,
            rows_per_seq, stride_k, stride_v, stride_kn, stride_vn, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Writes the new tokens (keys seqlen_k - seqlen_new ..) among key positions lo .. hi - 1 into
    the cache, this KV head's, and makes them visible to all the program's threads. dims: the column
    indices of the head dims of K and of V and where each is inside it, (offs_d, d_ok, offs_dv, dv_ok)."""
    offs_d, d_ok, offs_dv, dv_ok = dims
    for start_n in range(tl.maximum(lo, seqlen_k - seqlen_new), hi, BLOCK_N):
        cols = start_n + offs_n
        token = cols - (seqlen_k - seqlen_new)
        block, slot = _key_slots(table, row, first, cols, cols < hi, rows_per_seq, PAGED)
        new_ok = (cols < hi)[:, None] & d_ok[None, :]
        k_new = tl.load(KNew + off_b * stride_kn[0] + token[:, None] * stride_kn[1] + off_hk * stride_kn[2]
                        + offs_d[None, :], mask=new_ok)
        tl.store(K + (block * stride_k[0] + slot * stride_k[1])[:, None] + off_hk * stride_k[2] + offs_d[None, :],
                 k_new, mask=new_ok)
        new_ok = (cols < hi)[:, None] & dv_ok[None, :]
        v_new = tl.load(VNew + off_b * stride_vn[0] + token[:, None] * stride_vn[1] + off_hk * stride_vn[2]
                        + offs_dv[None, :], mask=new_ok)
        tl.store(V + (block * stride_v[0] + slot * stride_v[1])[:, None] + off_hk * stride_v[2] + offs_dv[None, :],
                 v_new, mask=new_ok)
    tl.debug_barrier()


@triton.jit
def _attend(Q, K, V, Sink, head, q, table, row, first, lo, hi, tok, off_hk, offs_n, dims, rows_per_seq, seqlen_q,
            offset, window_left, window_right, qk_scale, mods, stride_k, stride_v, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
            SCORE_MOD: tl.constexpr):
    """The online softmax of the tile's queries q over key positions lo .. hi - 1 of the cache:
    returns the running max m_i and sum l_i (base 2) and the unnormalized output acc. The score_mod
    (softcap's and ALiBi's, builtin_mods.py) sees each query at its key position (token + offset) and
    each key at its position in the sequence; mods = (batch, each row's head, the mod's arguments); dims:
    as _append's. Sink: the learnable sink where this program counts it (launches()), seen first by each
    row of its row's head (`head`)."""
    offs_d, d_ok, offs_dv, dv_ok = dims
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if Sink is not None:
        m_i, l_i = sink_state(Sink, head, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if PAGED and PREFETCH_PAGES:
        # The page of each key read one tile ahead: with splits (few programs per SM) a K/V address
        # waiting on a table read of the same iteration stalls the loop; with the GPU full of
        # unsplit sequences the prefetch costs instead (docs/tuning.md).
        page = tl.load(table + (lo + offs_n) // rows_per_seq, mask=lo + offs_n < hi, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        if PAGED and PREFETCH_PAGES:
            block = page.to(tl.int64)
            page = tl.load(table + (cols + BLOCK_N) // rows_per_seq, mask=cols + BLOCK_N < hi, other=0)
            slot = (cols % rows_per_seq).to(tl.int64)
        else:
            block, slot = _key_slots(table, row, first, cols, col_ok, rows_per_seq, PAGED)
        k_off = block * stride_k[0] + slot * stride_k[1]
        k = tl.load(K + k_off[:, None] + off_hk * stride_k[2] + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0)
        x = mma(q, tl.trans(k), None, INPUT_PRECISION) * qk_scale
        if SCORE_MOD is not None:
            x = SCORE_MOD(x, mods[0], mods[1], tok[:, None] + offset, cols[None, :], mods[2]) * LOG2E
        s = score_tile(x, tok[:, None], cols[None, :], (seqlen_q, hi, 0, offset, window_left, window_right),
                       (Q, 0, 0), True, HAS_LEFT, HAS_RIGHT, NO_MASK)
        m_new, p, alpha, l_i = softmax_step(s, m_i, l_i, True)
        v_off = block * stride_v[0] + slot * stride_v[1]
        v = tl.load(V + v_off[:, None] + off_hk * stride_v[2] + offs_dv[None, :],
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _write(OutPart, LsePart, m_i, l_i, acc, ok, split, off_b, tok, head, row_ok, offs_dv, dv_ok, stride_o, stride_l,
           SPLIT: tl.constexpr):
    """Normalizes the tile's output and writes it and its log-sum-exp (the split's partial result
    with SPLIT): a row that saw no key has out 0 and lse +inf (as the other kernels), or -inf in a
    partial result so that the combine gives it weight 0; a sequence with a bad index value has NaN
    (also through the combine: it weighs every split)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    empty = float("-inf") if SPLIT else float("inf")
    lse = tl.where(l_i == 0.0, empty, (m_i + tl.math.log2(l_safe)) * LN2)
    out = acc / l_safe[:, None]
    lse = tl.where(ok, lse, float("nan"))
    out = tl.where(ok, out, float("nan"))
    o_ptrs = OutPart + split * stride_o[0] + off_b * stride_o[1] + tok[:, None] * stride_o[2] \
        + head[:, None] * stride_o[3]
    tl.store(o_ptrs + offs_dv[None, :], out.to(OutPart.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    lse_ptrs = LsePart + split * stride_l[0] + off_b * stride_l[1] + tok * stride_l[2] + head * stride_l[3]
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit(do_not_specialize=["cache_seqlen", "step"])
def _decode_fwd(Q, K, V, OutPart, LsePart, CacheSeqlens, Leftpad, CacheRows, BlockTable, KNew, VNew, Sink, Errors,
                score_args,
                step, stride_q, stride_k, stride_v, stride_o, stride_l, stride_tb, stride_kn, stride_vn,
                batch, nheads_k, seqlen_q, group_size, rows_per_seq, cache_blocks, head_dim, head_dim_v, num_splits,
                cache_seqlen, seqlen_new, seqlens_max, rotary_end, window_left, window_right, qk_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_P: tl.constexpr,
                PAGE_CHUNKS: tl.constexpr, BLOCK_B: tl.constexpr, BATCH_CHUNKS: tl.constexpr, SEQLENS: tl.constexpr,
                PAGED: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SPLIT: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
                APPEND: tl.constexpr, ROTARY: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr):
    """Program (split, query tile, b * nheads_k + KV head): the tile's BLOCK_M query rows (tokens x
    the query heads of the KV head) of sequence b against the split's share of the sequence's keys,
    its index values checked and its new tokens written first (the module's doc)."""
    split = tl.program_id(0)
    start_r = tl.program_id(1) * BLOCK_M
    off_b = (tl.program_id(2) // nheads_k).to(tl.int64)
    off_hk = (tl.program_id(2) % nheads_k).to(tl.int64)
    # Row r of the tile is query token r // group_size of query head off_hk * group_size + r % group_size.
    r = start_r + tl.arange(0, BLOCK_M)
    tok = r // group_size
    head = off_hk * group_size + r % group_size
    row_ok = r < seqlen_q * group_size
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)  # (V's and the output's head dim)
    dims = (offs_d, d_ok, offs_dv, offs_dv < head_dim_v)
    q = tl.load(Q + off_b * stride_q[0] + tok[:, None] * stride_q[1] + head[:, None] * stride_q[2] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The sequence's keys are cache positions first .. cache_seqlens + seqlen_new - 1; query token
    # i sits at key offset + i (bottom-right alignment).
    first = 0
    if LEFTPAD:
        first = tl.load(Leftpad + off_b)
    end = cache_seqlen
    if SEQLENS:
        end = tl.load(CacheSeqlens + off_b)
    seqlen_k = end + seqlen_new - first
    offset = seqlen_k - seqlen_q
    # A key sits at (block, slot) of the cache's first two dims (_key_slots): through the page
    # table, else in the sequence's cache row.
    table = BlockTable
    if PAGED:
        table = BlockTable + off_b * stride_tb
    row = off_b
    if BATCH_IDX:
        row = tl.load(CacheRows + off_b).to(tl.int64)
    # With a bad index value (below, one of the pages of the program's share of the keys) the
    # program reads and writes nothing.
    ok = _sequence_ok(Errors, step, CacheRows, off_b, first, end, row, batch, seqlens_max, cache_blocks, rotary_end,
                      BLOCK_B, BATCH_CHUNKS, SEQLENS, LEFTPAD, BATCH_IDX, APPEND, ROTARY)
    # This split's share of the keys, whole tiles so that no tile straddles two splits (none with a
    # bad index), cut below to the band the tile's queries can see.
    chunk = tl.cdiv(tl.cdiv(seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.where(ok, tl.minimum(lo + chunk, seqlen_k), lo)
    if PAGED:  # the share's pages, those left of a window too (the host's checks see them)
        pages_ok = _pages_ok(Errors, step, table, lo, hi, rows_per_seq, cache_blocks, off_b, BLOCK_P, PAGE_CHUNKS)
        ok = ok & pages_ok
        hi = tl.where(pages_ok, hi, lo)
    if APPEND:
        # Every program that may read a new token writes it (the query tiles of a large GQA group
        # write the same values), from the split's whole share: a band may leave a new key to no
        # program's loop.
        _append(K, V, KNew, VNew, table, row, first, lo, hi, seqlen_k, seqlen_new, off_b, off_hk, offs_n, dims,
                rows_per_seq, stride_k, stride_v, stride_kn, stride_vn, BLOCK_N, PAGED)
    if HAS_LEFT:
        lo = tl.maximum(lo, tl.maximum(start_r // group_size + offset - window_left, 0) // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        last_tok = tl.minimum((start_r + BLOCK_M - 1) // group_size, seqlen_q - 1)
        hi = tl.minimum(hi, last_tok + offset + window_right + 1)
    m_i, l_i, acc = _attend(Q, K, V, Sink, head, q, table, row, first, lo, hi, tok, off_hk, offs_n, dims,
                            rows_per_seq, seqlen_q, offset, window_left, window_right, qk_scale,
                            (off_b.to(tl.int32), head[:, None].to(tl.int32), score_args), stride_k, stride_v, BLOCK_M,
                            BLOCK_N, BLOCK_DV, PAGED, PREFETCH_PAGES, HAS_LEFT, HAS_RIGHT, INPUT_PRECISION, SCORE_MOD)
    _write(OutPart, LsePart, m_i, l_i, acc, ok, split, off_b, tok, head, row_ok, offs_dv, dims[3], stride_o, stride_l,
           SPLIT)


@triton.jit
def _decode_combine(OutPart, LsePart, Out, Lse, Sink, nheads, seqlen_q, head_dim, num_splits,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merges the splits of one output row (b, i, h): out = sum_s exp(lse_s - lse) * out_s with
    lse = log sum_s exp(lse_s). Partials are (splits, B, Sq, H, D) and (splits, B, Sq, H), D the
    output's head dim (v's), BLOCK_D its tile. The learnable sink (Sink, where split) is counted here,
    once: one more partial of out 0 and lse sink."""
    row = tl.program_id(0).to(tl.int64)  # b * seqlen_q * nheads + i * nheads + h
    rows = tl.num_programs(0)
    h = row % nheads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LsePart + offs_s * rows + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if Sink is not None:
        sink = tl.load(Sink + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    if Sink is not None:
        total += tl.exp(sink - m_safe)
    part = tl.load(OutPart + (offs_s[:, None] * rows + row) * head_dim + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(part * w[:, None], 0) / total_safe
    tl.store(Out + row * head_dim + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    i = (row // nheads) % seqlen_q
    b = row // (nheads * seqlen_q)
    tl.store(Lse + (b * nheads + h) * seqlen_q + i, tl.where(total == 0.0, float("inf"), m + tl.log(total_safe)))


def _page_chunks(share_pages: int) -> tuple[int, int]:
    """(BLOCK_P, PAGE_CHUNKS) of the decode kernel's page check: chunks of 128 to 1024 table entries
    (more where 64 such chunks would not cover a share) that cover a split's share_pages (0: no page
    table, no check)."""
    if not share_pages:
        return 1, 0
    block_p = max(128, min(1024, next_power_of_2(share_pages)), next_power_of_2(cdiv(share_pages, 64)))
    return block_p, cdiv(share_pages, block_p)


def launches(t: dict, params: AttentionParams, cfg: DecodeLaunch, seqlen_new: int,
             rotary_end: int | None) -> list[tuple]:
    """The decode kernel on `t` (the tensors and index values by argument name) as `cfg` (plan.py's
    select_decode) has it, appending the new tokens first where given, then (with splits) the combine,
    whose partial results are workspaces (uninitialized: each split writes every row of its part).
    rotary_end: as attention.decode_forward's."""
    q, k_cache, v_cache = t["Q"], t["K"], t["V"]
    splits, tiles = cfg.splits, cfg.tiles
    batch, seqlen_q, nheads, head_dim = q.shape
    head_dim_v = v_cache.shape[3]
    out_part, lse_part = t["Out"], t["Lse"]
    if splits > 1:
        out_part = t["OutPart"] = workspace((splits, *t["Out"].shape), torch.float32, q.device, zeroed=False)
        lse_part = t["LsePart"] = workspace((splits, batch, seqlen_q, nheads), torch.float32, q.device, zeroed=False)
    nheads_k, rows_per_seq = k_cache.shape[2], k_cache.shape[1]
    capacity = rows_per_seq * (t["BlockTable"].shape[1] if "BlockTable" in t else 1)
    # (split, batch, token, head) strides of the partial results; one split writes the final ones.
    if splits > 1:
        out_strides, lse_strides = out_part.stride()[:4], lse_part.stride()
    else:
        out_strides = (0, *out_part.stride()[:3])
        lse_strides = (0, lse_part.stride(0), lse_part.stride(2), lse_part.stride(1))
    block_table, k_new, v_new = t.get("BlockTable"), t.get("KNew"), t.get("VNew")
    score = None if params.mods is None else params.mods.score
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    block_p, page_chunks = _page_chunks(cfg.share_pages)
    repeats = "CacheRows" in t and k_new is not None  # the kernel looks for two sequences writing one row
    decode = _decode_fwd, (splits, cfg.m_tiles, batch * nheads_k), dict(
        Q=q, K=k_cache, V=v_cache, OutPart=out_part, LsePart=lse_part,
        **{name: t.get(name) for name in OPTIONAL_TENSORS}, Errors=t["Errors"], step=t["step"],
        Sink=t.get("Sink") if splits == 1 else None,  # (with splits, the combine counts it)
        stride_q=q.stride()[:3], stride_k=k_cache.stride()[:3], stride_v=v_cache.stride()[:3],
        stride_o=out_strides, stride_l=lse_strides,
        stride_tb=0 if block_table is None else block_table.stride(0),
        stride_kn=(0, 0, 0) if k_new is None else k_new.stride()[:3],
        stride_vn=(0, 0, 0) if v_new is None else v_new.stride()[:3],
        batch=batch, nheads_k=nheads_k, seqlen_q=seqlen_q, group_size=nheads // nheads_k,
        rows_per_seq=k_cache.shape[1], cache_blocks=k_cache.shape[0], head_dim=head_dim, head_dim_v=head_dim_v,
        num_splits=splits,
        cache_seqlen=t["cache_seqlen"], seqlen_new=seqlen_new, seqlens_max=capacity - seqlen_new,
        rotary_end=0 if rotary_end is None else rotary_end,
        window_left=params.window_left, window_right=params.window_right, qk_scale=logit_scale(params),
        BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_P=block_p,
        PAGE_CHUNKS=page_chunks,
        # (constant unless used: each value is a kernel of its own)
        BLOCK_B=min(1024, max(16, next_power_of_2(batch))) if repeats else 16, BATCH_CHUNKS=cdiv(batch, 1024) * repeats,
        SEQLENS="CacheSeqlens" in t,
        PAGED=block_table is not None, LEFTPAD="Leftpad" in t, BATCH_IDX="CacheRows" in t,
        HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0, SPLIT=splits > 1,
        PREFETCH_PAGES=cfg.prefetch_pages, APPEND=k_new is not None,
        ROTARY=rotary_end is not None and "CacheSeqlens" in t,
        INPUT_PRECISION=tiles.input_precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        SCORE_MOD=None if score is None else forward_function(score.graph, fast_math(q)),
        score_args=(0,) if score is None else kernel_args(list(score.tensors), list(score.scalars)),
    )
    launches: list[tuple] = [decode]
    if splits == 1:
        return launches
    combine = _decode_combine, (batch * seqlen_q * nheads,), dict(
        OutPart=out_part, LsePart=lse_part, Out=t["Out"], Lse=t["Lse"], Sink=t.get("Sink"), nheads=nheads,
        seqlen_q=seqlen_q, head_dim=head_dim_v, num_splits=splits, BLOCK_S=max(2, next_power_of_2(splits)),
        BLOCK_D=block_dv, num_warps=4 if block_dv >= 128 else 2,
    )
    return [*launches, combine]
