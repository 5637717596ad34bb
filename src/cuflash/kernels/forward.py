"""Forward pass: FlashAttention-2, Algorithm 1.

Each program owns one tile of BLOCK_M query rows of one (batch, head) and streams K/V tiles
through it, keeping the running row max m_i, the running sum l_i and the unnormalized output in
registers. Logits are kept in base 2 (LOG2E folded into the scale) so the softmax uses exp2.
"""
import torch
import triton
import triton.language as tl

from .common import LN2, LOG2E, key_range, load_tile, mma, store_tile, tile_ptrs, visible
from .config import Launch, forward_config


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                    lo, hi, seqlen_k, head_dim, causal_offset, qk_scale,
                    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    k_ptrs += tl.cast(lo, tl.int64) * stride_kn
    v_ptrs += tl.cast(lo, tl.int64) * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D)
        s = mma(q, tl.trans(k), None, INPUT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(visible(offs_m[:, None], cols[None, :], seqlen_k, causal_offset, CAUSAL),
                         s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row with no visible key yet keeps m = -inf; shift by 0 so that exp2 sees -inf, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse,
              stride_qb, stride_qm, stride_qh,
              stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh,
              stride_ob, stride_om, stride_oh,
              nheads, seqlen_q, seqlen_k, head_dim, group_size, causal_offset, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    off_hk = off_h // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    rows = tl.arange(0, BLOCK_M)
    q_ptrs = tile_ptrs(Q, off_b, stride_qb, off_h, stride_qh, start_m, stride_qm, rows, offs_d)
    k_ptrs = tile_ptrs(K, off_b, stride_kb, off_hk, stride_kh, 0, stride_kn, offs_n, offs_d)
    v_ptrs = tile_ptrs(V, off_b, stride_vb, off_hk, stride_vh, 0, stride_vn, offs_n, offs_d)
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, not EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, end = key_range(start_m, seqlen_k, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
                                    offs_m, offs_n, offs_d, 0, full_end, seqlen_k, head_dim,
                                    causal_offset, qk_scale, BLOCK_N, CAUSAL, False, EVEN_D,
                                    INPUT_PRECISION)
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
                                    offs_m, offs_n, offs_d, full_end, end, seqlen_k, head_dim,
                                    causal_offset, qk_scale, BLOCK_N, CAUSAL, True, EVEN_D,
                                    INPUT_PRECISION)

    # Rows that saw no key at all (l_i == 0) get out = 0 and lse = +inf, so that the backward's
    # exp(s - lse) is 0 for them.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(Lse + off_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = tile_ptrs(Out, off_b, stride_ob, off_h, stride_oh, start_m, stride_om, rows, offs_d)
    store_tile(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim, not EVEN_D)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      causal: bool, causal_offset: int, config: Launch | None = None):
    """q (B, Nq, H, D), k and v (B, Nk, Hk, D), any strides with a contiguous last dim.
    Returns out (B, Nq, H, D) and softmax_lse (B, H, Nq) in fp32."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = config or forward_config(q, block_d, causal)
    grid = (triton.cdiv(seqlen_q, cfg.block_m), batch * nheads)
    _attn_fwd[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        nheads, seqlen_q, seqlen_k, head_dim, nheads // nheads_k, causal_offset, softmax_scale * LOG2E.value,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        CAUSAL=causal, EVEN_D=head_dim == block_d, INPUT_PRECISION=cfg.input_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
