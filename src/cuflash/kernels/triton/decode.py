"""Decoding: a few query tokens attending to a long KV cache, read in place ("flash-decoding").

Decoding is bound by memory bandwidth: each cached K/V byte must be read once, with every SM
busy even at batch 1. A program owns one KV head of one sequence together with every query row
that reads it (seqlen_q tokens x the nheads / nheads_k query heads of the GQA group, packed into
one tile, so a K/V tile is loaded once for the whole group), and one split of the sequence's keys.
Splits write their normalized output and log-sum-exp to fp32 partial buffers that a small combine
kernel merges; with one split the kernel writes the result directly. A step's new keys and values
are written into the cache by the programs that read them, before their loop (one launch less).

Keys are addressed by position, through the page table of a paged cache or the cache row of the
sequence, so nothing is gathered or copied before the kernel, and no value (sequence lengths,
pages) is read to the host: the launch can be captured in a CUDA graph. The eager call's checks of
those values (kvcache.py) take their extremes from one more program here (index_extremes), read to
the host with one copy.
"""

import torch
import triton
import triton.language as tl

from ...params import AttentionParams, IndexExtremes
from ..device import cdiv, next_power_of_2, num_sms, padded_head_dim
from ..launch import keep, kept, launch, open_key, workspace
from ..plan import decode_tiles
from ..variant import logit_scales
from . import Tiles
from .common import LN2, LOG2E, NO_MASK, logits, mma, score_tile, softmax_step

MAX_SPLITS = 64  # the combine kernel holds one row of every split in registers
PROGRAMS_PER_SM = 2  # the split heuristic's target
# The decode kernel's optional tensor arguments (the index tensors first, then ALiBi's slopes and the
# new keys and values to append), in the launch's tensors only when given.
_OPTIONAL = ("CacheSeqlens", "Leftpad", "CacheRows", "BlockTable", "Slopes", "KNew", "VNew")
_INDEXES = _OPTIONAL[:4]


@triton.jit(do_not_specialize=["cache_seqlen"])
def _decode_fwd(Q, K, V, OutPart, LsePart, CacheSeqlens, Leftpad, CacheRows, BlockTable, Slopes, KNew, VNew,
                stride_q, stride_k, stride_v, stride_o, stride_l, stride_tb, stride_slope_b, stride_kn, stride_vn,
                nheads_k, seqlen_q, group_size, rows_per_seq, head_dim, num_splits, cache_seqlen, seqlen_new,
                window_left, window_right, qk_scale, softcap,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                SEQLENS: tl.constexpr, PAGED: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                SPLIT: tl.constexpr, PREFETCH_PAGES: tl.constexpr, APPEND: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
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
    q = tl.load(Q + off_b * stride_q[0] + tok[:, None] * stride_q[1] + head[:, None] * stride_q[2] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    slope = 0.0
    if ALIBI:
        slope = tl.load(Slopes + off_b * stride_slope_b + head, mask=row_ok, other=0.0)[:, None] * LOG2E

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
    # A key sits at (block, slot) of the cache's first two dims: (page, slot in the page) through the
    # page table, else (the sequence's cache row, position); every dim is addressed by its stride.
    if PAGED:
        table = BlockTable + off_b * stride_tb
    else:
        block = off_b
        if BATCH_IDX:
            block = tl.load(CacheRows + off_b).to(tl.int64)
    # This split's share of the keys, whole tiles so that no tile straddles two splits, cut to
    # the band the tile's queries can see.
    chunk = tl.cdiv(tl.cdiv(seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen_k)
    if APPEND:
        # The new tokens (keys seqlen_k - seqlen_new ..) of this split's share are written into the
        # cache first, this KV head's, by every program that may read them (the query tiles of a
        # large GQA group write the same values), and are visible to all its threads after the
        # barrier. The share is the split's whole one: a band may leave a new key to no program's loop.
        for start_n in range(tl.maximum(lo, seqlen_k - seqlen_new), hi, BLOCK_N):
            cols = start_n + offs_n
            new_ok = (cols < hi)[:, None] & d_ok[None, :]
            token = cols - (seqlen_k - seqlen_new)
            if PAGED:
                block = tl.load(table + cols // rows_per_seq, mask=cols < hi, other=0).to(tl.int64)
                slot = (cols % rows_per_seq).to(tl.int64)
            else:
                slot = (first + cols).to(tl.int64)
            k_new = tl.load(KNew + off_b * stride_kn[0] + token[:, None] * stride_kn[1] + off_hk * stride_kn[2]
                            + offs_d[None, :], mask=new_ok)
            tl.store(K + (block * stride_k[0] + slot * stride_k[1])[:, None] + off_hk * stride_k[2] + offs_d[None, :],
                     k_new, mask=new_ok)
            v_new = tl.load(VNew + off_b * stride_vn[0] + token[:, None] * stride_vn[1] + off_hk * stride_vn[2]
                            + offs_d[None, :], mask=new_ok)
            tl.store(V + (block * stride_v[0] + slot * stride_v[1])[:, None] + off_hk * stride_v[2] + offs_d[None, :],
                     v_new, mask=new_ok)
        tl.debug_barrier()
    if HAS_LEFT:
        lo = tl.maximum(lo, tl.maximum(start_r // group_size + offset - window_left, 0) // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        last_tok = tl.minimum((start_r + BLOCK_M - 1) // group_size, seqlen_q - 1)
        hi = tl.minimum(hi, last_tok + offset + window_right + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PAGED and PREFETCH_PAGES:
        # The page of each key read one tile ahead: with splits (few programs per SM) a K/V address
        # waiting on a table read of the same iteration stalls the loop; with the GPU full of
        # unsplit sequences the prefetch costs instead (both measured, docs/tuning.md).
        page = tl.load(table + (lo + offs_n) // rows_per_seq, mask=lo + offs_n < hi, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        if PAGED:
            if PREFETCH_PAGES:
                block = page.to(tl.int64)
                page = tl.load(table + (cols + BLOCK_N) // rows_per_seq, mask=cols + BLOCK_N < hi, other=0)
            else:
                block = tl.load(table + cols // rows_per_seq, mask=col_ok, other=0).to(tl.int64)
            slot = (cols % rows_per_seq).to(tl.int64)
        else:
            slot = (first + cols).to(tl.int64)
        tile_ok = col_ok[:, None] & d_ok[None, :]
        k_off = block * stride_k[0] + slot * stride_k[1]
        k = tl.load(K + k_off[:, None] + off_hk * stride_k[2] + offs_d[None, :], mask=tile_ok, other=0.0)
        scores = (qk_scale, softcap, slope)
        x = logits(mma(q, tl.trans(k), None, INPUT_PRECISION), scores, SOFTCAP)
        s = score_tile(x, tok[:, None], cols[None, :], (seqlen_q, hi, head_dim, offset, window_left, window_right),
                       scores, (Q, 0, 0), True, HAS_LEFT, HAS_RIGHT, ALIBI, NO_MASK)
        m_new, p, alpha, l_i = softmax_step(s, m_i, l_i, True)
        v_off = block * stride_v[0] + slot * stride_v[1]
        v = tl.load(V + v_off[:, None] + off_hk * stride_v[2] + offs_d[None, :], mask=tile_ok, other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new

    # A row that saw no key: out 0, lse +inf (as the other kernels), or -inf in a split's partial
    # result so that the combine gives it weight 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    empty = float("-inf") if SPLIT else float("inf")
    lse = tl.where(l_i == 0.0, empty, (m_i + tl.math.log2(l_safe)) * LN2)
    out = acc / l_safe[:, None]
    o_ptrs = OutPart + split * stride_o[0] + off_b * stride_o[1] + tok[:, None] * stride_o[2] \
        + head[:, None] * stride_o[3]
    tl.store(o_ptrs + offs_d[None, :], out.to(OutPart.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse_ptrs = LsePart + split * stride_l[0] + off_b * stride_l[1] + tok * stride_l[2] + head * stride_l[3]
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _decode_combine(OutPart, LsePart, Out, Lse, nheads, seqlen_q, head_dim, num_splits,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merges the splits of one output row (b, i, h): out = sum_s exp(lse_s - lse) * out_s with
    lse = log sum_s exp(lse_s). Partials are (splits, B, Sq, H, D) and (splits, B, Sq, H)."""
    row = tl.program_id(0).to(tl.int64)  # b * seqlen_q * nheads + i * nheads + h
    rows = tl.num_programs(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LsePart + offs_s * rows + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    part = tl.load(OutPart + (offs_s[:, None] * rows + row) * head_dim + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(part * w[:, None], 0) / total_safe
    tl.store(Out + row * head_dim + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    h = row % nheads
    i = (row // nheads) % seqlen_q
    b = row // (nheads * seqlen_q)
    tl.store(Lse + (b * nheads + h) * seqlen_q + i, tl.where(total == 0.0, float("inf"), m + tl.log(total_safe)))


@triton.jit(do_not_specialize=["cache_seqlen"])
def _index_extremes(Extremes, CacheSeqlens, Leftpad, CacheRows, BlockTable, stride_tb, batch, pages, rows_per_seq,
                    cache_seqlen, seqlen_new, SEQLENS: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
                    REPEATS: tl.constexpr, PAGED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """params.IndexExtremes of a decode step's index tensors, in its field order as int64, by one
    program: they hold a few entries per sequence. Lanes past the batch repeat sequence 0's values,
    which move no extreme."""
    zero = tl.zeros([BLOCK_B], dtype=tl.int64)
    s0 = zero + cache_seqlen
    if SEQLENS:
        s0 = zero + tl.load(CacheSeqlens).to(tl.int64)
    lp0 = zero
    if LEFTPAD:
        lp0 = zero + tl.load(Leftpad).to(tl.int64)
    r0 = zero
    if BATCH_IDX:
        r0 = zero + tl.load(CacheRows).to(tl.int64)
    s_lo, s_hi, lp_lo, past_hi, r_lo, r_hi = s0, s0, lp0, zero, r0, r0
    if LEFTPAD:
        past_hi = lp0 - s0
    repeated, p_lo, p_hi = zero, zero, zero
    for b0 in range(0, batch, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ok = b < batch
        s = s0
        if SEQLENS:
            s = tl.where(ok, tl.load(CacheSeqlens + b, mask=ok, other=0).to(tl.int64), s0)
        s_lo, s_hi = tl.minimum(s_lo, s), tl.maximum(s_hi, s)
        if LEFTPAD:
            lp = tl.where(ok, tl.load(Leftpad + b, mask=ok, other=0).to(tl.int64), lp0)
            lp_lo, past_hi = tl.minimum(lp_lo, lp), tl.maximum(past_hi, lp - s)
        if BATCH_IDX:
            r = tl.where(ok, tl.load(CacheRows + b, mask=ok, other=0).to(tl.int64), r0)
            r_lo, r_hi = tl.minimum(r_lo, r), tl.maximum(r_hi, r)
            if REPEATS:  # each row against the rows of the sequences before it
                for c0 in range(0, b0 + BLOCK_B, BLOCK_B):
                    c = c0 + tl.arange(0, BLOCK_B)
                    rc = tl.load(CacheRows + c, mask=c < batch, other=0).to(tl.int64)
                    same = (r[:, None] == rc[None, :]) & (c[None, :] < b[:, None]) & ok[:, None]
                    repeated = tl.maximum(repeated, tl.max(same.to(tl.int64), 1))
        if PAGED:  # the pages before each sequence's end (0 in the others' place, as the CPU backend)
            ends = s + seqlen_new
            for p0 in range(0, pages, BLOCK_P):
                p = p0 + tl.arange(0, BLOCK_P)
                used = ok[:, None] & (p[None, :] < pages) & (p[None, :] * rows_per_seq < ends[:, None])
                page = tl.load(BlockTable + b[:, None] * stride_tb + p[None, :], mask=used, other=0).to(tl.int64)
                p_lo, p_hi = tl.minimum(p_lo, tl.min(page, 1)), tl.maximum(p_hi, tl.max(page, 1))
    tl.store(Extremes + 0, tl.min(s_lo, 0))
    tl.store(Extremes + 1, tl.max(s_hi, 0))
    tl.store(Extremes + 2, tl.min(lp_lo, 0))
    tl.store(Extremes + 3, tl.max(past_hi, 0))
    tl.store(Extremes + 4, tl.min(r_lo, 0))
    tl.store(Extremes + 5, tl.max(r_hi, 0))
    tl.store(Extremes + 6, tl.max(repeated, 0))
    tl.store(Extremes + 7, tl.min(p_lo, 0))
    tl.store(Extremes + 8, tl.max(p_hi, 0))


def index_extremes(cache_seqlens: torch.Tensor | int, seqlen_new: int, leftpad: torch.Tensor | None,
                   cache_rows: torch.Tensor | None, block_table: torch.Tensor | None, rows_per_seq: int,
                   repeats: bool, plans: dict | None = None) -> IndexExtremes:
    """cpu.index_extremes's contract, reduced by one program on the tensors' device and read to the
    host with one copy (a decode step's other index checks would each be a kernel). plans: as
    decode_forward's."""
    optional = (cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None, leftpad, cache_rows, block_table)
    given = {name: t for name, t in zip(_INDEXES, optional) if t is not None}
    first = next(iter(given.values()))
    extremes = torch.empty(len(IndexExtremes._fields), dtype=torch.int64, device=first.device)
    tensors: dict[str, torch.Tensor | int] = dict(Extremes=extremes, **given)
    tensors["cache_seqlen"] = seqlen = 0 if "CacheSeqlens" in given else cache_seqlens
    key = open_key(plans, "index_extremes", tuple(given.values()), -2**31 <= seqlen < 2**31)
    plan = kept(plans, key)
    if plan is not None:
        plan(tensors)
    else:
        batch, pages = first.shape[0], 0 if block_table is None else block_table.shape[1]
        block_b = max(16, min(64, next_power_of_2(batch)))
        block_p = max(16, min(next_power_of_2(pages), 4096 // block_b))
        keep(plans, key, launch((index_extremes, seqlen_new, rows_per_seq, repeats), tensors, lambda: [(
            _index_extremes, (1,), dict(
                Extremes=extremes, **{name: given.get(name) for name in _INDEXES},
                stride_tb=0 if block_table is None else block_table.stride(0), batch=batch, pages=pages,
                rows_per_seq=rows_per_seq, cache_seqlen=seqlen, seqlen_new=seqlen_new,
                SEQLENS="CacheSeqlens" in given, LEFTPAD="Leftpad" in given, BATCH_IDX="CacheRows" in given,
                REPEATS=repeats, PAGED=block_table is not None, BLOCK_B=block_b, BLOCK_P=block_p, num_warps=4))]))
    facts = IndexExtremes(*extremes.tolist())
    return facts._replace(repeated=bool(facts.repeated))


def num_splits_for(programs: int, capacity: int, block_n: int, device: torch.device, requested: int = 0) -> int:
    """How many splits of each sequence's keys: `requested`, or (0) enough to give every SM
    PROGRAMS_PER_SM programs, never more than MAX_SPLITS or than the cache has key tiles."""
    splits = requested or cdiv(PROGRAMS_PER_SM * num_sms(device), programs)
    return max(1, min(splits, MAX_SPLITS, cdiv(capacity, block_n)))


def decode_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | int,
                   seqlen_new: int, leftpad: torch.Tensor | None, cache_rows: torch.Tensor | None,
                   block_table: torch.Tensor | None, params: AttentionParams, num_splits: int = 0,
                   k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, tiles: Tiles | None = None,
                   plans: dict | None = None):
    """q (B, Sq, H, D) attending to the keys leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 of
    sequence b of the cache (cache_seqlens an int: the same for every sequence; leftpad None: 0):
    k_cache, v_cache (rows, rows_per_seq, Hk, D), any strides but the last dim's, sequence b in row
    cache_rows[b] (default b), or pages of rows_per_seq keys listed by block_table (B, pages).
    k_new, v_new (B, seqlen_new, Hk, D): written into the cache at positions cache_seqlens[b] .. by
    the decode kernel before it reads them (else the cache holds them already). tiles: the decode
    kernel's instead of the table's (tuning). plans: as kernels.attention_forward's, from
    flash_attn_with_kvcache's call signature (whose options hold no tensor).
    Returns out (B, Sq, H, D) and softmax_lse (B, H, Sq) fp32."""
    batch, seqlen_q, nheads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    given = isinstance(cache_seqlens, torch.Tensor)
    optional = (cache_seqlens if given else None, leftpad, cache_rows, block_table, params.alibi_slopes, k_new, v_new)
    inputs = (q, k_cache, v_cache, *(t for t in optional if isinstance(t, torch.Tensor)))
    tensors: dict[str, torch.Tensor | int] = dict(Q=q, K=k_cache, V=v_cache, Out=out, Lse=lse)
    tensors.update({name: t for name, t in zip(_OPTIONAL, optional) if t is not None})
    # An int cache_seqlens is an argument of the plan like the tensors (the kernels do not specialize
    # on it, only on its width), so that a decode loop stepping through positions keeps one plan.
    tensors["cache_seqlen"] = seqlen = 0 if given else cache_seqlens
    key = None if tiles is not None else open_key(plans, "decode", inputs, -2**31 <= seqlen < 2**31)
    plan = kept(plans, key)
    if plan is not None:
        plan(tensors)
        return out, lse
    nheads_k, rows_per_seq = k_cache.shape[2], k_cache.shape[1]
    block_d = padded_head_dim(head_dim)
    fills_gpu = batch * nheads_k >= PROGRAMS_PER_SM * num_sms(q.device)
    cfg = tiles or decode_tiles(q, block_d, block_table is not None, fills_gpu)
    block_m = min(cfg.block_m, max(16, next_power_of_2(seqlen_q * nheads // nheads_k)))
    m_tiles = cdiv(seqlen_q * nheads // nheads_k, block_m)
    capacity = rows_per_seq * (block_table.shape[1] if block_table is not None else 1)
    splits = num_splits_for(batch * nheads_k * m_tiles, capacity, cfg.block_n, q.device, num_splits)
    keep(plans, key, launch((decode_forward, params.key(), cfg, block_m, splits, seqlen_new), tensors,
                            lambda: _launches(tensors, params, cfg, block_m, m_tiles, splits, seqlen_new,
                                              not fills_gpu)))
    return out, lse


def _launches(t: dict, params: AttentionParams, cfg: Tiles, block_m: int, m_tiles: int, splits: int,
              seqlen_new: int, prefetch_pages: bool) -> list[tuple]:
    """The decode kernel (appending the new tokens first, where given), then (with splits) the combine,
    whose partial results are workspaces (uninitialized: each split writes every row of its part)."""
    q, k_cache, v_cache = t["Q"], t["K"], t["V"]
    batch, seqlen_q, nheads, head_dim = q.shape
    out_part, lse_part = t["Out"], t["Lse"]
    if splits > 1:
        out_part = t["OutPart"] = workspace((splits, *q.shape), torch.float32, q.device, zeroed=False)
        lse_part = t["LsePart"] = workspace((splits, batch, seqlen_q, nheads), torch.float32, q.device, zeroed=False)
    nheads_k = k_cache.shape[2]
    # (split, batch, token, head) strides of the partial results; one split writes the final ones.
    if splits > 1:
        out_strides, lse_strides = out_part.stride()[:4], lse_part.stride()
    else:
        out_strides = (0, *out_part.stride()[:3])
        lse_strides = (0, lse_part.stride(0), lse_part.stride(2), lse_part.stride(1))
    block_table, slopes, k_new, v_new = t.get("BlockTable"), params.alibi_slopes, t.get("KNew"), t.get("VNew")
    qk_scale, softcap = logit_scales(params)
    block_d = padded_head_dim(head_dim)
    decode = _decode_fwd, (splits, m_tiles, batch * nheads_k), dict(
        Q=q, K=k_cache, V=v_cache, OutPart=out_part, LsePart=lse_part, **{name: t.get(name) for name in _OPTIONAL},
        stride_q=q.stride()[:3], stride_k=k_cache.stride()[:3], stride_v=v_cache.stride()[:3],
        stride_o=out_strides, stride_l=lse_strides,
        stride_tb=0 if block_table is None else block_table.stride(0),
        stride_slope_b=0 if slopes is None or slopes.dim() == 1 else slopes.stride(0),
        stride_kn=(0, 0, 0) if k_new is None else k_new.stride()[:3],
        stride_vn=(0, 0, 0) if v_new is None else v_new.stride()[:3],
        nheads_k=nheads_k, seqlen_q=seqlen_q, group_size=nheads // nheads_k, rows_per_seq=k_cache.shape[1],
        head_dim=head_dim, num_splits=splits, cache_seqlen=t["cache_seqlen"], seqlen_new=seqlen_new,
        window_left=params.window_left, window_right=params.window_right, qk_scale=qk_scale, softcap=softcap,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SEQLENS="CacheSeqlens" in t,
        PAGED=block_table is not None, LEFTPAD="Leftpad" in t, BATCH_IDX="CacheRows" in t,
        HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0, SOFTCAP=params.softcap > 0,
        ALIBI=slopes is not None, SPLIT=splits > 1, PREFETCH_PAGES=prefetch_pages, APPEND=k_new is not None,
        INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    launches: list[tuple] = [decode]
    if splits == 1:
        return launches
    combine = _decode_combine, (batch * seqlen_q * nheads,), dict(
        OutPart=out_part, LsePart=lse_part, Out=t["Out"], Lse=t["Lse"], nheads=nheads, seqlen_q=seqlen_q,
        head_dim=head_dim, num_splits=splits, BLOCK_S=max(2, next_power_of_2(splits)), BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
    )
    return [*launches, combine]
