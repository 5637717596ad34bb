"""Options of the flash-attn entry points written as mods (cuflash.mods): plain FlexAttention-style
functions that the CPU path and the Triton kernels compute like any user's mod, so that a variant of
this kind is one function here and its test, with no kernel plumbing."""
from __future__ import annotations

import torch


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
