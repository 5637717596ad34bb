"""User-facing functions: flash-attn 2 compatible, torch SDPA compatible, and the explicit passes.
Each validates its arguments, normalizes them to the flash-attn layout and calls the custom ops."""
from __future__ import annotations

import torch

from . import ops
from .errors import (ErrorCode, check_attention_inputs, check_same, check_tensor, fail, lse_dtype,
                     not_supported_yet, resolve_scale)
from .reference import attention_probs


def _check_options(dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Options of the flash-attn API that are not implemented yet raise, never pass silently."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        fail(ErrorCode.INVALID_ARGUMENT, f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        not_supported_yet("dropout_p", dropout_p, "0.0")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)):
        fail(ErrorCode.INVALID_ARGUMENT, f"window_size must be a pair of ints >= -1, got {window_size!r}")
    if tuple(window_size) != (-1, -1):
        not_supported_yet("window_size", tuple(window_size), "(-1, -1)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        fail(ErrorCode.INVALID_ARGUMENT, f"softcap must be a number >= 0, got {softcap!r}")
    if softcap > 0:
        not_supported_yet("softcap", softcap, "0.0")
    if alibi_slopes is not None:
        not_supported_yet("alibi_slopes", f"<tensor {tuple(getattr(alibi_slopes, 'shape', ()))}>", "None")


def _check_device(q: torch.Tensor) -> None:
    ops.backend_name(q.device, q.dtype)  # raises if no backend can run here


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention, flash-attn 2 compatible.

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32 (fp64 on the CPU path).
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k (MQA/GQA).
        dropout_p: must be 0.0 for now.
        softmax_scale: scale of QK^T before the softmax; default 1/sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner of the (seqlen_q, seqlen_k) score
            matrix: query i sees keys j <= i + seqlen_k - seqlen_q.
        window_size, softcap, alibi_slopes: must keep their defaults for now.
        deterministic: accepted; the backward is always deterministic.
        return_attn_probs: also return softmax_lse and the attention probabilities (for tests:
            it materializes (batch, nheads, seqlen_q, seqlen_k)).
    Returns:
        out (batch, seqlen_q, nheads, headdim); with return_attn_probs,
        (out, softmax_lse (batch, nheads, seqlen_q) fp32, probs (batch, nheads, seqlen_q, seqlen_k)).
    """
    _check_options(dropout_p, window_size, softcap, alibi_slopes)
    check_attention_inputs(q, k, v)
    _check_device(q)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    causal_offset = k.shape[1] - q.shape[1]
    out, lse = ops.attention_forward(q, k, v, scale, bool(causal), causal_offset)
    if return_attn_probs:
        probs, _ = attention_probs(q.detach(), k.detach(), scale, bool(causal), causal_offset, torch.float32)
        return out, lse, probs.to(q.dtype)
    return out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim); see flash_attn_func."""
    check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        fail(ErrorCode.SHAPE_MISMATCH, f"qkv must have size 3 in dim 2, got shape {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on q (batch, seqlen_q, nheads, headdim) and kv (batch, seqlen_k, 2, nheads_k,
    headdim); see flash_attn_func."""
    check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        fail(ErrorCode.SHAPE_MISMATCH, f"kv must have size 2 in dim 2, got shape {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Args:
        query: (..., nheads, L, E); key, value: (..., nheads_k, S, E), at least 3 dims, the leading
            dims (batch) equal. nheads_k == nheads unless enable_gqa, then nheads % nheads_k == 0.
        attn_mask: must be None for now.
        dropout_p: must be 0.0 for now.
        is_causal: causal mask aligned to the top-left corner, as torch does: query i sees keys j <= i.
        scale: default 1/sqrt(E).
    Returns:
        (..., nheads, L, E), a view in torch's layout of a (batch, L, nheads, E) buffer.
    """
    if attn_mask is not None:
        not_supported_yet("attn_mask", "<tensor>", "None")
    _check_options(dropout_p)
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        check_tensor(name, t, max(3, getattr(t, "ndim", 3)), "(..., nheads, seqlen, headdim)")
    if not (query.ndim == key.ndim == value.ndim) or query.shape[:-3] != key.shape[:-3]:
        fail(ErrorCode.SHAPE_MISMATCH, f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
             f"{tuple(value.shape)} must have the same leading (batch) dimensions")
    if not enable_gqa and query.shape[-3] != key.shape[-3]:
        fail(ErrorCode.SHAPE_MISMATCH, f"query has {query.shape[-3]} heads and key {key.shape[-3]}; "
             f"pass enable_gqa=True for grouped-query attention")
    if value.shape[-1] != query.shape[-1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"value has head dim {value.shape[-1]} but query has {query.shape[-1]}; "
             f"cuflash needs them equal")

    def to_flash(t):  # (..., H, N, D) -> (B, N, H, D), a view
        return t.reshape(-1, *t.shape[-3:]).transpose(1, 2)

    q, k, v = to_flash(query), to_flash(key), to_flash(value)
    check_attention_inputs(q, k, v, names)
    _check_device(q)
    softmax_scale = resolve_scale(scale, q.shape[-1], "scale")
    out, _ = ops.attention_forward(q, k, v, softmax_scale, bool(is_causal), 0)
    return out.transpose(1, 2).reshape(query.shape)


def forward(q, k, v, *, softmax_scale=None, causal=False):
    """The explicit forward pass, no autograd: q (batch, seqlen_q, nheads, headdim), k, v
    (batch, seqlen_k, nheads_k, headdim) -> (out like q, softmax_lse (batch, nheads, seqlen_q) fp32)."""
    check_attention_inputs(q, k, v)
    _check_device(q)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    with torch.no_grad():
        return ops.attention_forward(q, k, v, scale, bool(causal), k.shape[1] - q.shape[1])


def backward(dout, q, k, v, out, softmax_lse, *, softmax_scale=None, causal=False):
    """The explicit backward pass: gradients (dq, dk, dv) shaped like q, k, v, from the forward's
    out and softmax_lse (batch, nheads, seqlen_q)."""
    check_attention_inputs(q, k, v)
    _check_device(q)
    check_same("dout", dout, q, "q")
    check_same("out", out, q, "q")
    check_same("softmax_lse", softmax_lse, q, "q", shape=(q.shape[0], q.shape[2], q.shape[1]))
    for name, t in (("dout", dout), ("out", out)):
        if t.dtype != q.dtype:
            fail(ErrorCode.DTYPE_MISMATCH, f"{name} has dtype {t.dtype} but q has {q.dtype}")
    if softmax_lse.dtype != lse_dtype(q.dtype):
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"softmax_lse must be {lse_dtype(q.dtype)} for {q.dtype} inputs, "
             f"got {softmax_lse.dtype}")
    scale = resolve_scale(softmax_scale, q.shape[-1])
    with torch.no_grad():
        return ops.attention_backward(dout, q, k, v, out, softmax_lse, scale, bool(causal),
                                      k.shape[1] - q.shape[1])
