"""Padding helpers, flash-attn compatible (`flash_attn.bert_padding`): turn a padded batch into the
packed tokens that the varlen functions take, and back.

    from cuflash.bert_padding import pad_input, unpad_input
    x_unpad, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(x, attention_mask)
    out = pad_input(flash_attn_varlen_func(...), indices, batch, seqlen)

unpad_input_for_concatenated_sequences packs rows that each hold several sequences one after the
other; index_first_axis and index_put_first_axis are the row gather and scatter under them all.
All are differentiable. The indices a caller passes (pad_input, index_first_axis,
index_put_first_axis) are checked before torch indexes with them: an integer dtype and rows in
range, read with one look at their extremes (on the GPU a wait for it: these run once per batch,
not on a decode step's path).
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


def index_first_axis(input, indices):
    """Rows `indices` ((n,) int64 or int32, each in [0, rows)) of input (rows, ...): (n, ...). Its
    gradient scatters back into zeros (rows picked twice add up)."""
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        fail(ErrorCode.INVALID_DIMENSION, "input must be a tensor (rows, ...)")
    _check_indices(indices, None, input.shape[0], "input")
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero (first_axis_dim, ...) tensor with values (n, ...) at rows `indices` ((n,) int64 or
    int32, each in [0, first_axis_dim))."""
    _check_rows("values", values, indices, first_axis_dim, "first_axis_dim")
    return _scatter(values, indices, first_axis_dim)


def _scatter(values, indices, rows: int):
    """index_put_first_axis of checked indices."""
    return values.new_zeros((rows, *values.shape[1:])).index_put((indices,), values)


def _check_rows(name: str, values, indices, rows: int, rows_name: str) -> None:
    """values (n, ...) and one index per row, each in [0, rows) (_check_indices)."""
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        fail(ErrorCode.INVALID_DIMENSION, f"{name} must be a tensor (total, ...)")
    _check_indices(indices, values.shape[0], rows, rows_name, f", one index per row of {name}")


def _check_indices(indices, count: int | None, rows: int, rows_name: str, why: str = "") -> None:
    """indices: a 1-D int64 or int32 tensor (of `count` elements unless None) of row numbers in
    [0, rows), the rows of `rows_name` (torch would raise IndexError for a float dtype or a row past
    the end, and wrap a negative one around). The range is checked with one host read of the
    extremes (the module docstring); under torch.compile it is not checked."""
    shape = "(n,)" if count is None else f"({count},)"
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or (count is not None and len(indices) != count):
        fail(ErrorCode.SHAPE_MISMATCH, f"indices must be a {shape} tensor{why}, got "
             f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"indices must be int64 or int32 (row numbers), got {indices.dtype}")
    if indices.numel() == 0 or torch.compiler.is_compiling():
        return
    low, high = (int(e) for e in torch.aminmax(indices))
    if low < 0 or high >= rows:
        fail(ErrorCode.INVALID_ARGUMENT, f"indices must lie in [0, {rows}) (the rows of {rows_name}), got values "
             f"from {low} to {high}")


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
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]  # (nonzero's rows: in range)
    return tokens, indices, cu_seqlens, int(seqlens.max()), used_seqlens


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """The tokens of a batch whose rows each hold several sequences one after the other, packed.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask_in_length: (batch, seqlen) int: row b lists the lengths of the sequences
            concatenated in row b, in order, 0 elsewhere ([2, 3, 0, 0]: tokens 0-1 and 2-4 of the
            row are two sequences, the rest padding).
    Returns:
        (hidden_states (total, ...), indices (total,) int64 in the flattened batch, cu_seqlens
        (sequences + 1,) int32 over every sequence of every row, max_seqlen (int)).
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        fail(ErrorCode.INVALID_DIMENSION, "hidden_states must be a tensor (batch, seqlen, ...)")
    lengths = _check_mask("attention_mask_in_length", attention_mask_in_length, hidden_states)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"attention_mask_in_length must hold int lengths, got {lengths.dtype}")
    seqlen = hidden_states.shape[1]
    keep = torch.arange(seqlen, device=lengths.device)[None] < lengths.sum(dim=-1, keepdim=True)
    seqlens = lengths.flatten()[lengths.flatten() != 0].to(torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]  # (nonzero's rows: in range)
    return tokens, indices, cu_seqlens, int(seqlens.max())


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: hidden_states (total, ...) put back at `indices` of a zero
    (batch, seqlen, ...) tensor. indices: (total,) int64 or int32, each in [0, batch * seqlen),
    checked with one host read of their extremes (on the GPU a wait for the GPU, once per batch:
    pad_input is not on a decode step's path)."""
    _check_rows("hidden_states", hidden_states, indices, batch * seqlen, "the (batch * seqlen) output")
    return _scatter(hidden_states, indices, batch * seqlen).view(batch, seqlen, *hidden_states.shape[1:])
