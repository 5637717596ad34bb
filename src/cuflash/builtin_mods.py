"""Options of the flash-attn entry points written as mods (cuflash.mods): plain FlexAttention-style
functions that the CPU path and the kernels compute like any user's mod, so that a variant of this
kind is one function here and its test, with no kernel plumbing.

softcap and ALiBi are AttentionParams fields (the custom ops carry them, the entry points validate
them); `resolved` turns them into the call's score_mod, which every backend calls at its entry."""
from __future__ import annotations

import dataclasses

import torch

from .mods import Mod, Mods
from .params import AttentionParams


def chunked_local(chunk: int, offset: int | torch.Tensor, mask_mod=None):
    """FlashAttention-3's attention_chunk as a mask_mod: the keys are cut into chunks of `chunk` keys
    (0 to chunk - 1, chunk to 2 * chunk - 1, ...) and query row i, at key position p = i + offset, sees
    the keys of its chunk only: p - p mod chunk to p - p mod chunk + chunk - 1 (Python's mod, so that a
    query at a negative position sees none), compared as differences from p (which stay in int32 for
    any chunk up to 2^31 - 1). offset: seqlen_k - seqlen_q (bottom-right alignment, as flash-attn's
    causal), or for a varlen batch a (batch,) int32 tensor of each sequence's.
    mask_mod: the user's mask_mod, whose hidden keys the result hides too (one mask_mod for both)."""
    per_sequence = isinstance(offset, torch.Tensor)

    def attention_chunk(b, h, q_idx, kv_idx):
        position = q_idx + (offset[b] if per_sequence else offset)
        into = position % chunk  # (the query's place in its chunk)
        seen = (kv_idx - position >= -into) & (kv_idx - position < chunk - into)
        return seen if mask_mod is None else seen & mask_mod(b, h, q_idx, kv_idx)
    return attention_chunk


def chunked_local_captures(chunk: int, offset: int | torch.Tensor, mask_mod=None) -> dict:
    """What the function chunked_local(chunk, offset, mask_mod) makes captures, by name: under
    torch.compile, where that function would be made in the graph, its captures are read from here
    (mods/compiled.py)."""
    return {"chunk": chunk, "offset": offset, "per_sequence": isinstance(offset, torch.Tensor), "mask_mod": mask_mod}


def softcap(cap: float):
    """Gemma 2's logit soft-capping (flash-attn's softcap): the score x becomes cap * tanh(x / cap), the
    division a product with 1 / cap (a division per score costs the kernels several instructions)."""
    inverse = 1.0 / cap

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score * inverse)
    return softcap


def alibi(slopes: torch.Tensor, offset: int | torch.Tensor):
    """ALiBi (flash-attn's alibi_slopes): the score of query row i and key j loses slope * |i + offset - j|,
    slopes (nheads,) or (batch, nheads) fp32. offset: the key position of query row 0 (seqlen_k - seqlen_q
    bottom-right aligned, as flash-attn; 0 top-left, as SDPA), or for a varlen batch a (batch,) int32
    tensor of each sequence's."""
    per_batch = slopes.dim() == 2
    per_sequence = isinstance(offset, torch.Tensor)

    def alibi(score, b, h, q_idx, kv_idx):
        slope = slopes[b, h] if per_batch else slopes[h]
        return score - slope * torch.abs(q_idx + (offset[b] if per_sequence else offset) - kv_idx)
    return alibi


def resolved(p: AttentionParams, seqlen_q: int, seqlen_k: int, dtype: torch.dtype = torch.float32) -> AttentionParams:
    """p with its softcap and ALiBi moved into its score_mod, as AttentionParams orders them: softcap on
    scale * q.k, then the user's score_mod, then ALiBi's bias (softcap 0 and alibi_slopes None after);
    p itself where it has neither. seqlen_q, seqlen_k: a dense problem's, whose difference is ALiBi's
    offset with bottom_right (a varlen batch's come from the lengths its sequences use,
    AttentionParams.seqlens). dtype: the scores' (fp64 on the CPU path's fp64 inputs), in which ALiBi
    reads its slopes, as the float64 oracle does."""
    if p.softcap == 0 and p.alibi_slopes is None:
        return p
    score = None if p.mods is None else p.mods.score
    if p.softcap > 0:
        capped = Mod.of(softcap(p.softcap), "score")
        score = capped if score is None else capped.then(score)
    if p.alibi_slopes is not None:
        bias = Mod.of(alibi(p.alibi_slopes.detach().to(dtype), _offset(p, seqlen_q, seqlen_k)), "score")
        score = bias if score is None else score.then(bias)
    mods = Mods(score=score) if p.mods is None else dataclasses.replace(p.mods, score=score)
    return dataclasses.replace(p, softcap=0.0, alibi_slopes=None, mods=mods)


def _offset(p: AttentionParams, seqlen_q: int, seqlen_k: int) -> int | torch.Tensor:
    """The key position of each sequence's first query: seqlen_k - seqlen_q with bottom_right, else 0."""
    if not p.bottom_right:
        return 0
    if p.cu_seqlens_q is not None and p.cu_seqlens_k is not None:
        used_q, used_k = p.seqlens()
        return (used_k - used_q).to(torch.int32)
    return seqlen_k - seqlen_q
