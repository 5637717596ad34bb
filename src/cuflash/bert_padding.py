"""Padding helpers, flash-attn compatible (`flash_attn.bert_padding`): turn a padded batch into the
packed tokens that the varlen functions take, and back.

    from cuflash.bert_padding import pad_input, unpad_input
    x_unpad, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(x, attention_mask)
    out = pad_input(flash_attn_varlen_func(...), indices, batch, seqlen)

Both are differentiable (a gather and a scatter of rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import ErrorCode, fail


def _check_mask(name: str, mask, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(like.shape[:2]):
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} must be a (batch, seqlen) = {tuple(like.shape[:2])} tensor, got "
             f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if mask.device != like.device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {mask.device} but hidden_states is on {like.device}")
    return mask


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of a padded batch, packed.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or int: 1 for a token to keep, 0 for padding.
        unused_mask: (batch, seqlen) or None: tokens kept in the packed output (counted in
            cu_seqlens and max_seqlen) but not in used_seqlens (allocated, not yet used).
    Returns:
        (hidden_states (total, ...) of the kept tokens in batch-major order, indices (total,) int64
        of those tokens in the flattened (batch * seqlen) batch, cu_seqlens (batch + 1,) int32,
        max_seqlen (int), used_seqlens (batch,) int32: the attention_mask tokens per sequence).
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        fail(ErrorCode.INVALID_DIMENSION, "hidden_states must be a tensor (batch, seqlen, ...)")
    keep = _check_mask("attention_mask", attention_mask, hidden_states).bool()
    used_seqlens = keep.sum(dim=-1, dtype=torch.int32)
    if unused_mask is not None:
        keep = keep | _check_mask("unused_mask", unused_mask, hidden_states).bool()
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return tokens, indices, cu_seqlens, int(seqlens.max()), used_seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: hidden_states (total, ...) put back at `indices` of a zero
    (batch, seqlen, ...) tensor."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        fail(ErrorCode.INVALID_DIMENSION, "hidden_states must be a tensor (total, ...)")
    if not isinstance(indices, torch.Tensor) or indices.shape != hidden_states.shape[:1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"indices must be a ({hidden_states.shape[0]},) tensor, one index per "
             f"row of hidden_states")
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
