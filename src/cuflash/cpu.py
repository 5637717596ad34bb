"""Blocked attention in plain PyTorch: the same algorithm as the Triton kernels (online softmax
over K/V tiles, recomputation from the log-sum-exp in the backward), for tensors on any device.

Working memory is O(seqlen): one (block_m x block_n) score tile per head at a time, plus the
fp32 output and gradient accumulators. The query heads that share a KV head are folded into the
rows of one matrix, so K/V are never repeated and the GQA sums of dK/dV come out of the matmuls.
"""
from __future__ import annotations

import torch

from .errors import lse_dtype

BLOCK_M = 256
BLOCK_N = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, nheads_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, N, H, D) -> (B, Hk, G, N, D) in the compute dtype."""
    b, n, h, d = x.shape
    return x.to(dtype).view(b, n, nheads_k, h // nheads_k, d).permute(0, 2, 3, 1, 4)


def _rows(x: torch.Tensor, m0: int, m1: int) -> torch.Tensor:
    """Rows m0:m1 of a (B, Hk, G, N, ...) tensor, with G folded into the rows: (B, Hk, G*bm, ...)."""
    blk = x[:, :, :, m0:m1]
    return blk.reshape(blk.shape[0], blk.shape[1], -1, *blk.shape[4:])


def _key_range(m0: int, m1: int, seqlen_k: int, causal: bool, causal_offset: int):
    """Keys [0, full_end) are visible to all rows m0:m1, [full_end, end) to some of them."""
    if not causal:
        return seqlen_k, seqlen_k
    end = max(0, min(seqlen_k, m1 + causal_offset))
    full_end = max(0, min(seqlen_k, m0 + causal_offset + 1))
    return full_end, end


def _mask(s: torch.Tensor, m0: int, m1: int, n0: int, n1: int, group: int, causal_offset: int) -> torch.Tensor:
    rows = torch.arange(m0, m1, device=s.device).repeat(group)
    cols = torch.arange(n0, n1, device=s.device)
    return s.masked_fill_(cols[None, :] > rows[:, None] + causal_offset, float("-inf"))


def _blocks(full_end: int, end: int):
    """Key tiles: unmasked ones up to full_end, then masked ones up to end."""
    n0 = 0
    while n0 < end:
        n1 = min(n0 + BLOCK_N, full_end) if n0 < full_end else min(n0 + BLOCK_N, end)
        yield n0, n1, n0 >= full_end
        n0 = n1


def attention_forward(q, k, v, softmax_scale: float, causal: bool, causal_offset: int):
    """Same contract as kernels.attention_forward: out (B, Nq, H, D), softmax_lse (B, H, Nq)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    dtype = _compute_dtype(q.dtype)
    qg = _grouped(q, nheads_k, dtype)
    kg = k.to(dtype).transpose(1, 2).contiguous()  # (B, Hk, Nk, D): matmuls on strided K run slower
    vg = v.to(dtype).transpose(1, 2).contiguous()
    out = torch.empty(batch, nheads_k, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=lse_dtype(q.dtype), device=q.device)
    for m0 in range(0, seqlen_q, BLOCK_M):
        m1 = min(m0 + BLOCK_M, seqlen_q)
        q_blk = _rows(qg, m0, m1) * softmax_scale
        rows = q_blk.shape[2]
        m_i = torch.full((batch, nheads_k, rows), float("-inf"), dtype=dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(batch, nheads_k, rows, head_dim, dtype=dtype, device=q.device)
        for n0, n1, masked in _blocks(*_key_range(m0, m1, seqlen_k, causal, causal_offset)):
            s = q_blk @ kg[:, :, n0:n1].transpose(-1, -2)
            if masked:
                _mask(s, m0, m1, n0, n1, group, causal_offset)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(-1)
            acc.mul_(alpha[..., None]).add_(p @ vg[:, :, n0:n1])
            m_i = m_new
        empty = l_i == 0  # rows that saw no key: out 0, lse +inf
        l_safe = torch.where(empty, 1.0, l_i)
        shape = (batch, nheads_k, group, m1 - m0)
        out[:, :, :, m0:m1] = (acc / l_safe[..., None]).view(*shape, head_dim)
        lse[:, :, :, m0:m1] = torch.where(empty, float("inf"), m_i + torch.log(l_safe)).view(shape)
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, head_dim)
    return out.to(q.dtype).contiguous(), lse.view(batch, nheads, seqlen_q)


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, causal_offset: int):
    """Same contract as kernels.attention_backward: dq, dk, dv shaped like q, k, v."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    dtype = _compute_dtype(q.dtype)
    qg = _grouped(q, nheads_k, dtype)
    dog = _grouped(dout, nheads_k, dtype)
    delta = (dog * _grouped(out, nheads_k, dtype)).sum(-1)  # (B, Hk, G, Nq)
    lseg = lse.reshape(batch, nheads_k, group, seqlen_q).to(dtype)
    kg = k.to(dtype).transpose(1, 2).contiguous()  # (B, Hk, Nk, D): matmuls on strided K run slower
    vg = v.to(dtype).transpose(1, 2).contiguous()
    dq = torch.empty(batch, nheads_k, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    dk = torch.zeros(batch, nheads_k, seqlen_k, head_dim, dtype=dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for m0 in range(0, seqlen_q, BLOCK_M):
        m1 = min(m0 + BLOCK_M, seqlen_q)
        q_blk, do_blk = _rows(qg, m0, m1), _rows(dog, m0, m1)
        lse_blk, delta_blk = _rows(lseg, m0, m1), _rows(delta, m0, m1)
        dq_blk = torch.zeros_like(q_blk)
        for n0, n1, masked in _blocks(*_key_range(m0, m1, seqlen_k, causal, causal_offset)):
            k_blk, v_blk = kg[:, :, n0:n1], vg[:, :, n0:n1]
            s = (q_blk @ k_blk.transpose(-1, -2)).mul_(softmax_scale)
            if masked:
                _mask(s, m0, m1, n0, n1, group, causal_offset)
            p = s.sub_(lse_blk[..., None]).exp_()  # lse = +inf gives p = 0
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ do_blk
            ds = p.mul_((do_blk @ v_blk.transpose(-1, -2)).sub_(delta_blk[..., None]))
            dq_blk += ds @ k_blk
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ q_blk
        dq[:, :, :, m0:m1] = dq_blk.view(batch, nheads_k, group, m1 - m0, head_dim)
    dq = (dq * softmax_scale).permute(0, 3, 1, 2, 4).reshape(q.shape)
    dk = (dk * softmax_scale).transpose(1, 2)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.transpose(1, 2).to(v.dtype).contiguous())
