"""FlashAttention-1 in PyTorch, in the paper's loop order (Dao et al. 2022, Algorithms 1 and 4):
the outer loop walks the K/V tiles, the inner loop the query tiles. The output O, the row max m and
the row sum l live in memory (here: tensors) and are read, rescaled and written back for every K/V
tile; FlashAttention-2 swaps the loops so that they stay in registers instead."""
from __future__ import annotations

import torch

from ..dtypes import lse_dtype

BLOCK_M = 128
BLOCK_N = 128


def _tiles(n: int, block: int):
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def _mask(s, m0, n0, seqlen_q, seqlen_k):
    rows = torch.arange(m0, m0 + s.shape[-2], device=s.device)[:, None]
    cols = torch.arange(n0, n0 + s.shape[-1], device=s.device)[None, :]
    return s.masked_fill(cols > rows + seqlen_k - seqlen_q, float("-inf"))


def attention_forward(q, k, v, scale: float, causal: bool):
    dtype = lse_dtype(q.dtype)
    qh, kh, vh = (x.transpose(1, 2).to(dtype) for x in (q, k, v))  # (B, H, N, D)
    seqlen_q, seqlen_k = qh.shape[2], kh.shape[2]
    out = torch.zeros_like(qh)
    m = torch.full(qh.shape[:3], float("-inf"), dtype=dtype, device=q.device)
    l = torch.zeros_like(m)  # noqa: E741 (the paper's name)
    for n0, n1 in _tiles(seqlen_k, BLOCK_N):
        k_j, v_j = kh[:, :, n0:n1], vh[:, :, n0:n1]
        for m0, m1 in _tiles(seqlen_q, BLOCK_M):
            if causal and n0 > m1 - 1 + seqlen_k - seqlen_q:
                continue  # the tile is above the diagonal
            s = qh[:, :, m0:m1] @ k_j.transpose(-1, -2) * scale
            if causal:
                s = _mask(s, m0, n0, seqlen_q, seqlen_k)
            m_old, l_old = m[:, :, m0:m1], l[:, :, m0:m1]
            m_new = torch.maximum(m_old, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m_old - m_safe)
            l_new = alpha * l_old + p.sum(-1)
            l_safe = torch.where(l_new == 0, 1.0, l_new)
            # O is kept normalized in memory: undo the old normalization, add P V, renormalize.
            out[:, :, m0:m1] = ((alpha * l_old)[..., None] * out[:, :, m0:m1] + p @ v_j) / l_safe[..., None]
            m[:, :, m0:m1], l[:, :, m0:m1] = m_new, l_new
    lse = torch.where(l == 0, float("inf"), m + torch.log(torch.where(l == 0, 1.0, l)))
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.to(lse_dtype(q.dtype))


def attention_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    dtype = lse_dtype(q.dtype)
    qh, kh, vh, oh, doh = (x.transpose(1, 2).to(dtype) for x in (q, k, v, out, dout))
    seqlen_q, seqlen_k = qh.shape[2], kh.shape[2]
    lse = lse.to(dtype)
    delta = (doh * oh).sum(-1)
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh)
    dv = torch.zeros_like(vh)
    for n0, n1 in _tiles(seqlen_k, BLOCK_N):
        k_j, v_j = kh[:, :, n0:n1], vh[:, :, n0:n1]
        for m0, m1 in _tiles(seqlen_q, BLOCK_M):
            if causal and n0 > m1 - 1 + seqlen_k - seqlen_q:
                continue
            q_i, do_i = qh[:, :, m0:m1], doh[:, :, m0:m1]
            s = q_i @ k_j.transpose(-1, -2) * scale
            if causal:
                s = _mask(s, m0, n0, seqlen_q, seqlen_k)
            p = torch.exp(s - lse[:, :, m0:m1, None])
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ do_i
            ds = p * (do_i @ v_j.transpose(-1, -2) - delta[:, :, m0:m1, None])
            dq[:, :, m0:m1] += ds @ k_j * scale  # read-modify-write of dQ in memory, as in FA1
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ q_i * scale
    return tuple(g.transpose(1, 2).to(x.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))
