"""Naive attention that materializes the scores: the tests' oracle. O(N^2) memory."""
from __future__ import annotations

import math

import torch

# ||out - ref|| / ||ref|| against this float64 oracle that each dtype must stay under (docs/DESIGN.md).
ERROR_BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def attention_probs(q, k, softmax_scale=None, causal=False, causal_offset=None, dtype=torch.float64, *,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_mask=None, score_mod=None,
                    mask_mod=None, learnable_sink=None):
    """Softmax probabilities (B, H, Nq, Nk) and softmax_lse (B, H, Nq) for q (B, Nq, H, D),
    k (B, Nk, Hk, D), computed in `dtype`. Rows with no visible key are all zero, lse +inf.

    causal_offset defaults to Nk - Nq (flash-attn's bottom-right alignment): row i sees keys
    i + causal_offset - window_size[0] <= j <= i + causal_offset + window_size[1] (-1: unbounded;
    causal sets the right bound to 0). softcap > 0 caps the scaled logits x to
    softcap * tanh(x / softcap); alibi_slopes ((H,) or (B, H)) then add -slope * |i + offset - j|;
    attn_mask (broadcastable to (B, H, Nq, Nk)) hides keys (bool, True = attend) or is added.
    score_mod(scores, b, h, q_idx, kv_idx) replaces the capped logits before ALiBi, and mask_mod(b, h,
    q_idx, kv_idx) hides the keys it is False for, both computed on broadcast int32 index tensors (b
    (B, 1, 1, 1), h (1, H, 1, 1) the query head, q_idx a column and kv_idx a row of positions from 0).
    learnable_sink (H,): one more logit per head in every row's softmax (a column of its own, no
    value): the probabilities of the keys sum to less than 1, lse counts it, a row with no visible key
    has lse = sink."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    offset = seqlen_k - seqlen_q if causal_offset is None else causal_offset
    k = k.to(dtype).repeat_interleave(nheads // nheads_k, dim=2)
    s = torch.einsum("bmhd,bnhd->bhmn", q.to(dtype), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(seqlen_q, device=q.device)[:, None]
    cols = torch.arange(seqlen_k, device=q.device)[None, :]
    index = (torch.arange(batch, dtype=torch.int32, device=q.device).view(-1, 1, 1, 1),
             torch.arange(nheads, dtype=torch.int32, device=q.device).view(1, -1, 1, 1), rows.int(), cols.int()) \
        if score_mod is not None or mask_mod is not None else ()
    if score_mod is not None:
        s = score_mod(s, *index)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).expand(batch, nheads)
        s = s - slopes[:, :, None, None] * (rows + offset - cols).abs().to(dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(dtype)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*index), float("-inf"))
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        s = s.masked_fill(cols > rows + offset + right, float("-inf"))
    if left >= 0:
        s = s.masked_fill(cols < rows + offset - left, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, -1, 1, 1).expand(batch, nheads, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat((s, sink), dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
    probs = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
    return probs, lse.squeeze(-1).masked_fill(lse.squeeze(-1) == float("-inf"), float("inf"))


def attention_reference(q, k, v, softmax_scale=None, causal=False, causal_offset=None, dtype=torch.float64, *,
                        dropout_p=0.0, dropout_keep=None, **options):
    """out (B, Nq, H, D) and softmax_lse (B, H, Nq), both in `dtype` (+inf lse for empty rows).
    options: those of attention_probs. With dropout, dropout_keep (B, H, Nq, Nk) bool says which
    probabilities survive; they are scaled by 1 / (1 - dropout_p)."""
    probs, lse = attention_probs(q, k, softmax_scale, causal, causal_offset, dtype, **options)
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    v = v.to(dtype).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhmn,bnhd->bmhd", probs, v), lse
