"""flash_attn_with_kvcache: attention of a few new query tokens to a KV cache, flash-attn 2
compatible: rotary embedding of the new tokens, in-place append into a contiguous or paged cache,
then attention to each sequence's cached keys.

The attention is ops.decode (a custom op, so a decode step compiles with torch.compile): with the
Triton backend the decode kernel (kernels/triton/decode.py), which reads the cache in place, split over
its length, with the query heads of a GQA group packed together; the CPU path gathers each
sequence's keys and runs the blocked varlen attention on them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .backend import backend_name
from .cache import IndexKind, index_error, index_violation
from .errors import ErrorCode, fail
from .memo import plain_flash_options, remembered, signature
from .params import AttentionParams, per_sequence
from .rotary import check_cos_sin, rotate
from .validate import (check_alibi, check_attention_inputs, check_bool, check_learnable_sink, check_softcap,
                       check_tensor, check_window, resolve_scale)


def _int_tensor(name: str, t, shape: tuple, device, dtypes=(torch.int32,)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be a tensor of shape {shape}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {t.device} but q is on {device}")
    return t


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            learnable_sink=None):
    """Attention of q to a KV cache, after appending the new k, v into it (in place).

    Args:
        q: (batch, seqlen_q, nheads, headdim), usually seqlen_q = 1 (decoding) or a few tokens.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged:
            (num_blocks, page_block_size, nheads_k, headdim) with block_table; any strides but the
            last dim's (a (batch, nheads_k, seqlen, headdim) cache transposed is read in place).
            v_cache's head dim headdim_v may differ from q's and k_cache's (as flash_attn_func's v:
            FlashAttention-3's (192, 128), or a latent cache such as (64, 512)).
        k, v: None, or (batch, seqlen_new, nheads_k, headdim) and (batch, seqlen_new, nheads_k,
            headdim_v): written into the cache at positions cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1 before attending.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): rotary embedding (as
            cuflash.apply_rotary_emb) of new key i at position cache_seqlens[b] + i and of query i
            at cache_seqlens[b] + i when causal or windowed (else every query at cache_seqlens[b]).
            Positions count from the start of the cache row, with cache_leftpad too (as flash-attn).
            rotary_interleaved: GPT-J pairs, else GPT-NeoX halves.
        cache_seqlens: int or (batch,) int32: tokens in each cache before the append (None: full).
        cache_batch_idx: (batch,) int32/int64: the cache row of each sequence (contiguous cache).
        cache_leftpad: (batch,) int32: each sequence's keys start at this position (contiguous cache).
        block_table: (batch, max_blocks_per_seq) int32: the cache pages of each sequence, in order;
            any page_block_size (the kernel reads the page of each key).
        causal, window_size, softcap, alibi_slopes, softmax_scale: as flash_attn_func (causal and
            rotary_interleaved are bools: validate.check_bool), aligned to
            the bottom-right corner of each sequence (query i sits at key position
            cache_seqlens + seqlen_new - seqlen_q + i).
        num_splits: how many parts the decode kernel splits each sequence's keys into (0: enough
            to fill the GPU; at most 64; with a paged cache more where a part would span over 2048
            pages); only the rounding of the result depends on it.
        return_softmax_lse: also return softmax_lse (batch, nheads, seqlen_q) fp32.
        learnable_sink: as flash_attn_func's (forward only here: no gradient), counted once whatever
            num_splits.
    Returns:
        out (batch, seqlen_q, nheads, headdim_v), and softmax_lse with return_softmax_lse.
    Bad input raises FlashAttentionError before the cache is touched, with one exception: on the GPU
    the values of the index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) are
    checked by the decode kernel before it reads or writes through them. A sequence with a bad value
    reads and writes nothing through it (the others are appended and attended), and by default the
    call raises the error once the GPU has run the step (one wait for the GPU, which a step without
    index tensors does not pay). With cuflash.set_decode_errors("defer"), and inside a CUDA-graph
    capture, the step does not wait: the bad sequence's output and softmax_lse are NaN, and the
    error, naming the step, is raised by the next deferred step on the device or by
    cuflash.raise_decode_errors() (cache.py).
    """
    rotary_interleaved = check_bool("rotary_interleaved", rotary_interleaved)
    call = _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, learnable_sink)
    q, k = _rotate(call, q, k, rotary_cos, rotary_sin, rotary_interleaved)
    out, lse = ops.decode(q, k_cache, v_cache, call.seqlens, call.seqlen_new, call.leftpad, call.rows, call.table,
                          call.params, num_splits, k, v, call.plans, call.rotary_end)
    return (out, lse) if return_softmax_lse else out


@dataclass(frozen=True)
class _Call:
    """A checked call: cache_seqlens stays an int when given as one, and the optional index tensors
    None when not given, so that a plain decode step launches no kernel besides attention."""
    seqlens: torch.Tensor | int  # tokens in each cache before the append
    seqlen_new: int
    leftpad: torch.Tensor | None
    rows: torch.Tensor | None  # cache_batch_idx
    table: torch.Tensor | None  # block_table
    params: AttentionParams
    shifted: bool  # query token i at position cache_seqlens + i (causal or windowed), else all at cache_seqlens
    plans: dict | None  # the launch plans of the call signature (memo.remembered)
    rotary_end: int | None  # the largest cache_seqlens the rotary tables cover (None: no rotary)


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
              learnable_sink) -> _Call:
    """Checks every argument before anything is written: the values of the index tensors too, except
    where the decode kernel checks them (the Triton backend on the GPU) or torch.compile traces. The
    checks that read no tensor value run once per call signature (memo.py)."""
    plain = (plain_flash_options(softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink)
             and type(num_splits) is int and (cache_seqlens is None or type(cache_seqlens) in (int, torch.Tensor)))
    given = isinstance(cache_seqlens, torch.Tensor)
    key = signature((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                     cache_seqlens if given else None), "kvcache", softmax_scale, causal, window_size, softcap,
                    num_splits) if plain else None
    layout, plans = remembered(key, lambda: _check_layout(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, learnable_sink))
    if layout.strided_indexes:  # the kernels address them by position (flash-attn refuses such views)
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table = (
            t.contiguous() if isinstance(t, torch.Tensor) else t
            for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    seqlens = layout.capacity if cache_seqlens is None else cache_seqlens
    if not torch.compiler.is_compiling():
        _check_values(layout, seqlens, cache_leftpad, cache_batch_idx, k_cache.shape[0], block_table, k_cache.shape[1])
    return _Call(seqlens, layout.seqlen_new, cache_leftpad, cache_batch_idx, block_table, layout.params,
                 layout.shifted, plans, layout.rotary_end)


@dataclass(frozen=True)
class _Layout:
    """What the checks of a call's shapes, dtypes, devices, strides and options give; the same for
    every call of a signature."""
    params: AttentionParams
    capacity: int  # cache positions per sequence
    seqlen_new: int
    shifted: bool  # see _Call
    rotary_end: int | None  # the largest cache_seqlens the rotary tables cover (None: no rotary)
    strided_indexes: bool  # an index tensor is a strided view, to be copied contiguous on every call
    kernel_checks: bool  # the decode kernel checks the index tensors' values (the Triton backend on the GPU)


def _check_layout(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                  learnable_sink) -> _Layout:
    """The checks of _validate that read no tensor value."""
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4, "(batch_cache, seqlen_cache, nheads_k, headdim) or paged "
                     "(num_blocks, page_block_size, nheads_k, headdim)")
    check_attention_inputs(q[:1, :1], k_cache[:1, :1], v_cache[:1, :1], ("q", "k_cache", "v_cache"))
    backend = backend_name(q.device, q.dtype)  # raises where no backend runs
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ "
             f"but for the head dim")
    rows_per_seq = k_cache.shape[1]
    table = None
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            fail(ErrorCode.INVALID_ARGUMENT, "block_table must be an int32 tensor (batch, max_blocks_per_seq)")
        table = _int_tensor("block_table", block_table, (batch, block_table.shape[1]), q.device)
        if table.shape[1] == 0:
            fail(ErrorCode.EMPTY_TENSOR, f"block_table has no columns (shape {tuple(table.shape)}); each sequence "
                 f"needs at least one page")
        for name, arg in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if arg is not None:
                fail(ErrorCode.UNSUPPORTED_FEATURE, f"{name} with a paged cache (block_table) is not supported")
    capacity = rows_per_seq * (1 if table is None else table.shape[1])
    rows = None if cache_batch_idx is None else \
        _int_tensor("cache_batch_idx", cache_batch_idx, (batch,), q.device, (torch.int32, torch.int64))
    if table is None and rows is None and k_cache.shape[0] < batch:
        fail(ErrorCode.SHAPE_MISMATCH, f"k_cache has {k_cache.shape[0]} cache rows for a batch of {batch}; "
             f"pass cache_batch_idx to map sequences to rows")
    if cache_seqlens is not None and not (isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)):
        _int_tensor("cache_seqlens", cache_seqlens, (batch,), q.device)
    if cache_leftpad is not None:
        _int_tensor("cache_leftpad", cache_leftpad, (batch,), q.device)
    seqlen_new = 0
    if (k is None) != (v is None):
        fail(ErrorCode.INVALID_ARGUMENT, "pass both k and v (the new tokens) or neither")
    if k is not None:
        check_attention_inputs(q, k, v, ("q", "k", "v"))
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if new.shape[2:] != cache.shape[2:] or new.dtype != cache.dtype:
                fail(ErrorCode.SHAPE_MISMATCH, f"{name} {tuple(new.shape)} {new.dtype} does not fit {name}_cache "
                     f"{tuple(cache.shape)} {cache.dtype}")
        seqlen_new = k.shape[1]
    causal = check_bool("causal", causal)
    left, right = check_window(window_size)
    params = AttentionParams(resolve_scale(softmax_scale, head_dim), left, 0 if causal else right,
                             softcap=check_softcap(softcap),
                             alibi_slopes=check_alibi(alibi_slopes, batch, nheads, q.device),
                             learnable_sink=check_learnable_sink(learnable_sink, nheads, q.device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        fail(ErrorCode.INVALID_ARGUMENT, f"num_splits must be an int >= 0, got {num_splits!r}")
    if rotary_cos is not None or rotary_sin is not None:
        check_cos_sin(rotary_cos, rotary_sin, head_dim, q.device, ("rotary_cos", "rotary_sin"))
    shifted = causal or (left, right) != (-1, -1)
    strided = any(isinstance(t, torch.Tensor) and not t.is_contiguous()
                  for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    query_span = max(seqlen_new, seqlen_q if shifted else 1)  # positions from cache_seqlens the tokens take
    rotary_end = None if rotary_cos is None else rotary_cos.shape[0] - query_span
    return _Layout(params, capacity, seqlen_new, shifted, rotary_end, strided,
                   q.is_cuda and backend == "triton")


def _rotate(call: _Call, q, k, rotary_cos, rotary_sin, interleaved):
    """The rotary embedding of q and the new keys (flash-attn's positions: see
    flash_attn_with_kvcache). Returns q and k as attention and the append take them."""
    if rotary_cos is None:
        return q, k
    batch, seqlen_q = q.shape[:2]
    lengths = per_sequence(call.seqlens, batch, q.device)
    positions_q = lengths[:, None] + (torch.arange(seqlen_q, device=q.device)[None, :] if call.shifted else 0)
    q = rotate(q, rotary_cos, rotary_sin, positions_q.expand(batch, seqlen_q), interleaved)
    if k is not None:
        positions_new = lengths[:, None] + torch.arange(call.seqlen_new, device=q.device)[None, :]
        k = rotate(k, rotary_cos, rotary_sin, positions_new, interleaved)
    return q, k


def _check_values(layout: _Layout, seqlens, leftpad, rows, cache_rows: int, table, rows_per_seq: int) -> None:
    """Checks the values of the index arguments (cache.index_violation) where they can be read without
    waiting for the GPU: an int cache_seqlens always, the index tensors unless the decode kernel
    checks them (kernels/triton/decode.py)."""
    tensors = any(isinstance(t, torch.Tensor) for t in (seqlens, leftpad, rows, table))
    if tensors and not layout.kernel_checks:
        found = index_violation(seqlens, layout.seqlen_new, leftpad, rows, cache_rows, table, rows_per_seq,
                                    layout.seqlen_new > 0, layout.rotary_end)
    elif isinstance(seqlens, int):  # the same for every sequence
        found = _int_violation(seqlens, layout.capacity - layout.seqlen_new, layout.rotary_end)
    else:
        return
    if found is not None:
        fail(ErrorCode.INVALID_ARGUMENT, index_error(*found))


def _int_violation(seqlens: int, seqlens_max: int, rotary_end: int | None):
    """cache.index_violation of an int cache_seqlens (no sequence named)."""
    if not 0 <= seqlens <= seqlens_max:
        return IndexKind.SEQLENS, None, seqlens, seqlens_max
    if rotary_end is not None and seqlens > rotary_end:
        return IndexKind.ROTARY, None, seqlens, rotary_end
    return None
