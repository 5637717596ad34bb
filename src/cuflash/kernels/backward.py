"""Backward pass: FlashAttention-2, Algorithm 2, by recomputation from the log-sum-exp.

Three launches, none of them atomic, so the result is bitwise reproducible:
  _attn_bwd_delta  delta = rowsum(dO * O), one value per query row;
  _attn_bwd_dkdv   one program per K/V tile of one KV head: streams the query tiles of every
                   query head that shares the KV head (MQA/GQA sums there), accumulating dK, dV;
  _attn_bwd_dq     one program per query tile: streams the K/V tiles, accumulating dQ.
With P = exp(S - lse):  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
dQ = scale * dS K,  dK = scale * dS^T Q.
"""
import torch
import triton
import triton.language as tl

from .common import LOG2E, key_range, load_tile, mma, store_tile, tile_ptrs, visible
from .config import Launch, backward_configs


@triton.jit
def _attn_bwd_delta(Out, DO, Delta,
                    stride_ob, stride_om, stride_oh,
                    stride_dob, stride_dom, stride_doh,
                    nheads, seqlen_q, head_dim,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = tile_ptrs(Out, off_b, stride_ob, off_h, stride_oh, start_m, stride_om, rows, offs_d)
    do_ptrs = tile_ptrs(DO, off_b, stride_dob, off_h, stride_doh, start_m, stride_dom, rows, offs_d)
    o = load_tile(o_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, True).to(tl.float32)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, True).to(tl.float32)
    tl.store(Delta + off_bh.to(tl.int64) * seqlen_q + offs_m, tl.sum(o * do, 1), mask=offs_m < seqlen_q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, lse_ptr, delta_ptr,
                         offs_n, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, head_dim,
                         causal_offset, qk_scale,
                         BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                         EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Works on transposed scores (keys along rows) so that dK, dV need no transposes.
    q_ptrs += tl.cast(lo, tl.int64) * stride_qm
    do_ptrs += tl.cast(lo, tl.int64) * stride_dom
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = load_tile(q_ptrs, rows, seqlen_q, offs_d, head_dim, MASKED, not EVEN_D)
        do = load_tile(do_ptrs, rows, seqlen_q, offs_d, head_dim, MASKED, not EVEN_D)
        if MASKED:
            # Rows past seqlen_q read lse = +inf, so that their P is exactly 0.
            lse = tl.load(lse_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse = tl.load(lse_ptr + rows)
            delta = tl.load(delta_ptr + rows)
        s_t = mma(k, tl.trans(q), None, INPUT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :] * LOG2E)
        if MASKED:
            p_t = tl.where(visible(rows[None, :], offs_n[:, None], seqlen_k, causal_offset, CAUSAL), p_t, 0.0)
        dv = mma(p_t.to(do.dtype), do, dv, INPUT_PRECISION)
        dp_t = mma(v, tl.trans(do), None, INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = mma(ds_t.to(q.dtype), q, dk, INPUT_PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV,
                   stride_qb, stride_qm, stride_qh,
                   stride_kb, stride_kn, stride_kh,
                   stride_vb, stride_vn, stride_vh,
                   stride_dob, stride_dom, stride_doh,
                   stride_dkb, stride_dkn, stride_dkh,
                   stride_dvb, stride_dvn, stride_dvh,
                   nheads_k, seqlen_q, seqlen_k, head_dim, group_size, causal_offset,
                   softmax_scale, qk_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   SPLIT_GROUP_ACC: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1)
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k_ptrs = tile_ptrs(K, off_b, stride_kb, off_hk, stride_kh, start_n, stride_kn, cols, offs_d)
    v_ptrs = tile_ptrs(V, off_b, stride_vb, off_hk, stride_vh, start_n, stride_vn, cols, offs_d)
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, head_dim, True, not EVEN_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, head_dim, True, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query tiles [lo, full_lo) straddle the causal diagonal and need the mask, [full_lo, full_hi)
    # see every key of this tile, [full_hi, seqlen_q) is the ragged last tile. Rows before lo
    # cannot see any key of this tile and are skipped.
    if CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M,
                             seqlen_q)
    else:
        lo = 0
        full_lo = 0
    full_hi = tl.maximum(full_lo, seqlen_q // BLOCK_M * BLOCK_M)

    for g in range(0, group_size):
        if SPLIT_GROUP_ACC:
            # fp32: each query head of the group sums into fresh registers, added at the end, so
            # that rounding grows with seqlen_q, not group_size * seqlen_q. fp16/bf16 skip it: the
            # extra accumulators would cost registers and their rounding is far below the dtype's.
            dk_head = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv_head = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        else:
            dk_head = dk
            dv_head = dv
        off_h = off_hk * group_size + g
        off_bh = off_b * nheads_k * group_size + off_h
        q_ptrs = tile_ptrs(Q, off_b, stride_qb, off_h, stride_qh, 0, stride_qm, offs_m, offs_d)
        do_ptrs = tile_ptrs(DO, off_b, stride_dob, off_h, stride_doh, 0, stride_dom, offs_m, offs_d)
        lse_ptr = Lse + off_bh * seqlen_q
        delta_ptr = Delta + off_bh * seqlen_q
        dk_head, dv_head = _attn_bwd_dkdv_inner(
            dk_head, dv_head, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, lse_ptr, delta_ptr, offs_n, offs_m,
            offs_d, lo, full_lo, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale,
            BLOCK_M, CAUSAL, True, EVEN_D, INPUT_PRECISION)
        dk_head, dv_head = _attn_bwd_dkdv_inner(
            dk_head, dv_head, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, lse_ptr, delta_ptr, offs_n, offs_m,
            offs_d, full_lo, full_hi, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale,
            BLOCK_M, CAUSAL, False, EVEN_D, INPUT_PRECISION)
        dk_head, dv_head = _attn_bwd_dkdv_inner(
            dk_head, dv_head, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, lse_ptr, delta_ptr, offs_n, offs_m,
            offs_d, full_hi, seqlen_q, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale,
            BLOCK_M, CAUSAL, True, EVEN_D, INPUT_PRECISION)
        if SPLIT_GROUP_ACC:
            dk += dk_head
            dv += dv_head
        else:
            dk = dk_head
            dv = dv_head

    dk_ptrs = tile_ptrs(DK, off_b, stride_dkb, off_hk, stride_dkh, start_n, stride_dkn, cols, offs_d)
    dv_ptrs = tile_ptrs(DV, off_b, stride_dvb, off_hk, stride_dvh, start_n, stride_dvn, cols, offs_d)
    store_tile(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, head_dim, not EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, head_dim, not EVEN_D)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                       offs_m, offs_n, offs_d, lo, hi, seqlen_k, head_dim, causal_offset, qk_scale,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                       EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    k_ptrs += tl.cast(lo, tl.int64) * stride_kn
    v_ptrs += tl.cast(lo, tl.int64) * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D)
        s = mma(q, tl.trans(k), None, INPUT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(visible(offs_m[:, None], cols[None, :], seqlen_k, causal_offset, CAUSAL), p, 0.0)
        dp = mma(do, tl.trans(v), None, INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = mma(ds.to(k.dtype), k, dq, INPUT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ,
                 stride_qb, stride_qm, stride_qh,
                 stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh,
                 stride_dob, stride_dom, stride_doh,
                 stride_dqb, stride_dqm, stride_dqh,
                 nheads, seqlen_q, seqlen_k, head_dim, group_size, causal_offset,
                 softmax_scale, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    off_hk = off_h // group_size
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = tile_ptrs(Q, off_b, stride_qb, off_h, stride_qh, start_m, stride_qm, rows, offs_d)
    do_ptrs = tile_ptrs(DO, off_b, stride_dob, off_h, stride_doh, start_m, stride_dom, rows, offs_d)
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, not EVEN_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, not EVEN_D)
    row_ptr = off_bh.to(tl.int64) * seqlen_q + offs_m
    lse = tl.load(Lse + row_ptr, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_ptr, mask=offs_m < seqlen_q, other=0.0)
    k_ptrs = tile_ptrs(K, off_b, stride_kb, off_hk, stride_kh, 0, stride_kn, offs_n, offs_d)
    v_ptrs = tile_ptrs(V, off_b, stride_vb, off_hk, stride_vh, 0, stride_vn, offs_n, offs_d)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, end = key_range(start_m, seqlen_k, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                            offs_m, offs_n, offs_d, 0, full_end, seqlen_k, head_dim, causal_offset,
                            qk_scale, BLOCK_N, CAUSAL, False, EVEN_D, INPUT_PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                            offs_m, offs_n, offs_d, full_end, end, seqlen_k, head_dim, causal_offset,
                            qk_scale, BLOCK_N, CAUSAL, True, EVEN_D, INPUT_PRECISION)
    dq_ptrs = tile_ptrs(DQ, off_b, stride_dqb, off_h, stride_dqh, start_m, stride_dqm, rows, offs_d)
    store_tile(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim, not EVEN_D)


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, causal_offset: int,
                       configs: tuple[Launch, Launch] | None = None):
    """Gradients of attention_forward. dout, q, out (B, Nq, H, D); k, v (B, Nk, Hk, D);
    lse (B, H, Nq) fp32. Returns dq, dk, dv shaped like q, k, v."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    group_size = nheads // nheads_k
    block_d = max(16, triton.next_power_of_2(head_dim))
    even_d = head_dim == block_d
    dkdv_cfg, dq_cfg = configs or backward_configs(q, block_d, causal)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qk_scale = softmax_scale * LOG2E.value

    delta_block_m = 64
    _attn_bwd_delta[(triton.cdiv(seqlen_q, delta_block_m), batch * nheads)](
        out, dout, delta,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        nheads, seqlen_q, head_dim, BLOCK_M=delta_block_m, BLOCK_D=block_d,
    )
    _attn_bwd_dkdv[(triton.cdiv(seqlen_k, dkdv_cfg.block_n), batch * nheads_k)](
        q, k, v, dout, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        nheads_k, seqlen_q, seqlen_k, head_dim, group_size, causal_offset, softmax_scale, qk_scale,
        BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n, BLOCK_D=block_d, CAUSAL=causal,
        EVEN_D=even_d, INPUT_PRECISION=dkdv_cfg.input_precision, SPLIT_GROUP_ACC=q.dtype == torch.float32,
        num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages,
    )
    _attn_bwd_dq[(triton.cdiv(seqlen_q, dq_cfg.block_m), batch * nheads)](
        q, k, v, dout, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        nheads, seqlen_q, seqlen_k, head_dim, group_size, causal_offset, softmax_scale, qk_scale,
        BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, BLOCK_D=block_d, CAUSAL=causal,
        EVEN_D=even_d, INPUT_PRECISION=dq_cfg.input_precision,
        num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages,
    )
    return dq, dk, dv
