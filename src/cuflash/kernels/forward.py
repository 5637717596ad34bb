"""Forward pass: FlashAttention-2, Algorithm 1.

Each program owns one tile of BLOCK_M query rows of one (batch, head) and streams K/V tiles
through it, keeping the running row max m_i, the running sum l_i and the unnormalized output in
registers. Logits are kept in base 2 (LOG2E folded into the scale) so the softmax uses exp2.
Only the K/V tiles inside the band of a causal mask or sliding window are visited.
"""
import torch
import triton
import triton.language as tl

from ..params import AttentionParams
from .common import LN2, NO_MASK, band, dropout_keep, head_options, load_rows, load_tile, logits, mma, \
    query_tile, row_source, score_tile, sequence, softmax_step, store_tile, tile_ptrs
from .compat import gluon_kernels
from .config import Launch, cdiv, forward_config, tf32, use_tma, user_tiles_checked, with_user_tiles
from .launch import launch
from .variant import lse_strides, problem, variant_args, variant_tensors

hopper_forward = gluon_kernels("hopper_forward")  # None where Triton has not its Gluon dialect


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kpage,
                    stride_vpage, mask_ptrs, stride_mask_m, stride_mask_n, offs_m, offs_n, offs_d, lo, hi,
                    seqlen_q, seqlen_k, head_dim, offset, window_left, window_right, qk_scale, softcap, slope,
                    drop_key, drop_threshold,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, PAGED: tl.constexpr):
    if not TMA and not PAGED:
        k_src += tl.cast(lo, tl.int64) * stride_kn
        v_src += tl.cast(lo, tl.int64) * stride_vn
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        if PAGED:  # key j: row j % page_size of page pages[j // page_size], read in place
            page = tl.load(pages + cols // page_size, mask=cols < seqlen_k, other=0).to(tl.int64)
            row = (cols % page_size).to(tl.int64)
            k = load_tile(k_src + (page * stride_kpage + row * stride_kn)[:, None] + offs_d[None, :], cols, seqlen_k,
                          offs_d, head_dim, MASKED, not EVEN_D)
        else:
            k = load_rows(k_src, start_n, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D, TMA)
        x = logits(mma(q, tl.trans(k), None, INPUT_PRECISION), qk_scale, softcap, SOFTCAP)
        s = score_tile(x, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, offset, window_left,
                       window_right, slope, mask_ptrs, stride_mask_m, stride_mask_n,
                       MASKED, HAS_LEFT, HAS_RIGHT, ALIBI, MASK_KIND)
        m_new, p, alpha, l_i = softmax_step(s, m_i, l_i, MASKED or MASK_KIND != NO_MASK)
        if DROPOUT:
            # The softmax sum counts every probability; only the output sees the dropped ones.
            p = tl.where(dropout_keep(drop_key, offs_m[:, None], cols[None, :], drop_threshold), p, 0.0)
        if PAGED:
            v = load_tile(v_src + (page * stride_vpage + row * stride_vn)[:, None] + offs_d[None, :], cols, seqlen_k,
                          offs_d, head_dim, MASKED, not EVEN_D)
        else:
            v = load_rows(v_src, start_n, cols, seqlen_k, offs_d, head_dim, MASKED, not EVEN_D, TMA)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new
        if not TMA and not PAGED:
            k_src += BLOCK_N * stride_kn
            v_src += BLOCK_N * stride_vn
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Slopes, Mask, Rng, BlockTable,
              stride_qb, stride_qm, stride_qh,
              stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh,
              stride_ob, stride_om, stride_oh,
              stride_lb, stride_lh, stride_slope_b,
              stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
              stride_tb, page_size, stride_kpage, stride_vpage,
              nheads, seqlen_q, seqlen_k, head_dim, group_size, bottom_right, window_left, window_right,
              qk_scale, softcap, drop_threshold, drop_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
              EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
              PAGED: tl.constexpr):
    start_m = query_tile(HAS_RIGHT) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    off_hk = off_h // group_size
    q_first, seqlen_q = sequence(CuSeqlensQ, off_b, seqlen_q, VARLEN)
    k_first, seqlen_k = sequence(CuSeqlensK, off_b, seqlen_k, VARLEN)
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    offset = bottom_right * (seqlen_k - seqlen_q)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    rows = tl.arange(0, BLOCK_M)
    q_ptrs = tile_ptrs(Q, off_b, stride_qb, off_h, stride_qh, q_first + start_m, stride_qm, rows, offs_d)
    pages = 0  # (BlockTable is None unless PAGED: a value of one type either way)
    if PAGED:  # the pages of sequence off_b; the kernel reads K and V from them
        pages = BlockTable + off_b * stride_tb
        k_src = K + off_hk * stride_kh
        v_src = V + off_hk * stride_vh
    else:
        k_src = row_source(K, off_b, stride_kb, off_hk, stride_kh, k_first, stride_kn, seqlen_k, head_dim,
                           offs_n, offs_d, BLOCK_N, BLOCK_D, TMA)
        v_src = row_source(V, off_b, stride_vb, off_hk, stride_vh, k_first, stride_vn, seqlen_k, head_dim,
                           offs_n, offs_d, BLOCK_N, BLOCK_D, TMA)
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, True, not EVEN_D)
    mask_ptrs, slope, drop_key = head_options(Mask, stride_mask_b, stride_mask_h, Slopes, stride_slope_b, Rng,
                                              off_b, off_h, off_bh, ALIBI, MASK_KIND, DROPOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = band(start_m, BLOCK_M, seqlen_k, BLOCK_N, offset - window_left,
                                    offset + window_right, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:  # only a window's left edge cuts tiles before the visible ones
        acc, m_i, l_i = _attn_fwd_inner(
            acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kpage, stride_vpage,
            mask_ptrs, stride_mask_m, stride_mask_n,
            offs_m, offs_n, offs_d, lo, full_lo, seqlen_q, seqlen_k, head_dim, offset, window_left,
            window_right, qk_scale, softcap, slope, drop_key, drop_threshold,
            BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, MASK_KIND, DROPOUT, EVEN_D, INPUT_PRECISION,
            TMA, False, PAGED)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kpage, stride_vpage,
        mask_ptrs, stride_mask_m, stride_mask_n,
        offs_m, offs_n, offs_d, full_lo, full_hi, seqlen_q, seqlen_k, head_dim, offset, window_left,
        window_right, qk_scale, softcap, slope, drop_key, drop_threshold,
        BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, MASK_KIND, DROPOUT, EVEN_D, INPUT_PRECISION,
        TMA, WS, PAGED)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kpage, stride_vpage,
        mask_ptrs, stride_mask_m, stride_mask_n,
        offs_m, offs_n, offs_d, full_hi, hi, seqlen_q, seqlen_k, head_dim, offset, window_left,
        window_right, qk_scale, softcap, slope, drop_key, drop_threshold,
        BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, MASK_KIND, DROPOUT, EVEN_D, INPUT_PRECISION,
        TMA, False, PAGED)

    # Rows that saw no key at all (l_i == 0) get out = 0 and lse = +inf, so that the backward's
    # exp(s - lse) is 0 for them.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if DROPOUT:
        acc = acc * drop_scale
    out = acc / l_safe[:, None]
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + q_first + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = tile_ptrs(Out, off_b, stride_ob, off_h, stride_oh, q_first + start_m, stride_om, rows, offs_d)
    store_tile(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim, not EVEN_D)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams,
                      config: Launch | None = None):
    """q (B, Nq, H, D), k and v (B, Nk, Hk, D), any strides with a contiguous last dim (varlen:
    (total, H, D); paged varlen: k and v (num_blocks, page_block_size, Hk, D)). Returns out shaped
    like q and softmax_lse (B, H, Nq) (varlen: (H, total_q)) fp32."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (~2x faster than torch.empty)
    lse = torch.empty(params.lse_shape(q), dtype=torch.float32, device=q.device)
    tensors = dict(Q=q, K=k, V=v, Out=out, Lse=lse, **variant_tensors(params))
    if params.block_table is not None:
        tensors["BlockTable"] = params.block_table
    with user_tiles_checked(params.block_m, params.block_n, q.shape[-1], q.dtype):
        launch((attention_forward, params.key(), config, tf32(q)), tensors, lambda: [_launch(tensors, params, config)])
    return out, lse


def _launch(tensors: dict, params: AttentionParams, config: Launch | None):
    q, k, v, out = tensors["Q"], tensors["K"], tensors["V"], tensors["Out"]
    prob = problem(q, k, v, params)
    cfg = config or with_user_tiles(forward_config(q, prob.block_d, max(prob.seqlen_q, prob.seqlen_k),
                                                   params.banded), params.block_m, params.block_n)
    if cfg.gluon and hopper_forward is not None and hopper_forward.accepts(prob, params):
        return hopper_forward.launch_args(tensors, prob, params, cfg)
    paged = params.block_table is not None
    tma = not paged and use_tma(cfg, (prob.seqlen_q, prob.seqlen_k), k, v)
    grid = (cdiv(prob.seqlen_q, cfg.block_m), prob.batch * prob.nheads)
    return _attn_fwd, grid, dict(
        **tensors, **prob.strides("q", q), **_kv_strides(prob, "k", k, paged), **_kv_strides(prob, "v", v, paged),
        **prob.strides("o", out), **lse_strides(prob, params), **variant_args(params),
        **({} if paged else {"BlockTable": None}), stride_tb=params.block_table.stride(0) if paged else 0,
        page_size=k.shape[1] if paged else 0, PAGED=paged,
        nheads=prob.nheads, seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, head_dim=prob.head_dim,
        group_size=prob.nheads // prob.nheads_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=prob.block_d, EVEN_D=prob.head_dim == prob.block_d,
        INPUT_PRECISION=cfg.input_precision, TMA=tma, WS=tma and cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _kv_strides(prob, name: str, t: torch.Tensor, paged: bool) -> dict:
    """The strides of k or v: a paged cache's (num_blocks, page, Hk, D) as rows within a page and
    the page's own stride (stride_{name}page), otherwise as the problem lays them out."""
    if paged:
        return {f"stride_{name}b": 0, f"stride_{name}n": t.stride(1), f"stride_{name}h": t.stride(2),
                f"stride_{name}page": t.stride(0)}
    return {**prob.strides(name, t, "n"), f"stride_{name}page": 0}
