"""Naive attention as Triton kernels: every (seqlen_q x seqlen_k) matrix goes through memory.

Forward: S = scale * Q K^T (batched matmul), P = softmax(S) row by row (in place), O = P V.
Backward: S and P again, dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)) (in place),
dQ = scale * dS K, dK = scale * dS^T Q. One matmul kernel serves all five products: a transpose
is only a choice of strides. The (B, H, Nq, Nk) fp32 buffers make it O(N^2) in memory and traffic.
"""
import torch
import triton
import triton.language as tl

from ..kernels.constants import LOG2E
from ..kernels.device import arch, cdiv, next_power_of_2, on_inputs_device
from ..kernels.launch import run_kernel


@triton.jit
def _bmm(A, B, C, nheads, M, N, K, alpha,
         stride_ab, stride_ah, stride_am, stride_ak,
         stride_bb, stride_bh, stride_bk, stride_bn,
         stride_cb, stride_ch, stride_cm, stride_cn,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[b, h] = alpha * A[b, h] @ B[b, h], accumulated in fp32; A is cast to B's dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    off_b = (tl.program_id(2) // nheads).to(tl.int64)
    off_h = (tl.program_id(2) % nheads).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + off_b * stride_ab + off_h * stride_ah + offs_m[:, None].to(tl.int64) * stride_am
    b_ptrs = B + off_b * stride_bb + off_h * stride_bh + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptrs + ks[None, :] * stride_ak, mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptrs + ks[:, None] * stride_bk, mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision="ieee")
    c_ptrs = (C + off_b * stride_cb + off_h * stride_ch + offs_m[:, None].to(tl.int64) * stride_cm
              + offs_n[None, :] * stride_cn)
    tl.store(c_ptrs, (acc * alpha).to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _softmax_rows(S, Lse, seqlen_q, seqlen_k, causal_offset, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the (rows, seqlen_k) logits S (base e) becomes its softmax, in place; lse[r] is its
    log-sum-exp (+inf, with a zero row, where no key is visible)."""
    row = tl.program_id(0).to(tl.int64)
    i = row % seqlen_q
    s_ptr = S + row * seqlen_k
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, seqlen_k, BLOCK):  # one pass: running max and rescaled sum per lane
        cols = start + tl.arange(0, BLOCK)
        ok = cols < seqlen_k
        if CAUSAL:
            ok = ok & (cols <= i + causal_offset)
        s = tl.where(ok, tl.load(s_ptr + cols, mask=cols < seqlen_k, other=0.0), float("-inf")) * LOG2E
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.math.exp2(m - m_safe) + tl.math.exp2(s - m_safe)
        m = m_new
    m_row = tl.max(m, 0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    l_row = tl.sum(total * tl.math.exp2(m - m_row_safe), 0)
    lse2 = tl.where(l_row == 0.0, float("inf"), m_row + tl.math.log2(tl.where(l_row == 0.0, 1.0, l_row)))
    tl.store(Lse + row, lse2 / LOG2E)
    for start in range(0, seqlen_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < seqlen_k
        if CAUSAL:
            ok = ok & (cols <= i + causal_offset)
        s = tl.load(s_ptr + cols, mask=cols < seqlen_k, other=0.0) * LOG2E
        tl.store(s_ptr + cols, tl.where(ok, tl.math.exp2(s - lse2), 0.0), mask=cols < seqlen_k)


@triton.jit
def _softmax_grad_rows(P, DP, seqlen_k, BLOCK: tl.constexpr):
    """dS = P * (dP - rowsum(P * dP)), in place of dP."""
    row = tl.program_id(0).to(tl.int64)
    p_ptr = P + row * seqlen_k
    dp_ptr = DP + row * seqlen_k
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, seqlen_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(p_ptr + cols, mask=cols < seqlen_k, other=0.0) * tl.load(dp_ptr + cols, mask=cols < seqlen_k,
                                                                                 other=0.0)
    delta = tl.sum(acc, 0)
    for start in range(0, seqlen_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = tl.load(p_ptr + cols, mask=cols < seqlen_k, other=0.0)
        dp = tl.load(dp_ptr + cols, mask=cols < seqlen_k, other=0.0)
        tl.store(dp_ptr + cols, p * (dp - delta), mask=cols < seqlen_k)


def _matmul(a, a_t: bool, b, b_t: bool, c, alpha: float = 1.0):
    """c = alpha * op(a) @ op(b) for (B, H, rows, cols) views (op = transpose of the last two dims
    where asked), any strides."""
    tiles = (16, 16, 16) if arch(c.device) == 0 else (64, 64, 32)
    batch, nheads, m, n = c.shape
    a = a.transpose(-1, -2) if a_t else a
    b = b.transpose(-1, -2) if b_t else b
    grid = (cdiv(m, tiles[0]), cdiv(n, tiles[1]), batch * nheads)
    run_kernel(_bmm, grid, a, b, c, nheads, m, n, a.shape[-1], alpha, *a.stride(), *b.stride(), *c.stride(),
               BLOCK_M=tiles[0], BLOCK_N=tiles[1], BLOCK_K=tiles[2])
    return c


def _bhnd(x):
    return x.transpose(1, 2)  # (B, N, H, D) view -> (B, H, N, D) view


def _probs(q, k, scale: float, causal: bool):
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    p = torch.empty(batch, nheads, seqlen_q, seqlen_k, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    _matmul(_bhnd(q), False, _bhnd(k), True, p, scale)
    run_kernel(_softmax_rows, (batch * nheads * seqlen_q,), p, lse, seqlen_q, seqlen_k, seqlen_k - seqlen_q,
               CAUSAL=causal, BLOCK=min(1024, next_power_of_2(seqlen_k)))
    return p, lse


@on_inputs_device
def attention_forward(q, k, v, scale: float, causal: bool):
    p, lse = _probs(q, k, scale, causal)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _matmul(p, False, _bhnd(v), False, _bhnd(out))
    return out, lse


@on_inputs_device
def attention_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    p, _ = _probs(q, k, scale, causal)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    _matmul(p, True, _bhnd(dout), False, _bhnd(dv))
    ds = torch.empty_like(p)
    _matmul(_bhnd(dout), False, _bhnd(v), True, ds)
    run_kernel(_softmax_grad_rows, (ds.shape[0] * ds.shape[1] * ds.shape[2],), p, ds, ds.shape[3],
               BLOCK=min(1024, next_power_of_2(ds.shape[3])))
    _matmul(ds, False, _bhnd(k), False, _bhnd(dq), scale)
    _matmul(ds, True, _bhnd(q), False, _bhnd(dk), scale)
    return dq, dk, dv
