"""flash_attn_with_kvcache: attention of a few new query tokens to a KV cache, flash-attn 2
compatible: rotary embedding of the new tokens, in-place append into a contiguous or paged cache,
then attention to each sequence's cached keys.

Today the attention step gathers each sequence's cached rows into one packed tensor and runs the
varlen kernels on it: exact, on the GPU and the CPU, but it moves the cache twice. The decode
kernel that reads the cache in place, split over its length, is issue 5's remaining work.
"""
from __future__ import annotations

import dataclasses

import torch

from . import ops
from .errors import (ErrorCode, check_alibi, check_attention_inputs, check_softcap, check_tensor, check_window,
                     fail, resolve_scale)
from .params import AttentionParams

PAGE_MULTIPLE = 16  # page sizes the decode kernel will tile


def _int_tensor(name: str, t, shape: tuple, device, dtypes=(torch.int32,)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be a tensor of shape {shape}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {t.device} but q is on {device}")
    return t.long()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (B, N, H, D) at positions (B, N) on its first 2 * cos.shape[1] dims:
    pairs (2i, 2i + 1) when interleaved (GPT-J), halves (i, i + rotary_dim / 2) otherwise (GPT-NeoX)."""
    half = cos.shape[1]
    c = cos.float()[positions][:, :, None, :]  # (B, N, 1, half)
    s = sin.float()[positions][:, :, None, :]
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q to a KV cache, after appending the new k, v into it (in place).

    Args:
        q: (batch, seqlen_q, nheads, headdim), usually seqlen_q = 1 (decoding) or a few tokens.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged:
            (num_blocks, page_block_size, nheads_k, headdim) with block_table.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim): written into the cache at positions
            cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): rotary embedding of k at its
            positions and of q at cache_seqlens + i when causal or windowed (else all at cache_seqlens);
            positions count from cache_leftpad. rotary_interleaved: GPT-J pairs, else GPT-NeoX halves.
        cache_seqlens: int or (batch,) int32: tokens in each cache before the append (None: full).
        cache_batch_idx: (batch,) int32/int64: the cache row of each sequence (contiguous cache).
        cache_leftpad: (batch,) int32: each sequence's keys start at this position (contiguous cache).
        block_table: (batch, max_blocks_per_seq) int32: the cache pages of each sequence, in order;
            page_block_size must be a multiple of 16.
        causal, window_size, softcap, alibi_slopes, softmax_scale: as flash_attn_func, aligned to
            the bottom-right corner of each sequence (query i sits at key position
            cache_seqlens + seqlen_new - seqlen_q + i).
        num_splits: accepted for compatibility (0 = heuristic); it only chooses how the work is
            split and cannot change the result.
        return_softmax_lse: also return softmax_lse (batch, nheads, seqlen_q) fp32.
    Returns:
        out (batch, seqlen_q, nheads, headdim), and softmax_lse with return_softmax_lse.
    Bad input raises FlashAttentionError before the cache is touched.
    """
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4, "(batch_cache, seqlen_cache, nheads_k, headdim) or paged "
                     "(num_blocks, page_block_size, nheads_k, headdim)")
    check_attention_inputs(q[:1, :1], k_cache[:1, :1], v_cache[:1, :1], ("q", "k_cache", "v_cache"))
    ops.backend_name(q.device, q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    paged = block_table is not None
    if k_cache.shape != v_cache.shape:
        fail(ErrorCode.SHAPE_MISMATCH, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    rows_per_seq = k_cache.shape[1]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(0) != t.shape[1] * t.stride(1):
            fail(ErrorCode.NOT_CONTIGUOUS, f"{name} must have its first two dims contiguous (rows written and "
                 f"gathered in place), got strides {t.stride()}")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            fail(ErrorCode.INVALID_ARGUMENT, "block_table must be an int32 tensor (batch, max_blocks_per_seq)")
        table = _int_tensor("block_table", block_table, (batch, block_table.shape[1]), q.device)
        if rows_per_seq % PAGE_MULTIPLE:
            fail(ErrorCode.UNSUPPORTED_FEATURE, f"page_block_size {rows_per_seq} (k_cache.shape[1]) is not a "
                 f"multiple of {PAGE_MULTIPLE}")
        capacity = table.shape[1] * rows_per_seq
        for name, arg in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if arg is not None:
                fail(ErrorCode.UNSUPPORTED_FEATURE, f"{name} with a paged cache (block_table) is not supported")
    else:
        capacity = rows_per_seq
    rows = torch.arange(batch, device=q.device)
    if cache_batch_idx is not None:
        rows = _int_tensor("cache_batch_idx", cache_batch_idx, (batch,), q.device, (torch.int32, torch.int64))
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.long, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.long, device=q.device)
    else:
        seqlens = _int_tensor("cache_seqlens", cache_seqlens, (batch,), q.device)
    leftpad = torch.zeros_like(seqlens) if cache_leftpad is None else \
        _int_tensor("cache_leftpad", cache_leftpad, (batch,), q.device)
    seqlen_new = 0
    if (k is None) != (v is None):
        fail(ErrorCode.INVALID_ARGUMENT, "pass both k and v (the new tokens) or neither")
    if k is not None:
        check_attention_inputs(q, k, v, ("q", "k", "v"))
        if k.shape[2:] != k_cache.shape[2:] or k.dtype != k_cache.dtype:
            fail(ErrorCode.SHAPE_MISMATCH, f"k {tuple(k.shape)} {k.dtype} does not fit k_cache "
                 f"{tuple(k_cache.shape)} {k_cache.dtype}")
        seqlen_new = k.shape[1]
    left, right = check_window(window_size)
    params = AttentionParams(resolve_scale(softmax_scale, head_dim), left, 0 if causal else right,
                             softcap=check_softcap(softcap),
                             alibi_slopes=check_alibi(alibi_slopes, batch, nheads, q.device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        fail(ErrorCode.INVALID_ARGUMENT, f"num_splits must be an int >= 0, got {num_splits!r}")
    if rotary_cos is not None or rotary_sin is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > head_dim:
            fail(ErrorCode.SHAPE_MISMATCH, f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
                 f"{tuple(rotary_sin.shape)} must match, with 2 * rotary_dim / 2 <= headdim {head_dim}")

    # The values of the small index tensors, read to the host and checked before any write.
    ends = seqlens + seqlen_new
    if bool((seqlens < 0).any()) or bool((ends > capacity).any()):
        fail(ErrorCode.INVALID_ARGUMENT, f"cache_seqlens {seqlens.tolist()} + {seqlen_new} new tokens must fit the "
             f"cache's {capacity} positions per sequence")
    if bool((leftpad < 0).any()) or bool((leftpad > seqlens).any()):
        fail(ErrorCode.INVALID_ARGUMENT, f"cache_leftpad {leftpad.tolist()} must lie in [0, cache_seqlens]")
    if bool((rows < 0).any()) or bool((rows >= k_cache.shape[0]).any()) or \
            (k is not None and rows.unique().numel() != batch):
        fail(ErrorCode.INVALID_ARGUMENT, f"cache_batch_idx {rows.tolist()} must be distinct rows of the "
             f"{k_cache.shape[0]} cache rows")
    if paged:
        used = (torch.arange(table.shape[1], device=q.device)[None, :] * rows_per_seq) < ends[:, None]
        if bool(((table < 0) | (table >= k_cache.shape[0]))[used].any()):
            fail(ErrorCode.INVALID_ARGUMENT, f"block_table points outside the {k_cache.shape[0]} cache blocks")
    positions_q = seqlens[:, None] - leftpad[:, None] + (
        torch.arange(seqlen_q, device=q.device)[None, :] if causal or (left, right) != (-1, -1) else 0)
    if rotary_cos is not None:
        needed = int(torch.maximum(ends - leftpad, positions_q.amax(1) + 1).max())
        if needed > rotary_cos.shape[0]:
            fail(ErrorCode.INVALID_ARGUMENT, f"rotary_cos has {rotary_cos.shape[0]} positions; {needed} are needed")

    def flat(seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row of the flattened cache ((blocks * page) or (batch_cache * seqlen_cache)) holding
        position `positions` of sequence `seq` (broadcasting long tensors)."""
        if paged:
            return table[seq, positions // rows_per_seq] * rows_per_seq + positions % rows_per_seq
        return rows[seq] * rows_per_seq + positions

    if rotary_cos is not None:
        q = _rotate(q, rotary_cos, rotary_sin, positions_q.expand(batch, seqlen_q), rotary_interleaved)
    if k is not None:
        positions_new = seqlens[:, None] + torch.arange(seqlen_new, device=q.device)[None, :]
        if rotary_cos is not None:
            k = _rotate(k, rotary_cos, rotary_sin, positions_new - leftpad[:, None], rotary_interleaved)
        target = flat(torch.arange(batch, device=q.device)[:, None], positions_new).flatten()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, target, k.reshape(-1, *k.shape[2:]))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, target, v.reshape(-1, *v.shape[2:]))

    # Each sequence's keys, positions leftpad .. ends - 1, packed one sequence after the other.
    lengths = ends - leftpad
    cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    total = int(cu_seqlens_k[-1])
    owner = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    positions = leftpad[owner] + torch.arange(total, device=q.device) - cu_seqlens_k[owner].long()
    source = flat(owner, positions)
    k_packed = k_cache.view(-1, *k_cache.shape[2:])[source]
    v_packed = v_cache.view(-1, *v_cache.shape[2:])[source]
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    params = dataclasses.replace(params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=seqlen_q, max_seqlen_k=max(1, int(lengths.max())))
    with torch.no_grad():
        out, lse = ops.forward(q.reshape(batch * seqlen_q, nheads, head_dim), k_packed, v_packed, params)
    out = out.view(batch, seqlen_q, nheads, head_dim)
    if return_softmax_lse:
        return out, lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()
    return out
