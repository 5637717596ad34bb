"""FlashAttention-1 as Triton kernels, in the paper's loop order (Dao et al. 2022, Algorithms 1
and 4): one program per (batch, head) walks the K/V tiles in its outer loop and the query tiles
in its inner loop. The output, the row max and the row sum (forward) and dQ (backward) live in
fp32 buffers in memory, read and written back once per K/V tile: the traffic FlashAttention-2
removes by swapping the loops. Parallel over batch x heads only, as FA1 was.
"""
import torch
import triton
import triton.language as tl

from ..kernels.constants import LN2, LOG2E
from ..kernels.device import arch, on_inputs_device, padded_head_dim
from ..kernels.launch import run_kernel
from ..kernels.triton.common import tile_ptrs


@triton.jit
def _kv_tile(base, strides, off_b, off_h, start_n, cols, offs_d, seqlen_k, head_dim):
    """Keys (or values) start_n + cols of one (batch, head), zero past seqlen_k and head_dim."""
    ok = ((start_n + cols)[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
    return tl.load(tile_ptrs(base, strides, off_b, off_h, start_n, cols, offs_d), mask=ok, other=0.0)


@triton.jit
def _fa1_fwd(Q, K, V, Out, M, L, stride_q, stride_k, stride_v, nheads, seqlen_q, seqlen_k, head_dim, qk_scale,
             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    off_bh = tl.program_id(0)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    offset = seqlen_k - seqlen_q  # causal: row i sees keys j <= i + offset
    rows_in_tile = tl.arange(0, BLOCK_M)
    cols_in_tile = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    # Out, M, L: fp32, contiguous (B*H, seqlen_q, BLOCK_D) and (B*H, seqlen_q)
    o_base = Out + off_bh.to(tl.int64) * seqlen_q * BLOCK_D
    ml_base = off_bh.to(tl.int64) * seqlen_q
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + cols_in_tile
        k = _kv_tile(K, stride_k, off_b, off_h, start_n, cols_in_tile, offs_d, seqlen_k, head_dim)
        v = _kv_tile(V, stride_v, off_b, off_h, start_n, cols_in_tile, offs_d, seqlen_k, head_dim)
        first_m = 0
        if CAUSAL:  # query tiles entirely above the diagonal see nothing of this K/V tile
            first_m = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        for start_m in range(first_m, seqlen_q, BLOCK_M):
            rows = start_m + rows_in_tile
            row_ok = rows < seqlen_q
            q = tl.load(tile_ptrs(Q, stride_q, off_b, off_h, start_m, rows_in_tile, offs_d),
                        mask=row_ok[:, None] & d_ok, other=0.0)
            o_ptrs = o_base + rows[:, None] * BLOCK_D + offs_d[None, :]
            o = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            m = tl.load(M + ml_base + rows, mask=row_ok, other=float("-inf"))
            l = tl.load(L + ml_base + rows, mask=row_ok, other=0.0)  # noqa: E741 (the paper's name)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            ok = cols[None, :] < seqlen_k
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + offset)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m - m_safe)
            l_new = alpha * l + tl.sum(p, 1)
            l_safe = tl.where(l_new == 0.0, 1.0, l_new)
            # O is kept normalized in memory: undo the old normalization, add P V, renormalize.
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            o = ((alpha * l)[:, None] * o + pv) / l_safe[:, None]
            tl.store(o_ptrs, o, mask=row_ok[:, None])
            tl.store(M + ml_base + rows, m_new, mask=row_ok)
            tl.store(L + ml_base + rows, l_new, mask=row_ok)
            tl.debug_barrier()  # the next K/V tile's reads of these rows must see the writes


@triton.jit
def _fa1_bwd(Q, K, V, DO, Lse, Delta, DQ, DK, DV, stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv,
             nheads, seqlen_q, seqlen_k, head_dim, qk_scale, softmax_scale,
             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    off_bh = tl.program_id(0)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    offset = seqlen_k - seqlen_q
    rows_in_tile = tl.arange(0, BLOCK_M)
    cols_in_tile = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    dq_base = DQ + off_bh.to(tl.int64) * seqlen_q * BLOCK_D  # fp32 (B*H, seqlen_q, BLOCK_D)
    row_base = off_bh.to(tl.int64) * seqlen_q
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + cols_in_tile
        kv_ok = (cols[:, None] < seqlen_k) & d_ok  # (the dK, dV tile's stores)
        k = _kv_tile(K, stride_k, off_b, off_h, start_n, cols_in_tile, offs_d, seqlen_k, head_dim)
        v = _kv_tile(V, stride_v, off_b, off_h, start_n, cols_in_tile, offs_d, seqlen_k, head_dim)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        first_m = 0
        if CAUSAL:
            first_m = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        for start_m in range(first_m, seqlen_q, BLOCK_M):
            rows = start_m + rows_in_tile
            row_ok = rows < seqlen_q
            tile_ok = row_ok[:, None] & d_ok
            q = tl.load(tile_ptrs(Q, stride_q, off_b, off_h, start_m, rows_in_tile, offs_d), mask=tile_ok, other=0.0)
            do = tl.load(tile_ptrs(DO, stride_do, off_b, off_h, start_m, rows_in_tile, offs_d), mask=tile_ok, other=0.0)
            lse = tl.load(Lse + row_base + rows, mask=row_ok, other=float("inf")) * LOG2E
            delta = tl.load(Delta + row_base + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            ok = cols[None, :] < seqlen_k
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + offset)
            p = tl.where(ok, tl.math.exp2(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            # dQ_i is read, updated and written back for every K/V tile (FA1's extra traffic).
            dq_ptrs = dq_base + rows[:, None] * BLOCK_D + offs_d[None, :]
            dq = tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee") * softmax_scale
            tl.store(dq_ptrs, dq, mask=row_ok[:, None])
            tl.debug_barrier()
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
        tl.store(tile_ptrs(DK, stride_dk, off_b, off_h, start_n, cols_in_tile, offs_d),
                 (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(tile_ptrs(DV, stride_dv, off_b, off_h, start_n, cols_in_tile, offs_d), dv.to(DV.dtype.element_ty),
                 mask=kv_ok)


def _tiles(head_dim: int, device) -> tuple[int, int, int]:
    block_d = padded_head_dim(head_dim)
    if arch(device) == 0:
        return 16, 32, block_d
    return (64, 64, block_d) if block_d <= 128 else (32, 32, block_d)


@on_inputs_device
def attention_forward(q, k, v, scale: float, causal: bool):
    batch, seqlen_q, nheads, head_dim = q.shape
    block_m, block_n, block_d = _tiles(head_dim, q.device)
    o = torch.zeros(batch * nheads, seqlen_q, block_d, dtype=torch.float32, device=q.device)
    m = torch.full((batch * nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)  # noqa: E741
    run_kernel(_fa1_fwd, (batch * nheads,), q, k, v, o, m, l, *(x.stride()[:3] for x in (q, k, v)), nheads,
               seqlen_q, k.shape[1], head_dim, scale * LOG2E.value, CAUSAL=causal,
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    lse = torch.where(l == 0, float("inf"), (m + torch.log2(torch.where(l == 0, 1.0, l))) * LN2.value)
    out = o[..., :head_dim].view(batch, nheads, seqlen_q, head_dim).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.view(batch, nheads, seqlen_q)


@on_inputs_device
def attention_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    batch, seqlen_q, nheads, head_dim = q.shape
    block_m, block_n, block_d = _tiles(head_dim, q.device)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (B, H, Nq)
    dq = torch.zeros(batch * nheads, seqlen_q, block_d, dtype=torch.float32, device=q.device)
    dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))
    run_kernel(_fa1_bwd, (batch * nheads,), q, k, v, dout, lse.contiguous(), delta, dq, dk, dv,
               *(x.stride()[:3] for x in (q, k, v, dout, dk, dv)), nheads,
               seqlen_q, k.shape[1], head_dim, scale * LOG2E.value, scale, CAUSAL=causal,
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    dq = dq[..., :head_dim].view(batch, nheads, seqlen_q, head_dim).transpose(1, 2).to(q.dtype).contiguous()
    return dq, dk, dv
