"""Naive attention that materializes the scores: the tests' oracle. O(N^2) memory."""
from __future__ import annotations

import math

import torch

# ||out - ref|| / ||ref|| against this float64 oracle that each dtype must stay under (DESIGN.md).
ERROR_BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def attention_probs(q, k, softmax_scale=None, causal=False, causal_offset=None, dtype=torch.float64):
    """Softmax probabilities (B, H, Nq, Nk) for q (B, Nq, H, D), k (B, Nk, Hk, D), computed in
    `dtype`. Rows with no visible key are all zero. causal_offset defaults to Nk - Nq
    (flash-attn's bottom-right alignment): row i sees keys j <= i + causal_offset."""
    seqlen_q, nheads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    k = k.to(dtype).repeat_interleave(nheads // nheads_k, dim=2)
    s = torch.einsum("bmhd,bnhd->bhmn", q.to(dtype), k) * scale
    if causal:
        offset = seqlen_k - seqlen_q if causal_offset is None else causal_offset
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        s = s.masked_fill(cols > rows + offset, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    probs = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
    return probs, lse.squeeze(-1).masked_fill(lse.squeeze(-1) == float("-inf"), float("inf"))


def attention_reference(q, k, v, softmax_scale=None, causal=False, causal_offset=None, dtype=torch.float64):
    """out (B, Nq, H, D) and softmax_lse (B, H, Nq), both in `dtype` (+inf lse for empty rows)."""
    probs, lse = attention_probs(q, k, softmax_scale, causal, causal_offset, dtype)
    v = v.to(dtype).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhmn,bnhd->bmhd", probs, v), lse
