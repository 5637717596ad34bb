"""Decoding: a few query tokens attending to a long KV cache, read in place ("flash-decoding").

Decoding is bound by memory bandwidth: each cached K/V byte must be read once, with every SM
busy even at batch 1. A program owns one KV head of one sequence together with every query row
that reads it (seqlen_q tokens x the nheads / nheads_k query heads of the GQA group, packed into
one tile, so a K/V tile is loaded once for the whole group), and one split of the sequence's keys.
Splits write their normalized output and log-sum-exp to fp32 partial buffers that a small combine
kernel merges; with one split the kernel writes the result directly.

Keys are addressed by position, through the page table of a paged cache or the cache row of the
sequence, so nothing is gathered or copied before the kernel, and no value (sequence lengths,
pages) is read to the host: the launch can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from ...params import AttentionParams
from ..device import cdiv, next_power_of_2, num_sms, padded_head_dim
from ..launch import launch
from ..plan import decode_tiles
from ..variant import logit_scales
from . import Tiles
from .common import LN2, LOG2E, NO_MASK, logits, mma, score_tile, softmax_step

MAX_SPLITS = 64  # the combine kernel holds one row of every split in registers
PROGRAMS_PER_SM = 2  # the split heuristic's target
# The decode kernel's optional tensor arguments and the append's new keys and values, in the
# launch's tensors only when given.
_DECODE_OPTIONAL = ("CacheSeqlens", "Leftpad", "CacheRows", "BlockTable", "Slopes")
_OPTIONAL = (*_DECODE_OPTIONAL, "KNew", "VNew")


@triton.jit(do_not_specialize=["cache_seqlen"])
def _decode_fwd(Q, K, V, OutPart, LsePart, CacheSeqlens, Leftpad, CacheRows, BlockTable, Slopes,
                stride_q, stride_k, stride_v, stride_o, stride_l, stride_tb, stride_slope_b,
                nheads_k, seqlen_q, group_size, rows_per_seq, head_dim, num_splits, cache_seqlen, seqlen_new,
                window_left, window_right, qk_scale, softcap,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                SEQLENS: tl.constexpr, PAGED: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                SPLIT: tl.constexpr, PREFETCH_PAGES: tl.constexpr, INPUT_PRECISION: tl.constexpr):
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
def _append_kv(KNew, VNew, K, V, CacheSeqlens, CacheRows, BlockTable, stride_kn, stride_vn, stride_k, stride_v,
               stride_tb, nheads_k, rows_per_seq, head_dim, cache_seqlen,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SEQLENS: tl.constexpr, PAGED: tl.constexpr,
               BATCH_IDX: tl.constexpr):
    """Writes new token i of sequence b (every KV head) into the cache at position cache_seqlens[b] + i,
    addressed as the decode kernel reads it: through the page table, or in the sequence's cache row."""
    i = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    pos = cache_seqlen + i
    if SEQLENS:
        pos = tl.load(CacheSeqlens + off_b).to(tl.int64) + i
    if PAGED:
        block = tl.load(BlockTable + off_b * stride_tb + pos // rows_per_seq).to(tl.int64)
        slot = (pos % rows_per_seq).to(tl.int64)
    else:
        block = off_b
        if BATCH_IDX:
            block = tl.load(CacheRows + off_b).to(tl.int64)
        slot = pos.to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < nheads_k) & (d < head_dim)
    k = tl.load(KNew + off_b * stride_kn[0] + i * stride_kn[1] + h * stride_kn[2] + d, mask=ok)
    tl.store(K + block * stride_k[0] + slot * stride_k[1] + h * stride_k[2] + d, k, mask=ok)
    v = tl.load(VNew + off_b * stride_vn[0] + i * stride_vn[1] + h * stride_vn[2] + d, mask=ok)
    tl.store(V + block * stride_v[0] + slot * stride_v[1] + h * stride_v[2] + d, v, mask=ok)


def num_splits_for(programs: int, capacity: int, block_n: int, device: torch.device, requested: int = 0) -> int:
    """How many splits of each sequence's keys: `requested`, or (0) enough to give every SM
    PROGRAMS_PER_SM programs, never more than MAX_SPLITS or than the cache has key tiles."""
    splits = requested or cdiv(PROGRAMS_PER_SM * num_sms(device), programs)
    return max(1, min(splits, MAX_SPLITS, cdiv(capacity, block_n)))


def decode_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | int,
                   seqlen_new: int, leftpad: torch.Tensor | None, cache_rows: torch.Tensor | None,
                   block_table: torch.Tensor | None, params: AttentionParams, num_splits: int = 0,
                   k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, tiles: Tiles | None = None):
    """q (B, Sq, H, D) attending to the keys leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 of
    sequence b of the cache (cache_seqlens an int: the same for every sequence; leftpad None: 0):
    k_cache, v_cache (rows, rows_per_seq, Hk, D), any strides but the last dim's, sequence b in row
    cache_rows[b] (default b), or pages of rows_per_seq keys listed by block_table (B, pages).
    k_new, v_new (B, seqlen_new, Hk, D): written into the cache at positions cache_seqlens[b] ..
    first, by a kernel of the same launch plan (else the cache holds them already).
    Returns out (B, Sq, H, D) and softmax_lse (B, H, Sq) fp32."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, rows_per_seq = k_cache.shape[2], k_cache.shape[1]
    block_d = padded_head_dim(head_dim)
    fills_gpu = batch * nheads_k >= PROGRAMS_PER_SM * num_sms(q.device)
    cfg = tiles or decode_tiles(q, block_d, block_table is not None, fills_gpu)
    block_m = min(cfg.block_m, max(16, next_power_of_2(seqlen_q * nheads // nheads_k)))
    m_tiles = cdiv(seqlen_q * nheads // nheads_k, block_m)
    capacity = rows_per_seq * (block_table.shape[1] if block_table is not None else 1)
    splits = num_splits_for(batch * nheads_k * m_tiles, capacity, cfg.block_n, q.device, num_splits)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    tensors: dict[str, torch.Tensor | int] = dict(Q=q, K=k_cache, V=v_cache, Out=out, Lse=lse, OutPart=out,
                                                  LsePart=lse)
    if splits > 1:
        tensors.update(OutPart=torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device),
                       LsePart=torch.empty((splits, batch, seqlen_q, nheads), dtype=torch.float32, device=q.device))
    # An int cache_seqlens is an argument of the plan like the tensors (the kernels do not specialize
    # on it), so that a decode loop stepping through positions keeps one plan.
    given = isinstance(cache_seqlens, torch.Tensor)
    tensors["cache_seqlen"] = 0 if given else cache_seqlens
    optional = (cache_seqlens if given else None, leftpad, cache_rows, block_table, params.alibi_slopes, k_new, v_new)
    tensors.update({name: t for name, t in zip(_OPTIONAL, optional) if t is not None})
    launch((decode_forward, params.key(), cfg, block_m, splits, seqlen_new), tensors,
           lambda: _launches(tensors, params, cfg, block_m, m_tiles, splits, seqlen_new, not fills_gpu))
    return out, lse


def _launches(t: dict, params: AttentionParams, cfg: Tiles, block_m: int, m_tiles: int, splits: int,
              seqlen_new: int, prefetch_pages: bool) -> list[tuple]:
    """The append (with new tokens), the decode kernel, then (with splits) the combine."""
    q, k_cache, v_cache, out_part, lse_part = t["Q"], t["K"], t["V"], t["OutPart"], t["LsePart"]
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    block_d = padded_head_dim(head_dim)
    # (split, batch, token, head) strides of the partial results; one split writes the final ones.
    if splits > 1:
        out_strides, lse_strides = out_part.stride()[:4], lse_part.stride()
    else:
        out_strides = (0, *out_part.stride()[:3])
        lse_strides = (0, lse_part.stride(0), lse_part.stride(2), lse_part.stride(1))
    block_table, slopes = t.get("BlockTable"), params.alibi_slopes
    qk_scale, softcap = logit_scales(params)
    decode = _decode_fwd, (splits, m_tiles, batch * nheads_k), dict(
        Q=q, K=k_cache, V=v_cache, OutPart=out_part, LsePart=lse_part,
        **{name: t.get(name) for name in _DECODE_OPTIONAL},
        stride_q=q.stride()[:3], stride_k=k_cache.stride()[:3], stride_v=v_cache.stride()[:3],
        stride_o=out_strides, stride_l=lse_strides,
        stride_tb=0 if block_table is None else block_table.stride(0),
        stride_slope_b=0 if slopes is None or slopes.dim() == 1 else slopes.stride(0),
        nheads_k=nheads_k, seqlen_q=seqlen_q, group_size=nheads // nheads_k, rows_per_seq=k_cache.shape[1],
        head_dim=head_dim, num_splits=splits, cache_seqlen=t["cache_seqlen"], seqlen_new=seqlen_new,
        window_left=params.window_left, window_right=params.window_right, qk_scale=qk_scale, softcap=softcap,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SEQLENS="CacheSeqlens" in t,
        PAGED=block_table is not None, LEFTPAD="Leftpad" in t, BATCH_IDX="CacheRows" in t,
        HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0, SOFTCAP=params.softcap > 0,
        ALIBI=slopes is not None, SPLIT=splits > 1, PREFETCH_PAGES=prefetch_pages,
        INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    launches: list[tuple] = [decode]
    if "KNew" in t:
        k_new, v_new = t["KNew"], t["VNew"]
        launches.insert(0, (_append_kv, (seqlen_new, batch), dict(
            KNew=k_new, VNew=v_new, K=k_cache, V=v_cache, CacheSeqlens=t.get("CacheSeqlens"),
            CacheRows=t.get("CacheRows"), BlockTable=block_table, stride_kn=k_new.stride()[:3],
            stride_vn=v_new.stride()[:3], stride_k=k_cache.stride()[:3], stride_v=v_cache.stride()[:3],
            stride_tb=0 if block_table is None else block_table.stride(0), nheads_k=nheads_k,
            rows_per_seq=k_cache.shape[1], head_dim=head_dim, cache_seqlen=t["cache_seqlen"],
            BLOCK_H=next_power_of_2(nheads_k), BLOCK_D=block_d, SEQLENS="CacheSeqlens" in t,
            PAGED=block_table is not None, BATCH_IDX="CacheRows" in t, num_warps=4)))
    if splits == 1:
        return launches
    combine = _decode_combine, (batch * seqlen_q * nheads,), dict(
        OutPart=out_part, LsePart=lse_part, Out=t["Out"], Lse=t["Lse"], nheads=nheads, seqlen_q=seqlen_q,
        head_dim=head_dim, num_splits=splits, BLOCK_S=max(2, next_power_of_2(splits)), BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
    )
    return [*launches, combine]
