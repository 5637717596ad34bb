"""Backward pass: FlashAttention-2, Algorithm 2, by recomputation from the log-sum-exp.

Three launches, none of them atomic, so the result is bitwise reproducible:
  _attn_bwd_delta  delta = rowsum(dO * O), one value per query row (for the Gluon dK/dV kernel
                   also -delta and -lse / softmax_scale, where its accumulators start);
  _attn_bwd_dkdv   one program per K/V tile of one KV head: streams the query tiles of every
                   query head that shares the KV head (MQA/GQA sums there), accumulating dK, dV;
  _attn_bwd_dq     one program per query tile: streams the K/V tiles, accumulating dQ.
Where one K/V tile holds every key (short sequences, plan.OneLaunch), _attn_bwd_dkdv with DQ_HERE is
the whole backward: each query tile's delta from O and dO, and its whole dQ, in the same loop.
On Hopper the Gluon dK/dV kernel (kernels/gluon/backward.py) can also add each tile's dQ to an
fp32 workspace, so that S and dP are computed once (5 matrix products instead of 7), and
_attn_bwd_dq_cast converts the sum; the order of those additions varies from run to run, so
AttentionParams.deterministic keeps the three launches above.
With P = exp(S - lse):  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
dQ = scale * dS K,  dK = scale * dS^T Q.
Dropout regenerates the forward's keep mask Z: dV = (Z * P)^T dO / (1 - p) and dP is multiplied
by Z / (1 - p); delta = rowsum(dO * O) still holds. A score_mod's gradient (SCORE_MOD_GRAD, generated from
the mod: kernels/triton/mods.py) takes dS back through the mod, softcap's and ALiBi's too (builtin_mods.py).
"""
import torch
import triton
import triton.language as tl

from ...params import AttentionParams
from ..constants import LOG2E
from ..device import cdiv
from ..launch import workspace
from ..lists import listed_blocks
from ..variant import Problem, kernel_tensors, lse_strides, mod_args, variant_args, variant_tensors
from . import Tiles
from .common import advance, band, dropout_keep, head_options, load_pair, load_tile, mma, \
    query_program, read_tile, row_source, score_tile, sequence, store_tile, tile_aranges, tile_ptrs, tile_start

ROWS_PER_PROGRAM = 64  # query rows per program of the delta and cast kernels (the Gluon kernels' tile)


@triton.jit
def _attn_bwd_delta(Out, DO, Lse, DLse, Delta, AccInit, stride_o, stride_do, stride_l, nheads, seqlen_q, head_dim_v,
                    padded_q, softmax_scale,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ACC_INIT: tl.constexpr):
    """delta of BLOCK_M rows of a (batch, head), less the lse's own gradient where one is given (DLse,
    laid out as Lse): d lse_i / d s_ij = p_ij, so dS = P (dP - delta + dlse). ACC_INIT: also the Gluon
    dK/dV kernel's starting values of its S^T and dP^T accumulators per query row, -lse / softmax_scale
    and -delta
    (AccInit[0] and [1], each (batch * nheads, padded_q): rows up to a whole tile, which read
    -inf and 0, so that their P is 0)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_dv = tl.arange(0, BLOCK_DV)  # (O's and dO's head dim: v's)
    o = read_tile(Out, stride_o, off_b, off_h, 0, start_m, rows, seqlen_q, offs_dv, head_dim_v, True).to(tl.float32)
    do = read_tile(DO, stride_do, off_b, off_h, 0, start_m, rows, seqlen_q, offs_dv, head_dim_v, True).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row_ptr = off_b * stride_l[0] + off_h * stride_l[1] + offs_m
    if DLse is not None:
        delta -= tl.load(DLse + row_ptr, mask=offs_m < seqlen_q, other=0.0)
    tl.store(Delta + row_ptr, delta, mask=offs_m < seqlen_q)
    if ACC_INIT:
        lse = tl.load(Lse + row_ptr, mask=offs_m < seqlen_q, other=float("inf"))
        init_ptr = AccInit + off_bh.to(tl.int64) * padded_q + offs_m
        rows_total = tl.num_programs(1).to(tl.int64) * padded_q
        tl.store(init_ptr, -lse / softmax_scale)  # the grid covers padded_q rows exactly
        tl.store(init_ptr + rows_total, -delta)


@triton.jit
def _attn_bwd_dq_cast(DQAcc, DQ, stride_a, stride_dq, nheads, seqlen_q, head_dim, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """DQ = DQAcc in DQ's dtype, one program per BLOCK_M rows of a (batch, head)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_b = (tl.program_id(1) // nheads).to(tl.int64)
    off_h = (tl.program_id(1) % nheads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dq_ptrs = tile_ptrs(DQ, stride_dq, off_b, off_h, start_m, rows, offs_d)
    dq = read_tile(DQAcc, stride_a, off_b, off_h, 0, start_m, rows, seqlen_q, offs_d, head_dim, True)
    store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), start_m + rows, seqlen_q, offs_d, head_dim, True)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, rows_in, dq_io, mask, mods, offs, lo, hi, listed, bounds, qk_scale, drop,
                         BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                         EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
                         DQ_HERE: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
                         SCORE_MOD_GRAD: tl.constexpr, LISTED: tl.constexpr):
    """Query tiles [lo, hi) of one head into (dk, dv), or (LISTED) the tiles of the query blocks of a
    block mask's list `listed` (common.tile_start); MASKED applies the query bound and the band's
    edges. Works on transposed scores (keys along rows) so that dK, dV need no transposes. DQ_HERE
    (the tile holds every key): each row's delta from O and its whole dQ, stored, where dq_io is
    (O's and dQ's pointers to this head's query tile at row 0, their row strides, softmax_scale).
    The other argument groups are _attn_bwd_dkdv's."""
    q_do, row_strides, lse_ptr, delta_ptr = rows_in
    offs_n, offs_m, offs_d, offs_dv = offs
    seqlen_q = bounds[0]
    head_dims = bounds[2]
    if not LISTED:
        q_do = advance(q_do, row_strides, tl.cast(lo, tl.int64), TMA)
    for it in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        start_m = tile_start(it, listed, BLOCK_M, LISTED)
        rows = start_m + offs_m
        q_do_at = q_do
        if LISTED:
            q_do_at = advance(q_do, row_strides, tl.cast(start_m, tl.int64), TMA)
        q, do = load_pair(q_do_at, start_m, rows, seqlen_q, (offs_d, offs_dv), head_dims, MASKED, not EVEN_D,
                          not EVEN_DV, TMA)
        if MASKED:
            # Rows past seqlen_q read lse = +inf, so that their P is exactly 0.
            lse = tl.load(lse_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
        else:
            lse = tl.load(lse_ptr + rows)
        if DQ_HERE:  # (as _attn_bwd_delta computes it)
            o = load_tile(dq_io[0] + tl.cast(start_m, tl.int64) * dq_io[2], rows, seqlen_q, offs_dv, head_dims[1],
                          True, not EVEN_DV)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        elif MASKED:
            delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
        else:
            delta = tl.load(delta_ptr + rows)
        x_t = mma(k, tl.trans(q), None, INPUT_PRECISION) * qk_scale
        s_t = score_tile(x_t, rows[None, :], offs_n[:, None], bounds, mask, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                         mods, SCORE_MOD, MASK_MOD)
        p_t = tl.math.exp2(s_t - lse[None, :] * LOG2E)  # 0 where s = -inf or lse = +inf
        # dV before dP: the faster order of the two dots (docs/tuning.md).
        if DROPOUT:
            keep = dropout_keep(drop, rows[None, :], offs_n[:, None])
            dv = mma(tl.where(keep, p_t, 0.0).to(do.dtype), do, dv, INPUT_PRECISION)
            dp_t = tl.where(keep, mma(v, tl.trans(do), None, INPUT_PRECISION) * drop[2], 0.0)
        else:
            dv = mma(p_t.to(do.dtype), do, dv, INPUT_PRECISION)
            dp_t = mma(v, tl.trans(do), None, INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SCORE_MOD_GRAD is not None:  # (adds the captured tensors' gradients, mods[4])
            # Keys past the end (a ragged last key tile) reach no stored dK row, but would reach those sums.
            ds_t = tl.where(offs_n[:, None] < bounds[1], ds_t, 0.0)
            ds_t = SCORE_MOD_GRAD(x_t, mods[0], mods[1], rows[None, :], offs_n[:, None], mods[2], ds_t, mods[4])
        dk = mma(ds_t.to(q.dtype), q, dk, INPUT_PRECISION)
        if DQ_HERE:
            dq = mma(tl.trans(ds_t).to(k.dtype), k, None, INPUT_PRECISION) * dq_io[4]
            store_tile(dq_io[1] + tl.cast(start_m, tl.int64) * dq_io[3], dq.to(dq_io[1].dtype.element_ty), rows,
                       seqlen_q, offs_d, head_dims[0], not EVEN_D)
        if not LISTED:
            q_do = advance(q_do, row_strides, BLOCK_M, TMA)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_listed(dk, dv, k, v, rows_in, mask, mods, offs, bounds, qk_scale, drop, lists, column,
                          BLOCK_M: tl.constexpr, SPARSE_Q: tl.constexpr, HAS_FULL: tl.constexpr,
                          EVEN_BLOCKS: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                          EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, SCORE_MOD: tl.constexpr,
                          MASK_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr):
    """The query blocks a block mask lists for key block `column` (lists as _attn_fwd_listed's, by key
    block): those that partly see it, through the mask_mod, then (HAS_FULL) those that wholly see it
    (masked at the queries' end unless EVEN_BLOCKS). One loop per list, each over every tile of it."""
    count, first, stride = listed_blocks(lists[0], lists[1], lists[4], False, mods[0], mods[1], column)
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, rows_in, (0, 0, 0, 0, 0), mask, mods, offs, 0, count * SPARSE_Q, (first, stride), bounds,
        qk_scale, drop, BLOCK_M, True, False, False, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV, INPUT_PRECISION, TMA,
        False, False, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD, SPARSE_Q)
    if HAS_FULL:
        count, first, stride = listed_blocks(lists[2], lists[3], lists[4], True, mods[0], mods[1], column)
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, rows_in, (0, 0, 0, 0, 0), mask, mods, offs, 0, count * SPARSE_Q, (first, stride), bounds,
            qk_scale, drop, BLOCK_M, not EVEN_BLOCKS, False, False, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV,
            INPUT_PRECISION, TMA, False, False, SCORE_MOD, None, SCORE_MOD_GRAD, SPARSE_Q)
    return dk, dv


@triton.jit
def _head_rows(q_src, do_src, Lse, Delta, Out, DQ, stride_q, stride_do, stride_o, stride_dq, row_first, off_b, off_h,
               q_first, offs_m, offs_d, offs_dv, softmax_scale, DQ_HERE: tl.constexpr):
    """What _attn_bwd_dkdv_inner reads of one query head: (its Q and dO row sources, their row strides,
    its lse and delta rows) and, DQ_HERE (delta from O: Delta is None), dq_io (O's and dQ's pointers
    to the head's rows, their row strides, softmax_scale)."""
    if DQ_HERE:
        rows_in = ((q_src, do_src), (stride_q[1], stride_do[1]), Lse + row_first, 0)
        dq_io = (tile_ptrs(Out, stride_o, off_b, off_h, q_first, offs_m, offs_dv),
                 tile_ptrs(DQ, stride_dq, off_b, off_h, q_first, offs_m, offs_d), stride_o[1], stride_dq[1],
                 softmax_scale)
    else:
        rows_in = ((q_src, do_src), (stride_q[1], stride_do[1]), Lse + row_first, Delta + row_first)
        dq_io = (0, 0, 0, 0, 0)
    return rows_in, dq_io


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, Out, DQ, CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, Mask, Rng,
                   BlockNum, BlockIdx, FullNum, FullIdx, score_args, mask_args, score_grads,
                   stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, stride_o, stride_dq, stride_l,
                   stride_mask, stride_blocks,
                   nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, group_size, bottom_right, window_left,
                   window_right, softmax_scale, qk_scale, drop_threshold, drop_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
                   DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   SPLIT_GROUP_ACC: tl.constexpr,
                   TMA: tl.constexpr, WS: tl.constexpr, DQ_HERE: tl.constexpr, SCORE_MOD: tl.constexpr,
                   MASK_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr, SPARSE: tl.constexpr, HAS_FULL: tl.constexpr,
                   SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr, EVEN_BLOCKS: tl.constexpr):
    """dK, dV of BLOCK_N keys of one KV head. DQ_HERE (the grid's one program per (batch, KV head)
    holds every key of its sequence): also delta and dQ of the group's query heads, the whole
    backward in one launch (Delta None; otherwise Out, DQ and their strides None)."""
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1)
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    q_first, seqlen_q = sequence(CuSeqlensQ, SeqUsedQ, off_b, seqlen_q, VARLEN)
    k_first, seqlen_k = sequence(CuSeqlensK, SeqUsedK, off_b, seqlen_k, VARLEN)
    cols, offs_n, offs_m, offs_d, offs_dv = tile_aranges(start_n, BLOCK_N, BLOCK_M, BLOCK_D, BLOCK_DV)
    if DQ_HERE:
        if HAS_LEFT or HAS_RIGHT or VARLEN:
            # Rows that see no key (outside the band, or a varlen sequence without keys) get dQ = 0; the
            # band's rows overwrite theirs after the barrier.
            for g in range(0, group_size):
                zero_ptrs = tile_ptrs(DQ, stride_dq, off_b, off_hk * group_size + g, q_first, offs_m, offs_d)
                for start_m in range(0, seqlen_q, BLOCK_M):
                    store_tile(zero_ptrs + tl.cast(start_m, tl.int64) * stride_dq[1],
                               tl.zeros([BLOCK_M, BLOCK_D], DQ.dtype.element_ty), start_m + offs_m, seqlen_q, offs_d,
                               head_dim, not EVEN_D)
            tl.debug_barrier()
    if VARLEN:
        if start_n >= seqlen_k:  # the grid covers the longest sequence
            return
    offset = bottom_right * (seqlen_k - seqlen_q)

    k = read_tile(K, stride_k, off_b, off_hk, k_first, start_n, cols, seqlen_k, offs_d, head_dim, not EVEN_D)
    v = read_tile(V, stride_v, off_b, off_hk, k_first, start_n, cols, seqlen_k, offs_dv, head_dim_v, not EVEN_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query row i sees key j when j - offset - window_right <= i <= j - offset + window_left.
    edges = band(start_n, BLOCK_N, seqlen_q, BLOCK_M, -offset - window_right, window_left - offset, HAS_RIGHT,
                 HAS_LEFT)
    offs = (offs_n, offs_m, offs_d, offs_dv)
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
    for g in range(0, group_size):
        if SPLIT_GROUP_ACC:
            # fp32: each query head of the group sums into fresh registers, added at the end, so
            # that rounding grows with seqlen_q, not group_size * seqlen_q. fp16/bf16 skip it: the
            # extra accumulators would cost registers and their rounding is far below the dtype's.
            dk_head = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv_head = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        else:
            dk_head = dk
            dv_head = dv
        off_h = off_hk * group_size + g
        q_src = row_source(Q, stride_q, off_b, off_h, q_first, seqlen_q, head_dim, offs_m, offs_d, BLOCK_M, BLOCK_D,
                           TMA)
        do_src = row_source(DO, stride_do, off_b, off_h, q_first, seqlen_q, head_dim_v, offs_m, offs_dv, BLOCK_M,
                            BLOCK_DV, TMA)
        row_first = off_b * stride_l[0] + off_h * stride_l[1] + q_first
        mask_ptrs, drop_key = head_options(Mask, stride_mask, Rng, off_b, off_h, off_b * nheads_k * group_size + off_h,
                                           MASK_KIND, DROPOUT)
        rows_in, dq_io = _head_rows(q_src, do_src, Lse, Delta, Out, DQ, stride_q, stride_do, stride_o, stride_dq,
                                    row_first, off_b, off_h, q_first, offs_m, offs_d, offs_dv, softmax_scale, DQ_HERE)
        mask = (mask_ptrs, stride_mask[2], stride_mask[3])
        drop = (drop_key, drop_threshold, drop_scale)
        mods = (off_b.to(tl.int32), off_h.to(tl.int32), score_args, mask_args, score_grads)
        if SPARSE:  # the query blocks the block mask lists: partly seeing this key block, then wholly
            dk_head, dv_head = _attn_bwd_dkdv_listed(
                dk_head, dv_head, k, v, rows_in, mask, mods, offs, bounds, qk_scale, drop,
                (BlockNum, BlockIdx, FullNum, FullIdx, stride_blocks), start_n // SPARSE_KV, BLOCK_M, SPARSE_Q,
                HAS_FULL, EVEN_BLOCKS, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, SCORE_MOD,
                MASK_MOD, SCORE_MOD_GRAD)
        else:  # the query tiles in three parts: those a causal diagonal or window's right edge cuts (masked;
            # none without a right edge), those that see every key of the tile (unmasked, the loop that may be
            # warp-specialized), those a window's left edge or the queries' end cuts (masked)
            for part in tl.static_range(1 - HAS_RIGHT, 3):
                dk_head, dv_head = _attn_bwd_dkdv_inner(
                    dk_head, dv_head, k, v, rows_in, dq_io, mask, mods, offs, edges[part], edges[part + 1], (0, 0),
                    bounds, qk_scale, drop, BLOCK_M, part != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT,
                    EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, WS & (part == 1), DQ_HERE, SCORE_MOD, MASK_MOD,
                    SCORE_MOD_GRAD, 0)
        if SPLIT_GROUP_ACC:
            dk += dk_head
            dv += dv_head
        else:
            dk = dk_head
            dv = dv_head

    if DROPOUT:
        dv = dv * drop_scale
    dk_ptrs = tile_ptrs(DK, stride_dk, off_b, off_hk, k_first + start_n, cols, offs_d)
    dv_ptrs = tile_ptrs(DV, stride_dv, off_b, off_hk, k_first + start_n, cols, offs_dv)
    store_tile(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, head_dim, not EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_dv, head_dim_v, not EVEN_DV)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, kv, mask, mods, offs, lo, hi, listed, bounds, qk_scale, drop,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                       HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                       EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
                       SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr,
                       LISTED: tl.constexpr):
    """K/V tiles [lo, hi) into dq, or (LISTED) the tiles of the key blocks of a block mask's list
    `listed`; MASKED applies the key bound and the band's edges. The argument groups are _attn_bwd_dq's."""
    k_v, row_strides = kv
    offs_m, offs_n, offs_d, offs_dv = offs
    if not LISTED:
        k_v = advance(k_v, row_strides, tl.cast(lo, tl.int64), TMA)
    for it in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tile_start(it, listed, BLOCK_N, LISTED)
        cols = start_n + offs_n
        k_v_at = k_v
        if LISTED:
            k_v_at = advance(k_v, row_strides, tl.cast(start_n, tl.int64), TMA)
        k, v = load_pair(k_v_at, start_n, cols, bounds[1], (offs_d, offs_dv), bounds[2], MASKED, not EVEN_D,
                         not EVEN_DV, TMA)
        x = mma(q, tl.trans(k), None, INPUT_PRECISION) * qk_scale
        s = score_tile(x, offs_m[:, None], cols[None, :], bounds, mask, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND, mods,
                       SCORE_MOD, MASK_MOD)
        p = tl.math.exp2(s - lse[:, None])
        dp = mma(do, tl.trans(v), None, INPUT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(drop, offs_m[:, None], cols[None, :])
            dp = tl.where(keep, dp * drop[2], 0.0)
        ds = p * (dp - delta[:, None])
        if SCORE_MOD_GRAD is not None:  # (this pass adds no captured tensor's gradient: mods[4] is empty)
            ds = SCORE_MOD_GRAD(x, mods[0], mods[1], offs_m[:, None], cols[None, :], mods[2], ds, mods[4])
        dq = mma(ds.to(k.dtype), k, dq, INPUT_PRECISION)
        if not LISTED:
            k_v = advance(k_v, row_strides, BLOCK_N, TMA)
    return dq


@triton.jit
def _attn_bwd_dq_listed(dq, q, do, lse, delta, kv, mask, mods, offs, bounds, qk_scale, drop, lists, row,
                        BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, HAS_FULL: tl.constexpr,
                        EVEN_BLOCKS: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                        EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                        SCORE_MOD: tl.constexpr,
                        MASK_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr):
    """The key blocks a block mask lists for query block `row`, as _attn_fwd_listed visits them."""
    count, first, stride = listed_blocks(lists[0], lists[1], lists[4], False, mods[0], mods[1], row)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, kv, mask, mods, offs, 0, count * SPARSE_KV, (first, stride),
                            bounds, qk_scale, drop, BLOCK_N, True, False, False, MASK_KIND, DROPOUT,
                            EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, False, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD,
                            SPARSE_KV)
    if HAS_FULL:
        count, first, stride = listed_blocks(lists[2], lists[3], lists[4], True, mods[0], mods[1], row)
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, kv, mask, mods, offs, 0, count * SPARSE_KV, (first, stride),
                                bounds, qk_scale, drop, BLOCK_N, not EVEN_BLOCKS, False, False, MASK_KIND, DROPOUT,
                                EVEN_D, EVEN_DV, INPUT_PRECISION, TMA, False, SCORE_MOD, None, SCORE_MOD_GRAD,
                                SPARSE_KV)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, Mask, Rng,
                 BlockNum, BlockIdx, FullNum, FullIdx, score_args, mask_args, score_grads,
                 stride_q, stride_k, stride_v, stride_do, stride_dq, stride_l, stride_mask,
                 stride_blocks,
                 nheads, seqlen_q, seqlen_k, head_dim, head_dim_v, group_size, bottom_right, window_left, window_right,
                 softmax_scale, qk_scale, drop_threshold, drop_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                 EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                 WS: tl.constexpr,
                 SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr, SPARSE: tl.constexpr,
                 HAS_FULL: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
                 EVEN_BLOCKS: tl.constexpr):
    start_m, off_bh, off_b, off_h, q_first, seqlen_q, k_first, seqlen_k = query_program(
        CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, seqlen_q, seqlen_k, nheads, BLOCK_M, HAS_RIGHT, VARLEN)
    off_hk = off_h // group_size
    if VARLEN:
        if start_m >= seqlen_q:
            return
    offset = bottom_right * (seqlen_k - seqlen_q)
    rows, offs_m, offs_n, offs_d, offs_dv = tile_aranges(start_m, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)

    q = read_tile(Q, stride_q, off_b, off_h, q_first, start_m, rows, seqlen_q, offs_d, head_dim, not EVEN_D)
    do = read_tile(DO, stride_do, off_b, off_h, q_first, start_m, rows, seqlen_q, offs_dv, head_dim_v, not EVEN_DV)
    row_ptr = off_b * stride_l[0] + off_h * stride_l[1] + q_first + offs_m
    lse = tl.load(Lse + row_ptr, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_ptr, mask=offs_m < seqlen_q, other=0.0)
    k_src = row_source(K, stride_k, off_b, off_hk, k_first, seqlen_k, head_dim, offs_n, offs_d, BLOCK_N, BLOCK_D, TMA)
    v_src = row_source(V, stride_v, off_b, off_hk, k_first, seqlen_k, head_dim_v, offs_n, offs_dv, BLOCK_N, BLOCK_DV,
                       TMA)
    mask_ptrs, drop_key = head_options(Mask, stride_mask, Rng, off_b, off_h, off_bh, MASK_KIND, DROPOUT)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The key tiles in three parts, as in the forward's _attn_fwd.
    edges = band(start_m, BLOCK_M, seqlen_k, BLOCK_N, offset - window_left, offset + window_right, HAS_LEFT,
                 HAS_RIGHT)
    kv = ((k_src, v_src), (stride_k[1], stride_v[1]))
    mask = (mask_ptrs, stride_mask[2], stride_mask[3])
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
    drop = (drop_key, drop_threshold, drop_scale)
    offs = (offs_m, offs_n, offs_d, offs_dv)
    mods = (off_b.to(tl.int32), off_h.to(tl.int32), score_args, mask_args, score_grads)
    if SPARSE:  # the key blocks the block mask lists, as in the forward
        dq = _attn_bwd_dq_listed(dq, q, do, lse, delta, kv, mask, mods, offs, bounds, qk_scale, drop,
                                 (BlockNum, BlockIdx, FullNum, FullIdx, stride_blocks), start_m // SPARSE_Q, BLOCK_N,
                                 SPARSE_KV, HAS_FULL, EVEN_BLOCKS, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV,
                                 INPUT_PRECISION, TMA, SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD)
    else:
        for part in tl.static_range(1 - HAS_LEFT, 3):
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse, delta, kv, mask, mods, offs, edges[part], edges[part + 1], (0, 0), bounds, qk_scale,
                drop, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, EVEN_D, EVEN_DV,
                INPUT_PRECISION, TMA, WS & (part == 1), SCORE_MOD, MASK_MOD, SCORE_MOD_GRAD, 0)
    dq_ptrs = tile_ptrs(DQ, stride_dq, off_b, off_h, q_first + start_m, rows, offs_d)
    store_tile(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim, not EVEN_D)


def delta_launch(t: dict, prob: Problem, params: AttentionParams, acc_init: bool):
    """(kernel, grid, keyword arguments) of the delta kernel for kernels/launch.py; acc_init: also
    the Gluon dK/dV kernel's accumulator starting values, into t["AccInit"] (a new workspace)."""
    q, dout = t["Q"], t["DO"]
    # delta over the rows as stored: a varlen batch is one sequence of total_q rows here.
    rows, batch = (q.shape[0], 1) if params.varlen else (prob.seqlen_q, prob.batch)
    padded_q = cdiv(prob.seqlen_q, ROWS_PER_PROGRAM) * ROWS_PER_PROGRAM  # whole query tiles of the Gluon kernels
    if acc_init:
        # Every element written (the grid covers padded_q rows of each (batch, head)) before the dK/dV kernel reads.
        t["AccInit"] = workspace((2, prob.batch * prob.nheads, padded_q), torch.float32, q.device, zeroed=False)
    return _attn_bwd_delta, (cdiv(rows, ROWS_PER_PROGRAM), batch * prob.nheads), dict(
        Out=t["Out"], DO=dout, Lse=t["Lse"], DLse=t.get("DLse"), Delta=t["Delta"], AccInit=t.get("AccInit"),
        stride_o=prob.strides(t["Out"]), stride_do=prob.strides(dout), stride_l=lse_strides(prob, params),
        nheads=prob.nheads,
        seqlen_q=rows, head_dim_v=prob.head_dim_v, padded_q=padded_q, softmax_scale=params.softmax_scale,
        BLOCK_M=ROWS_PER_PROGRAM, BLOCK_DV=prob.block_dv, ACC_INIT=acc_init,
    )


def _shared_args(t: dict, prob: Problem, params: AttentionParams) -> dict:
    """The arguments the dK/dV and dQ kernels share."""
    q, k, v, dout = t["Q"], t["K"], t["V"], t["DO"]
    return dict(Q=q, K=k, V=v, DO=dout, Lse=t["Lse"], Delta=t.get("Delta"),
                stride_q=prob.strides(q), stride_k=prob.strides(k), stride_v=prob.strides(v),
                stride_do=prob.strides(dout), stride_l=lse_strides(prob, params),
                **kernel_tensors(variant_tensors(params)),
                **variant_args(params, prob), seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, **prob.dims(),
                group_size=prob.nheads // prob.nheads_k, softmax_scale=params.softmax_scale)


def dkdv_launch(t: dict, prob: Problem, params: AttentionParams, tiles: Tiles, dq_here: bool = False):
    """The dK/dV kernel: a program per tiles.block_n keys of one (batch, KV head). dq_here (every
    key within one tile, no t["Delta"]): the kernel computes delta and dQ too, the whole backward."""
    grid = (cdiv(prob.seqlen_k, tiles.block_n), prob.batch * prob.nheads_k)
    assert not dq_here or grid[0] == 1, "dQ in the dK/dV kernel needs one key tile"
    if dq_here:
        dq_io = dict(Out=t["Out"], DQ=t["DQ"], stride_o=prob.strides(t["Out"]), stride_dq=prob.strides(t["DQ"]))
    else:
        dq_io = dict.fromkeys(("Out", "DQ", "stride_o", "stride_dq"))
    return _attn_bwd_dkdv, grid, dict(
        DK=t["DK"], DV=t["DV"], stride_dk=prob.strides(t["DK"]), stride_dv=prob.strides(t["DV"]), **dq_io,
        **_shared_args(t, prob, params), **mod_args(params, prob, "dkdv"), nheads_k=prob.nheads_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        INPUT_PRECISION=tiles.input_precision, SPLIT_GROUP_ACC=prob.q.dtype == torch.float32, TMA=tiles.tma,
        WS=tiles.warp_specialize, DQ_HERE=dq_here, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def dq_launch(t: dict, prob: Problem, params: AttentionParams, tiles: Tiles):
    """The dQ kernel: a program per tiles.block_m query rows of one (batch, head)."""
    grid = (cdiv(prob.seqlen_q, tiles.block_m), prob.batch * prob.nheads)
    return _attn_bwd_dq, grid, dict(
        DQ=t["DQ"], stride_dq=prob.strides(t["DQ"]), **_shared_args(t, prob, params), **mod_args(params, prob, "dq"),
        nheads=prob.nheads,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, INPUT_PRECISION=tiles.input_precision,
        TMA=tiles.tma, WS=tiles.warp_specialize, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def cast_launch(t: dict, prob: Problem):
    """DQ from the fused dK/dV kernel's fp32 sum t["DQAcc"]."""
    return _attn_bwd_dq_cast, (cdiv(prob.seqlen_q, ROWS_PER_PROGRAM), prob.batch * prob.nheads), dict(
        DQAcc=t["DQAcc"], DQ=t["DQ"], stride_a=prob.strides(t["DQAcc"]), stride_dq=prob.strides(t["DQ"]),
        nheads=prob.nheads, seqlen_q=prob.seqlen_q, head_dim=prob.head_dim, BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_D=prob.block_d)
