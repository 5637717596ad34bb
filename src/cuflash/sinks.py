"""Learnable attention sinks (AttentionParams.learnable_sink; gpt-oss, FlashAttention-4's learnable_sink):
one more logit per query head in every row's softmax, with no value.

The forward counts it where each row's online softmax starts: as if one key of logit sink and value 0
had been seen (running max = sink, running sum = 1, output 0), so the lse includes it. The backward
kernels need nothing: given that lse, P = exp(S - lse) and dS = P (dP - delta) are the same formulas.
The sink's own gradient is a reduction over the rows (sink_grad), from the backward's delta."""
from __future__ import annotations

import torch


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sink, in sink's dtype: with the sink's probability P_i = exp(sink - lse_i) of each row
    and delta_i = rowsum(dO_i * O_i) - dlse_i (lse and delta shaped like softmax_lse: (B, H, N), or
    varlen (H, total)), d sink_h = -sum over the rows of head h of P_i * delta_i (d out_i / d sink =
    -P_i out_i, d lse_i / d sink = P_i). Rows with lse +inf (past seqused_q, or no key and a sink of
    -inf) add 0 whatever their delta: their dO and dlse are not read (NaN there stays out)."""
    delta = delta.masked_fill(torch.isposinf(lse), 0.0)
    grads = torch.exp(sink.to(lse.dtype).view(-1, 1) - lse) * delta  # ((H, 1) broadcasts against both layouts)
    if grads.dim() == 3:  # (B, H, N)
        grads = grads.sum(0)
    return (-grads.sum(-1)).to(sink.dtype)


def empty_lse(sink: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """softmax_lse of shape `shape` (softmax_lse's) for rows that see no key: the sink's logit, in `dtype`
    (differentiable); +inf where the sink is -inf, which is no sink (a row with no key and no sink, as
    the kernels give)."""
    lse = sink.to(dtype).view(-1, 1).expand(shape)
    return lse.masked_fill(torch.isneginf(lse), float("inf"))
