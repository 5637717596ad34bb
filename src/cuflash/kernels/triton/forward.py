"""Forward pass: FlashAttention-2, Algorithm 1.

Each program owns one tile of BLOCK_M query rows of one (batch, head) and streams K/V tiles
through it, keeping the running row max m_i, the running sum l_i and the unnormalized output in
registers. Logits are kept in base 2 (LOG2E folded into the scale) so the softmax uses exp2.
Only the K/V tiles inside the band of a causal mask or sliding window are visited.
"""
import torch
import triton
import triton.language as tl

from ...params import AttentionParams
from ..constants import LN2, NO_MASK
from ..device import cdiv
from ..lists import listed_blocks
from ..variant import Problem, kernel_tensors, lse_strides, mod_args, variant_args
from . import Tiles
from .common import advance, band, dropout_keep, head_options, load_rows, load_tile, mma, \
    query_program, read_tile, row_source, score_tile, sink_state, softmax_step, store_tile, tile_aranges, \
    tile_ptrs, tile_start


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, kv, paging, mask, mods, offs, lo, hi, listed, bounds, qk_scale, drop,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                    EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
                    PAGED: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, LISTED: tl.constexpr):
    """K/V tiles [lo, hi) into the running (acc, m_i, l_i), or (LISTED, the block size of a block mask's
    list `listed`) the tiles of its blocks (common.tile_start); MASKED applies the key bound and the
    band's edges (tiles wholly inside need neither), MASK_MOD the mask_mod. The argument groups are
    _attn_fwd's."""
    k_src, v_src, stride_kn, stride_vn = kv
    pages, page_size, stride_kpage, stride_vpage = paging
    offs_m, offs_n, offs_d, offs_dv = offs
    seqlen_k = bounds[1]
    head_dim, head_dim_v = bounds[2]
    if not PAGED and not LISTED:
        k_src, v_src = advance((k_src, v_src), (stride_kn, stride_vn), tl.cast(lo, tl.int64), TMA)
    for it in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tile_start(it, listed, BLOCK_N, LISTED)
        cols = start_n + offs_n
        k_at, v_at = k_src, v_src
        if LISTED and not PAGED:
            k_at, v_at = advance((k_src, v_src), (stride_kn, stride_vn), tl.cast(start_n, tl.int64), TMA)
        if PAGED:  # key j: row j % page_size of page pages[j // page_size], read in place
            page = tl.load(pages + cols // page_size, mask=cols < seqlen_k, other=0).to(tl.int64)
            row = (cols % page_size).to(tl.int64)
            k = load_tile(k_src + (page * stride_kpage + row * stride_kn)[:, None] + offs_d[None, :], cols, seqlen_k,
                          offs_d, head_dim, MASKED, not EVEN_D)
        else:
            k = load_rows(k_at, start_n, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D, TMA)
        x = mma(q, tl.trans(k), None, INPUT_PRECISION) * qk_scale
        s = score_tile(x, offs_m[:, None], cols[None, :], bounds, mask, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND, mods,
                       SCORE_MOD, MASK_MOD)
        m_new, p, alpha, l_i = softmax_step(
            s, m_i, l_i, MASKED or MASK_KIND != NO_MASK or SCORE_MOD is not None or MASK_MOD is not None)
        if DROPOUT:
            # The softmax sum counts every probability; only the output sees the dropped ones.
            p = tl.where(dropout_keep(drop, offs_m[:, None], cols[None, :]), p, 0.0)
        if PAGED:
            v = load_tile(v_src + (page * stride_vpage + row * stride_vn)[:, None] + offs_dv[None, :], cols,
                          seqlen_k, offs_dv, head_dim_v, MASKED, not EVEN_DV)
        else:
            v = load_rows(v_at, start_n, cols, seqlen_k, offs_dv, head_dim_v, MASKED, not EVEN_DV, TMA)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new
        if not PAGED and not LISTED:
            k_src, v_src = advance((k_src, v_src), (stride_kn, stride_vn), BLOCK_N, TMA)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_listed(acc, m_i, l_i, q, kv, paging, mask, mods, offs, bounds, qk_scale, drop, lists, row,
                     BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, HAS_FULL: tl.constexpr,
                     EVEN_BLOCKS: tl.constexpr, MASK_KIND: tl.constexpr,
                     DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     TMA: tl.constexpr, PAGED: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr):
    """The key blocks a block mask lists for query block `row` (lists: its BlockNum, BlockIdx, FullNum,
    FullIdx and their strides): those partly seen, through the mask_mod, then (HAS_FULL) those wholly
    seen, without it, unmasked where every block is whole (EVEN_BLOCKS: else the keys' end is checked).
    One loop per list, each over every tile of it."""
    count, first, stride = listed_blocks(lists[0], lists[1], lists[4], False, mods[0], mods[1], row)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, kv, paging, mask, mods, offs, 0, count * SPARSE_KV, (first, stride), bounds, qk_scale, drop,
        BLOCK_N, True, False, False, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, False, PAGED,
        SCORE_MOD, MASK_MOD, SPARSE_KV)
    if HAS_FULL:
        count, first, stride = listed_blocks(lists[2], lists[3], lists[4], True, mods[0], mods[1], row)
        acc, m_i, l_i = _attn_fwd_inner(
            acc, m_i, l_i, q, kv, paging, mask, mods, offs, 0, count * SPARSE_KV, (first, stride), bounds, qk_scale,
            drop, BLOCK_N, not EVEN_BLOCKS, False, False, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV, INPUT_PRECISION,
            TMA, False, PAGED, SCORE_MOD, None, SPARSE_KV)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, Mask, Rng, BlockTable, Sink,
              BlockNum, BlockIdx, FullNum, FullIdx, score_args, mask_args,
              stride_q, stride_k, stride_v, stride_o, stride_l, stride_mask, stride_tb, page_size,
              stride_blocks, nheads, seqlen_q, seqlen_k, head_dim, head_dim_v, group_size, bottom_right, window_left,
              window_right, qk_scale, drop_threshold, drop_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
              WS: tl.constexpr,
              PAGED: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SPARSE: tl.constexpr,
              HAS_FULL: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
              EVEN_BLOCKS: tl.constexpr):
    start_m, off_bh, off_b, off_h, q_first, seqlen_q, k_first, seqlen_k = query_program(
        CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, seqlen_q, seqlen_k, nheads, BLOCK_M, HAS_RIGHT, VARLEN)
    off_hk = off_h // group_size
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence (rows past seqused_q: zeroed by the caller)
            return
    offset = bottom_right * (seqlen_k - seqlen_q)
    rows, offs_m, offs_n, offs_d, offs_dv = tile_aranges(start_m, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    pages = 0  # (BlockTable is None unless PAGED: a value of one type either way)
    if PAGED:  # the pages of sequence off_b; the kernel reads K and V from them
        pages = BlockTable + off_b * stride_tb
        k_src = K + off_hk * stride_k[2]
        v_src = V + off_hk * stride_v[2]
    else:
        k_src = row_source(K, stride_k, off_b, off_hk, k_first, seqlen_k, head_dim, offs_n, offs_d, BLOCK_N, BLOCK_D,
                           TMA)
        v_src = row_source(V, stride_v, off_b, off_hk, k_first, seqlen_k, head_dim_v, offs_n, offs_dv, BLOCK_N,
                           BLOCK_DV, TMA)
    q = read_tile(Q, stride_q, off_b, off_h, q_first, start_m, rows, seqlen_q, offs_d, head_dim, not EVEN_D)
    mask_ptrs, drop_key = head_options(Mask, stride_mask, Rng, off_b, off_h, off_bh, MASK_KIND, DROPOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if Sink is not None:  # the learnable sink, seen first (cuflash/sinks.py)
        m_i, l_i = sink_state(Sink, off_h, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # The key tiles in three parts: those a window's left edge cuts (masked; none without a left edge),
    # those every row sees whole (unmasked, the loop that may be warp-specialized), those the diagonal
    # or the keys' end cuts (masked).
    edges = band(start_m, BLOCK_M, seqlen_k, BLOCK_N, offset - window_left, offset + window_right, HAS_LEFT,
                 HAS_RIGHT)
    kv = (k_src, v_src, stride_k[1], stride_v[1])
    paging = (pages, page_size, stride_k[3], stride_v[3])
    mask = (mask_ptrs, stride_mask[2], stride_mask[3])
    offs = (offs_m, offs_n, offs_d, offs_dv)
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
    drop = (drop_key, drop_threshold)
    mods = (off_b.to(tl.int32), off_h.to(tl.int32), score_args, mask_args)
    if SPARSE:  # the key blocks the block mask lists: partly seen, then wholly seen
        acc, m_i, l_i = _attn_fwd_listed(
            acc, m_i, l_i, q, kv, paging, mask, mods, offs, bounds, qk_scale, drop,
            (BlockNum, BlockIdx, FullNum, FullIdx, stride_blocks), start_m // SPARSE_Q, BLOCK_N, SPARSE_KV, HAS_FULL,
            EVEN_BLOCKS, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, PAGED, SCORE_MOD, MASK_MOD)
    else:
        for part in tl.static_range(1 - HAS_LEFT, 3):
            acc, m_i, l_i = _attn_fwd_inner(
                acc, m_i, l_i, q, kv, paging, mask, mods, offs, edges[part], edges[part + 1], (0, 0), bounds, qk_scale,
                drop, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV,
                INPUT_PRECISION, TMA, WS & (part == 1), PAGED, SCORE_MOD, MASK_MOD, 0)

    # Rows that saw no key at all (l_i == 0) get out = 0 and lse = +inf, so that the backward's
    # exp(s - lse) is 0 for them.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if DROPOUT:
        acc = acc * drop_scale
    out = acc / l_safe[:, None]
    tl.store(Lse + off_b * stride_l[0] + off_h * stride_l[1] + q_first + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = tile_ptrs(Out, stride_o, off_b, off_h, q_first + start_m, rows, offs_dv)
    store_tile(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_dv, head_dim_v, not EVEN_DV)


def launch_args(tensors: dict, prob: Problem, params: AttentionParams, tiles: Tiles):
    """(kernel, grid, keyword arguments) of the forward for kernels/launch.py: a program per tile of
    tiles.block_m query rows of one (batch, head)."""
    q, k, v, out = tensors["Q"], tensors["K"], tensors["V"], tensors["Out"]
    table = params.block_table
    paged = table is not None
    grid = (cdiv(prob.seqlen_q, tiles.block_m), prob.batch * prob.nheads)
    return _attn_fwd, grid, dict(
        **kernel_tensors(tensors), **mod_args(params, prob, "fwd"),
        stride_q=prob.strides(q), stride_k=_kv_strides(prob, k, paged), stride_v=_kv_strides(prob, v, paged),
        stride_o=prob.strides(out), stride_l=lse_strides(prob, params), **variant_args(params, prob),
        **({} if paged else {"BlockTable": None}), **({} if "Sink" in tensors else {"Sink": None}),
        stride_tb=table.stride(0) if table is not None else 0,
        page_size=k.shape[1] if paged else 0, PAGED=paged,
        nheads=prob.nheads, seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, **prob.dims(),
        group_size=prob.nheads // prob.nheads_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        INPUT_PRECISION=tiles.input_precision, TMA=tiles.tma, WS=tiles.warp_specialize,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _kv_strides(prob, t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
    """The strides of k or v, (batch, row, head, page): a paged cache's (num_blocks, page, Hk, D) as
    rows within a page and the page's own stride, otherwise as the problem lays them out."""
    if paged:
        return 0, t.stride(1), t.stride(2), t.stride(0)
    return (*prob.strides(t), 0)
