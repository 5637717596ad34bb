"""Naive attention in PyTorch: S = scale * Q K^T and P = softmax(S) are materialized
(batch, nheads, seqlen_q, seqlen_k) in fp32, forward and backward. O(N^2) memory."""
from __future__ import annotations

import torch

from ..dtypes import lse_dtype


def _bhnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.transpose(1, 2).to(dtype)  # (B, N, H, D) -> (B, H, N, D)


def _probs(q, k, scale: float, causal: bool, dtype):
    """P and softmax_lse; rows that see no key have P = 0 and lse = +inf."""
    s = _bhnd(q, dtype) @ _bhnd(k, dtype).transpose(-1, -2) * scale
    seqlen_q, seqlen_k = s.shape[-2:]
    if causal:
        rows = torch.arange(seqlen_q, device=s.device)[:, None]
        cols = torch.arange(seqlen_k, device=s.device)[None, :]
        s.masked_fill_(cols > rows + seqlen_k - seqlen_q, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    return torch.exp(s - lse[..., None]), lse


def attention_forward(q, k, v, scale: float, causal: bool):
    p, lse = _probs(q, k, scale, causal, lse_dtype(q.dtype))
    out = p @ _bhnd(v, p.dtype)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.to(lse_dtype(q.dtype))


def attention_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    dtype = lse_dtype(q.dtype)
    p, _ = _probs(q, k, scale, causal, dtype)
    do = _bhnd(dout, dtype)
    dv = p.transpose(-1, -2) @ do
    dp = do @ _bhnd(v, dtype).transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = ds @ _bhnd(k, dtype) * scale
    dk = ds.transpose(-1, -2) @ _bhnd(q, dtype) * scale
    return tuple(g.transpose(1, 2).to(x.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))
