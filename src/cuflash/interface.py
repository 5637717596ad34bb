"""User-facing functions: flash-attn 2 compatible, torch SDPA compatible, and the explicit passes.
Each validates its arguments, describes the call as one AttentionParams and calls the custom ops."""
from __future__ import annotations

import torch

from . import ops
from .backend import backend_name
from .builtin_mods import chunked_local
from .cpu import attention_probs
from .dropout import draw_seed
from .dtypes import lse_dtype
from .errors import ErrorCode, FlashAttentionError, fail
from .flex import traced_mod
from .memo import number, plain_flash_options, remembered, signature
from .mods import Mods, packed
from .mods.compiled import EAGER_REASON, graph_chunked_local, graph_mod, runs_eagerly
from .params import AttentionParams, used_lengths
from .validate import (check_alibi, check_attention_chunk, check_attention_inputs, check_attn_mask, check_block_table,
                       check_blocks, check_bool, check_cu_seqlens, check_dropout, check_learnable_sink,
                       check_max_seqlen, check_pages, check_same, check_seqused, check_softcap, check_tensor,
                       check_window, resolve_scale, strided_head_dim)


def _params(q: torch.Tensor, batch: int, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
            deterministic, learnable_sink=None, **fields) -> AttentionParams:
    """The flash-attn options, checked, as AttentionParams (bottom-right aligned, like flash-attn)."""
    dropout_p = check_dropout(dropout_p)
    left, right = check_window(window_size)
    return AttentionParams(
        softmax_scale=resolve_scale(softmax_scale, q.shape[-1]),
        window_left=left, window_right=0 if check_bool("causal", causal) else right,
        softcap=check_softcap(softcap),
        alibi_slopes=check_alibi(alibi_slopes, batch, q.shape[-2], q.device),
        learnable_sink=check_learnable_sink(learnable_sink, q.shape[-2], q.device),
        dropout_p=dropout_p, rng_seed=draw_seed(q.device) if dropout_p > 0 else None,
        deterministic=check_bool("deterministic", deterministic), **fields)


def _flash_params(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                  score_mod, mask_mod, attention_chunk, learnable_sink) -> tuple[AttentionParams, dict | None]:
    """flash_attn_func's inputs checked and its options as AttentionParams, once per call signature
    (memo.py), with the signature's launch plans (ops.forward). A call with mods is never remembered:
    its params hold this call's mods and captured tensors."""
    plain = (plain_flash_options(softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink)
             and number(dropout_p) and dropout_p == 0 and type(deterministic) is bool and score_mod is None
             and mask_mod is None and type(attention_chunk) is int and attention_chunk == 0)
    key = signature((q, k, v), softmax_scale, causal, window_size, softcap, deterministic) if plain else None

    def build():
        check_attention_inputs(q, k, v, empty=True)
        _check_device(q)
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        mods = _mods(q, batch, seqlen_q, seqlen_k, score_mod, mask_mod, check_attention_chunk(attention_chunk),
                     seqlen_k - seqlen_q)
        return _params(q, batch, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                       deterministic, learnable_sink, mods=mods)
    return remembered(key, build)


def _mods(q: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int, score_mod, mask_mod, chunk: int,
          offset: int | torch.Tensor) -> Mods | None:
    """The call's score_mod and mask_mod (the user's, and with attention_chunk > 0 the built-in
    chunked_local, which then takes the user's mask_mod in) as Mods without a block mask (the kernels
    apply mask_mod to every tile), traced for q's device and checked for reads outside their captured
    tensors at these sizes (varlen: the longest sequences); None without any. offset: the key position
    of the first query (chunked_local's). Under torch.compile, packed (mods/compiled.py)."""
    if torch.compiler.is_compiling():
        return _graph_mods(q.device, score_mod, mask_mod, chunk, offset)
    score = None if score_mod is None else traced_mod(score_mod, "score", q.device)
    mask = None if mask_mod is None else traced_mod(mask_mod, "mask", q.device)  # (the user's errors first)
    if chunk:
        mask = traced_mod(chunked_local(chunk, offset, mask_mod), "mask", q.device)
    if score is None and mask is None:
        return None
    mods = Mods(score=score, mask=mask)
    mods.check(batch, q.shape[-2], seqlen_q, seqlen_k)
    return mods


def _graph_mods(device: torch.device, score_mod, mask_mod, chunk: int, offset: int | torch.Tensor) -> Mods | None:
    """_mods under torch.compile (their read checks run in the custom op, at run time)."""
    score = None if score_mod is None else graph_mod(score_mod, "score", device)
    mask: tuple | None = None
    if chunk:
        mask = graph_chunked_local(chunk, offset, mask_mod, device)
    elif mask_mod is not None:
        mask = graph_mod(mask_mod, "mask", device)
    return None if score is None and mask is None else Mods(packed=packed(score, mask, None))


def _eagerly(score_mod, mask_mod, attention_chunk, return_attn_probs) -> bool:
    """Under torch.compile: whether a call runs eagerly instead (a graph break): one with mods that cannot
    enter the graph (mods/compiled.py), or with mods and return_attn_probs (the probabilities' mods are
    computed eagerly only: cpu.attention_probs takes traced mods)."""
    if not torch.compiler.is_compiling():
        return False
    probs = return_attn_probs is True and (score_mod is not None or mask_mod is not None or bool(attention_chunk))
    return probs or runs_eagerly(score_mod, mask_mod)


def _check_device(q: torch.Tensor) -> None:
    backend_name(q.device, q.dtype)  # raises if no backend can run here


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    score_mod=None, mask_mod=None, attention_chunk=0, learnable_sink=None):
    """Exact attention, flash-attn 2 compatible.

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32 (fp64 on the CPU path).
        k: (batch, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k (MQA/GQA).
        v: (batch, seqlen_k, nheads_k, headdim_v): the value head dim may differ from q's and k's
            (FlashAttention-3/4's headdim_v, as DeepSeek's MLA (192, 128)); out has it.
        dropout_p: probability of dropping each attention probability (the rest are scaled by
            1 / (1 - dropout_p)); drawn from torch's generator, so torch.manual_seed reproduces it.
            Applied whenever > 0: pass 0.0 at evaluation, as with flash-attn.
        softmax_scale: scale of QK^T before the softmax; default 1/sqrt(headdim). Any finite
            number, as flash-attn: 0 gives uniform attention over the visible keys.
        causal: causal mask aligned to the bottom-right corner of the (seqlen_q, seqlen_k) score
            matrix: query i sees keys j <= i + seqlen_k - seqlen_q.
        window_size: (left, right) sliding window, -1 for unbounded: query i sees keys
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (causal: right = 0).
            Tiles outside the window are skipped, so the cost grows with the window.
        softcap: if > 0, the scaled logits x become softcap * tanh(x / softcap).
        alibi_slopes: (nheads,) or (batch, nheads) fp32: adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: a bitwise reproducible backward. Without it, Hopper's fastest backward
            adds dQ across key tiles in whatever order they finish (as flash-attn's default).
        return_attn_probs: also return softmax_lse and the attention probabilities (for tests:
            it materializes (batch, nheads, seqlen_q, seqlen_k); dropped ones are negated).
        causal, deterministic and return_attn_probs are bools (validate.check_bool).
        score_mod: None or score_mod(score, b, h, q_idx, kv_idx) -> score, as FlexAttention's (and
            FlashAttention-4's) and written the same way (docs/programmable.md): score is
            scale * q.k in fp32 after softcap (ALiBi is added after it), b the batch index, h the
            query head, q_idx and kv_idx positions from 0 (int32, not shifted by causal's alignment).
            Captured tensors that require grad get their gradients.
        mask_mod: None or mask_mod(b, h, q_idx, kv_idx) -> bool: hides the keys it returns False for,
            on top of causal and window_size. Both are compiled into the kernels, eagerly and under
            torch.compile (docs/programmable.md); torch.func transforms refuse them.
        attention_chunk: FlashAttention-3's chunked local attention (Llama 4), an int >= 0, 0 off:
            the keys are cut into chunks of attention_chunk keys and query i, at key position
            i + seqlen_k - seqlen_q, sees only the keys of its chunk (also within causal and
            window_size when given). A built-in mask_mod (builtin_mods.chunked_local).
        learnable_sink: None or (nheads,) fp32/fp16/bf16, gpt-oss's attention sinks (FlashAttention-4's
            learnable_sink): one more logit per query head in every row's softmax, with no value,
            compared with the scaled logits as given (no softcap, ALiBi or score_mod applies to it);
            softmax_lse counts it. Differentiable.
    Returns:
        out (batch, seqlen_q, nheads, headdim_v); with return_attn_probs,
        (out, softmax_lse (batch, nheads, seqlen_q) fp32, probs (batch, nheads, seqlen_q, seqlen_k)).
        Rows that see no key give out = 0 and softmax_lse = +inf (the sink's logit with a learnable sink).
    """
    if _eagerly(score_mod, mask_mod, attention_chunk, return_attn_probs):
        return _flash_attn_func_eagerly(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, return_attn_probs, score_mod=score_mod, mask_mod=mask_mod,
                                        attention_chunk=attention_chunk, learnable_sink=learnable_sink)
    with_probs = check_bool("return_attn_probs", return_attn_probs)
    p, plans = _flash_params(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                             deterministic, score_mod, mask_mod, attention_chunk, learnable_sink)
    out, lse = ops.forward(q, k, v, p, plans)
    if with_probs:
        return out, lse, attention_probs(q.detach(), k.detach(), p).to(q.dtype)
    return out


# Under torch.compile, a call whose mods cannot enter the graph (mods/compiled.py) runs eagerly: a graph break.
_flash_attn_func_eagerly = torch.compiler.disable(flash_attn_func, reason=EAGER_REASON)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              score_mod=None, mask_mod=None, attention_chunk=0, learnable_sink=None):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim); see flash_attn_func."""
    check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)", empty=True)
    if qkv.shape[2] != 3:
        fail(ErrorCode.SHAPE_MISMATCH, f"qkv must have size 3 in dim 2, got shape {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                           score_mod=score_mod, mask_mod=mask_mod, attention_chunk=attention_chunk,
                           learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             score_mod=None, mask_mod=None, attention_chunk=0, learnable_sink=None):
    """flash_attn_func on q (batch, seqlen_q, nheads, headdim) and kv (batch, seqlen_k, 2, nheads_k,
    headdim); see flash_attn_func."""
    check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)", empty=True)
    if kv.shape[2] != 2:
        fail(ErrorCode.SHAPE_MISMATCH, f"kv must have size 2 in dim 2, got shape {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs,
                           score_mod=score_mod, mask_mod=mask_mod, attention_chunk=attention_chunk,
                           learnable_sink=learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *,
                           score_mod=None, mask_mod=None, attention_chunk=0, seqused_q=None, seqused_k=None,
                           learnable_sink=None):
    """Attention over a batch of sequences of different lengths packed without padding,
    flash-attn 2 compatible, with FlashAttention-3's seqused_q / seqused_k and padded batches. No
    compute is spent on padding.

    Args:
        q: (total_q, nheads, headdim): the queries of every sequence, one after the other.
        k, v: (total_k, nheads_k, headdim) and (total_k, nheads_k, headdim_v) (headdim_v as in
            flash_attn_func).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 prefix sums: sequence b is rows
            cu_seqlens[b]:cu_seqlens[b + 1]. Must start at 0, never decrease and end at total.
            Either may be None, as FlashAttention-3 takes it: q (or k and v) is then a padded batch
            (batch, seqlen, nheads, headdim) whose row b is sequence b, and the max_seqlen beside it
            is not read (None or an int); a padded q gives out and softmax_lse in flash_attn_func's
            layouts.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence.
        causal, window_size, alibi_slopes: as in flash_attn_func, per sequence (aligned to the
            bottom-right corner of each sequence's score matrix); the other options likewise.
        block_table: None, or (batch, max_blocks_per_seq) int32 for a paged K/V cache (forward only,
            as flash-attn): k and v are then (num_blocks, page_block_size, nheads_k, headdim[_v]), any
            page size, read in place; sequence b's keys are the first cu_seqlens_k[b + 1] -
            cu_seqlens_k[b] rows of its pages block_table[b, 0], block_table[b, 1], ...; with
            cu_seqlens_k None (FlashAttention-3's paged call), the max_blocks_per_seq *
            page_block_size rows of its pages, which seqused_k cuts. A table entry outside the pool,
            or too few columns for a sequence, raises before any kernel.
        score_mod, mask_mod, attention_chunk: as in flash_attn_func, per sequence: b is the sequence's
            index in the batch, q_idx and kv_idx count from 0 in every sequence, and attention_chunk's
            chunks start at each sequence's first key. learnable_sink: as in flash_attn_func.
        seqused_q, seqused_k: None, or (batch,) int32 on q's device (FlashAttention-3's, for caches
            filled in part): sequence b uses only the first seqused_q[b] of its query rows and
            seqused_k[b] of its keys, and is attention over those alone (causal, windows, ALiBi
            and attention_chunk align to seqused_k[b] - seqused_q[b]). The rest are not read: their
            out is 0, softmax_lse +inf (a learnable_sink too: they are not rows of the softmax) and
            dq, dk, dv 0 (FlashAttention-3 leaves them unwritten).
            A value above its sequence's rows, or negative, raises before any kernel.
    Returns:
        out (total_q, nheads, headdim_v); with return_attn_probs, (out, softmax_lse (nheads, total_q)
        fp32, probs (batch, nheads, max_seqlen_q, max_seqlen_k), zero-padded).
    """
    if _eagerly(score_mod, mask_mod, attention_chunk, return_attn_probs):
        return _flash_attn_varlen_func_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                               deterministic, return_attn_probs, block_table, score_mod=score_mod,
                                               mask_mod=mask_mod, attention_chunk=attention_chunk,
                                               seqused_q=seqused_q, seqused_k=seqused_k,
                                               learnable_sink=learnable_sink)
    with_probs = check_bool("return_attn_probs", return_attn_probs)
    rows_q, rows_k, rows_v, batch_fields = _varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                         max_seqlen_k, block_table, seqused_q, seqused_k)
    batch = batch_fields["cu_seqlens_q"].numel() - 1
    chunk = check_attention_chunk(attention_chunk)
    offsets = 0  # (each sequence's used seqlen_k - seqlen_q)
    if chunk:
        offsets = (used_lengths(batch_fields["cu_seqlens_k"], batch_fields["seqused_k"])
                   - used_lengths(batch_fields["cu_seqlens_q"], batch_fields["seqused_q"]))
    mods = _mods(rows_q, batch, batch_fields["max_seqlen_q"], batch_fields["max_seqlen_k"], score_mod, mask_mod, chunk,
                 offsets)
    p = _params(rows_q, batch, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                learnable_sink, mods=mods, **batch_fields)
    out, lse = ops.forward(rows_q, rows_k, rows_v, p)
    if cu_seqlens_q is None:  # a padded batch's layouts: out (B, Nq, H, D), softmax_lse (B, H, Nq)
        out, lse = out.view(*q.shape[:2], *out.shape[1:]), lse.view(lse.shape[0], *q.shape[:2]).transpose(0, 1)
    if not with_probs:
        return out
    probs = q.new_zeros((batch, rows_q.shape[1], p.max_seqlen_q, p.max_seqlen_k), dtype=torch.float32)
    dense = p.sequence()
    for b, q_rows, k_rows in p.spans():
        q_b, k_b = rows_q[None, q_rows], p.sequence_keys(rows_k, b, k_rows.start, k_rows.stop)[None]
        probs[b, :, :q_b.shape[1], :k_b.shape[1]] = attention_probs(q_b.detach(), k_b.detach(), dense, b)[0]
    return out, lse.contiguous(), probs.to(q.dtype)


def _varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_q,
                  seqused_k) -> tuple:
    """flash_attn_varlen_func's batch checked, as a packed one: (q, k, v as (total, heads, headdim) rows,
    k and v pages with block_table; the AttentionParams fields that describe the batch). A padded q or
    k, v (cu_seqlens None) becomes (batch * seqlen) rows (a view where its strides allow) with prefix
    sums of equal lengths; pages without cu_seqlens_k give each sequence its table row's capacity."""
    paged, padded_q = block_table is not None, cu_seqlens_q is None
    padded_k = cu_seqlens_k is None and not paged
    check_tensor("q", q, 4 if padded_q else 3, "(batch, seqlen_q, nheads, headdim) without cu_seqlens_q"
                 if padded_q else "(total_q, nheads, headdim)", empty=True)
    layout = ("(num_blocks, page_block_size, nheads_k, headdim) with block_table" if paged
              else "(batch, seqlen_k, nheads_k, headdim) without cu_seqlens_k" if padded_k
              else "(total_k, nheads_k, headdim)")
    check_tensor("k", k, 4 if paged or padded_k else 3, layout, empty=not paged)
    check_tensor("v", v, 4 if paged or padded_k else 3, layout.replace("headdim", "headdim_v"), empty=not paged)
    if (paged or padded_k) and k.shape[:-1] != v.shape[:-1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match "
             f"but for the head dim")
    rows_q = q.flatten(0, 1) if padded_q else q
    rows_k, rows_v = (k.flatten(0, 1), v.flatten(0, 1)) if padded_k else (k, v)
    check_attention_inputs(rows_q[None], rows_k[:1] if paged else rows_k[None], rows_v[:1] if paged else rows_v[None],
                           empty=True)
    _check_device(q)
    if padded_q:
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
        batch, max_seqlen_q = q.shape[:2]
        cu_seqlens_q = _equal_lengths(batch, max_seqlen_q, q.device)
    else:
        batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, q.shape[0], "q", q.device)
    columns = check_block_table(block_table, batch, q.device) if paged else 0
    source_k = "cu_seqlens_k"
    if cu_seqlens_k is None:
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
        if padded_k and k.shape[0] != batch:
            fail(ErrorCode.SHAPE_MISMATCH, f"k has batch {k.shape[0]} but q has {batch} sequences")
        max_seqlen_k = columns * k.shape[1] if paged else k.shape[1]
        cu_seqlens_k = _equal_lengths(batch, max_seqlen_k, q.device)
        source_k = f"block_table's {columns} pages of {k.shape[1]} keys" if paged else "k's seqlen_k"
    else:
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, None if paged else k.shape[0],
                         "k", q.device, batch)
    # The kernels address these by position: a strided view becomes a contiguous copy (as alibi_slopes).
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused_q = check_seqused("seqused_q", seqused_q, batch, cu_seqlens_q, "q's seqlen_q" if padded_q else
                              "cu_seqlens_q", q.device)
    seqused_k = check_seqused("seqused_k", seqused_k, batch, cu_seqlens_k, source_k, q.device)
    if paged:
        check_pages(block_table, k.shape[0], k.shape[1], used_lengths(cu_seqlens_k, seqused_k),
                    source_k if seqused_k is None else "seqused_k")
        block_table = block_table.contiguous()
    return rows_q, rows_k, rows_v, dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                                        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                        block_table=block_table)


def _equal_lengths(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """The int32 prefix sums of `batch` sequences of `seqlen` rows each."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


_flash_attn_varlen_func_eagerly = torch.compiler.disable(flash_attn_varlen_func, reason=EAGER_REASON)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, *, score_mod=None, mask_mod=None,
                                     attention_chunk=0, seqused_q=None, seqused_k=None,
                                     learnable_sink=None):
    """flash_attn_varlen_func on qkv (total, 3, nheads, headdim); see flash_attn_varlen_func."""
    check_tensor("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        fail(ErrorCode.SHAPE_MISMATCH, f"qkv must have size 3 in dim 1, got shape {tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, score_mod=score_mod, mask_mod=mask_mod,
                                  attention_chunk=attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k,
                                  learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    score_mod=None, mask_mod=None, attention_chunk=0, seqused_q=None, seqused_k=None,
                                    learnable_sink=None):
    """flash_attn_varlen_func on q (total_q, nheads, headdim) and kv (total_k, 2, nheads_k, headdim)."""
    check_tensor("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        fail(ErrorCode.SHAPE_MISMATCH, f"kv must have size 2 in dim 1, got shape {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, score_mod=score_mod, mask_mod=mask_mod,
                                  attention_chunk=attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k,
                                  learnable_sink=learnable_sink)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Args:
        query: (..., nheads, L, E); key: (..., nheads_k, S, E); value: (..., nheads_k, S, Ev), the
            leading dims (batch) equal; or all three (L, E), (S, E), (S, Ev) as one head (as torch
            takes them). nheads_k == nheads unless enable_gqa, then nheads % nheads_k == 0. Ev may
            differ from E (as in torch; the kernels take it as it is). Any strides:
            a last dim whose stride is not 1 (x[..., ::2], a transposed view), which torch takes
            and the kernels cannot read, is copied once with .contiguous() (flash_attn_func
            refuses it, as flash-attn does).
        attn_mask: bool (True = attend) or floating (added to the logits), broadcastable to
            (..., nheads, L, S); read through its strides, never expanded in memory (with more than
            one leading dim, they are merged, which copies only a mask whose batch dims cannot merge).
            It gets no gradient.
        dropout_p: as torch, applied whenever > 0.
        is_causal: causal mask aligned to the top-left corner, as torch does: query i sees keys j <= i.
            Not together with attn_mask (torch refuses that too). is_causal and enable_gqa are bools,
            as torch's schema has them (validate.check_bool).
        scale: default 1/sqrt(E); any finite number, as torch (0: uniform attention).
    Returns:
        (..., nheads, L, Ev), a view in torch's layout of a (batch, L, nheads, Ev) buffer. Rows that
        see no key give 0, as in torch (its math backend's safe softmax).
    """
    options = (attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
            and query.ndim == key.ndim == value.ndim == 2):  # (L, E), (S, E), (S, Ev) as one head, as torch takes them
        return scaled_dot_product_attention(query[None], key[None], value[None], *options)[0]
    plain = (attn_mask is None and number(dropout_p) and dropout_p == 0 and type(is_causal) is bool
             and (scale is None or type(scale) is float) and type(enable_gqa) is bool)
    deterministic = torch.are_deterministic_algorithms_enabled()
    sig = signature((query, key, value), is_causal, scale, enable_gqa, deterministic) if plain else None
    try:
        p, plans = remembered(sig, lambda: _sdpa_params(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                        enable_gqa, deterministic))
    except FlashAttentionError as error:
        # A strided head dim (torch takes it, the kernels do not) is copied once and the call made
        # again; the checks find it, so that the common call pays nothing for it.
        strided = [strided_head_dim(t) for t in (query, key, value)]
        if error.code != ErrorCode.NOT_CONTIGUOUS or not any(strided):
            raise
        return scaled_dot_product_attention(*(t.contiguous() if copy else t for t, copy in
                                              zip((query, key, value), strided)), *options)
    if query.ndim == 4:  # a repeated call without a graph: no views made (ops.forward_kept)
        out = ops.forward_kept(query, key, value, p, plans)
        if out is not None:
            return out
    out, _ = ops.forward(_to_flash(query), _to_flash(key), _to_flash(value), p, plans)
    out = out.transpose(1, 2)
    return out if query.ndim == 4 else out.reshape(*query.shape[:-1], value.shape[-1])


def _batched(t):
    """(..., H, N, D) -> (B, H, N, D): the leading dims merged (or a batch of one added); 4-D inputs
    skip the reshape (host time on every call)."""
    if t.ndim == 4:
        return t
    return t[None] if t.ndim == 3 else t.flatten(0, -4)


def _to_flash(t):
    """(..., H, N, D) -> (B, N, H, D), a view."""
    return _batched(t).transpose(1, 2)


def _sdpa_params(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 deterministic: bool) -> AttentionParams:
    """scaled_dot_product_attention's inputs checked and its options as AttentionParams."""
    dropout_p = check_dropout(dropout_p)
    is_causal, enable_gqa = check_bool("is_causal", is_causal), check_bool("enable_gqa", enable_gqa)
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        # What the views need (a tensor of rank >= 3) and the head dim are checked as given (the
        # messages show the caller's shapes), the rest on the views.
        if not isinstance(t, torch.Tensor) or t.ndim < 3 or t.shape[-1] == 0:
            check_tensor(name, t, max(3, getattr(t, "ndim", 3)), "(..., nheads, seqlen, headdim)")
    if not (query.ndim == key.ndim == value.ndim) or query.shape[:-3] != key.shape[:-3]:
        fail(ErrorCode.SHAPE_MISMATCH, f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
             f"{tuple(value.shape)} must have the same leading (batch) dimensions")
    if not enable_gqa and query.shape[-3] != key.shape[-3]:
        fail(ErrorCode.SHAPE_MISMATCH, f"query has {query.shape[-3]} heads and key {key.shape[-3]}; "
             f"pass enable_gqa=True for grouped-query attention")
    if key.shape[-1] != query.shape[-1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"key has head dim {key.shape[-1]} but query has {query.shape[-1]}; they "
             f"must be equal (as torch)")
    q, k, v = _to_flash(query), _to_flash(key), _to_flash(value)
    check_attention_inputs(q, k, v, names, empty=True)
    _check_device(q)
    mask = None
    if attn_mask is not None:
        if is_causal:
            fail(ErrorCode.INVALID_ARGUMENT, "pass either attn_mask or is_causal=True, not both (as torch)")
        mask = check_attn_mask(attn_mask, (*query.shape[:-1], key.shape[-2]), q.device)
        mask = _batched(mask)
    return AttentionParams(resolve_scale(scale, q.shape[-1], "scale"), window_right=0 if is_causal else -1,
                           bottom_right=False, attn_mask=mask, dropout_p=dropout_p,
                           rng_seed=draw_seed(q.device) if dropout_p > 0 else None, deterministic=deterministic)


def _explicit_params(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink, block_m,
                     block_n, deterministic=False) -> AttentionParams:
    check_attention_inputs(q, k, v, empty=True)
    _check_device(q)
    block_m, block_n = check_blocks(block_m, block_n)
    return _params(q, q.shape[0], softmax_scale, causal, window_size, softcap, alibi_slopes, 0.0, deterministic,
                   learnable_sink, block_m=block_m, block_n=block_n)


def forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            learnable_sink=None, block_m=None, block_n=None):
    """The explicit forward pass, no autograd: q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k,
    nheads_k, headdim), v (batch, seqlen_k, nheads_k, headdim_v) -> (out (batch, seqlen_q, nheads,
    headdim_v), softmax_lse (batch, nheads, seqlen_q) fp32).
    The options are flash_attn_func's (softmax_lse counts a learnable_sink). block_m, block_n: the
    tiles of query rows and keys (Br and Bc in the FlashAttention papers), powers of two from 16 to
    128, both or neither (default: the tuned tiles); the CPU path and the Triton kernels honour them
    (the Hopper kernels have fixed tiles: a call with blocks runs the Triton kernel)."""
    p = _explicit_params(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink, block_m,
                         block_n)
    with torch.no_grad():
        return ops.forward(q, k, v, p)


def backward(dout, q, k, v, out, softmax_lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, learnable_sink=None, deterministic=False, block_m=None, block_n=None):
    """The explicit backward pass: gradients (dq, dk, dv) shaped like q, k, v, from the forward's
    out (and its gradient dout), shaped (batch, seqlen_q, nheads, headdim_v), and softmax_lse (batch,
    nheads, seqlen_q), with the forward's options; with learnable_sink (dq, dk, dv, dsink), dsink shaped
    and typed like it (as FlashAttention-4's backward); deterministic as in flash_attn_func; block_m,
    block_n as in forward."""
    p = _explicit_params(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink, block_m,
                         block_n, deterministic)
    out_shape = (*q.shape[:-1], v.shape[-1])  # (q's, with v's head dim)
    check_same("dout", dout, q, "q and v", shape=out_shape)
    check_same("out", out, q, "q and v", shape=out_shape)
    check_same("softmax_lse", softmax_lse, q, "q", shape=(q.shape[0], q.shape[2], q.shape[1]))
    for name, t in (("dout", dout), ("out", out)):
        if t.dtype != q.dtype:
            fail(ErrorCode.DTYPE_MISMATCH, f"{name} has dtype {t.dtype} but q has {q.dtype}")
    if softmax_lse.dtype != lse_dtype(q.dtype):
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"softmax_lse must be {lse_dtype(q.dtype)} for {q.dtype} inputs, "
             f"got {softmax_lse.dtype}")
    with torch.no_grad():
        return ops.backward(dout, q, k, v, out, softmax_lse, p)
