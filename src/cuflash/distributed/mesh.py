"""Context parallelism over a DeviceMesh, the way torch's distributed training describes its ranks
(a context-parallel mesh, or the "cp" dimension of a larger one beside FSDP2's data-parallel one):
a 1-D mesh runs the all-to-all or the ring over its ranks, a 2-D mesh the hybrid (ring over dim 0,
all-to-all within dim 1, e.g. nodes x GPUs of a node)."""
from __future__ import annotations

import torch

from ..errors import ErrorCode, fail
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func, window_bounds
from .shards import require_process_group, split_packed, split_sequence
from .ulysses import hybrid_flash_attn_func, hybrid_shard, ulysses_flash_attn_func, ulysses_flash_attn_varlen_func

MODES = ("auto", "ring", "ulysses", "hybrid")
# The longest whole sequence the all-to-all takes in auto mode. It runs one call over the whole
# sequence of a rank's heads, and such calls slow down from 256k keys, while the ring's calls stay
# shard-sized: on 2 and on 4 GPUs the all-to-all led up to 128k tokens, the ring from 256k
# (docs/tuning.md).
ULYSSES_MAX_TOKENS = 131072


def auto_mode(nheads: int, nheads_k: int, seqlen: int, size: int, ring_can: bool = True) -> str:
    """The 1-D mode for a whole sequence of seqlen tokens on `size` ranks: the all-to-all where both
    head counts divide among the ranks and the sequence is at most ULYSSES_MAX_TOKENS, or is of any
    length where the ring cannot run the call (ring_can False: packed cross-attention, a window over
    packed zigzag shards); else the ring."""
    if nheads % size == 0 and nheads_k % size == 0 and (seqlen <= ULYSSES_MAX_TOKENS or not ring_can):
        return "ulysses"
    return "ring"


def _groups(mesh):
    if mesh.ndim not in (1, 2):
        fail(ErrorCode.INVALID_ARGUMENT, f"a context-parallel mesh has 1 or 2 dims, got {mesh.ndim} "
             "(take the cp dims of a larger mesh: mesh['cp'])")
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _check_mode(mode) -> None:
    if mode not in MODES:
        fail(ErrorCode.INVALID_ARGUMENT, f"mode={mode!r}; accepted: {', '.join(MODES)}")


def _one_dim_mode(mode: str, size: int, nheads: int, nheads_k: int, seqlen: int, ring_lacks: str | None,
                  a2a_lacks: str | None = None) -> str:
    """The mode a 1-D mesh of `size` ranks runs: mode, or auto_mode's choice (the ring where the
    all-to-all cannot run the call). ring_lacks / a2a_lacks name what of the call the ring / the
    all-to-all cannot do (None: nothing): that mode then fails naming it."""
    if mode == "hybrid":
        fail(ErrorCode.INVALID_ARGUMENT, "mode='hybrid' needs a 2-D mesh (ring dim, all-to-all dim)")
    if mode == "auto":
        mode = "ring" if a2a_lacks is not None else auto_mode(nheads, nheads_k, seqlen, size,
                                                             ring_can=ring_lacks is None)
    if mode == "ring" and ring_lacks is not None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"{ring_lacks}: the ring cannot run it; the all-to-all (mode='ulysses') "
             f"can, where nheads ({nheads}) and nheads_k ({nheads_k}) are multiples of the mesh's {size} ranks")
    if mode == "ulysses" and a2a_lacks is not None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"{a2a_lacks}: the all-to-all cannot run it; the ring (mode='ring') can")
    return mode


def context_parallel_shard(x: torch.Tensor, mesh, layout: str = "contiguous", dim: int = 1,
                           cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the whole sequence x (along dim) for context_parallel_attn_func on `mesh`;
    with cu_seqlens (the prefix sums of the documents packed along dim, a tensor or a list), of the
    packed batch for context_parallel_attn_varlen_func on a 1-D mesh (shards.py: "zigzag" cuts each
    document into 2W chunks; its length must be a multiple of 2W)."""
    coords = mesh.get_coordinate()
    if cu_seqlens is not None:
        if mesh.ndim != 1:
            fail(ErrorCode.UNSUPPORTED_FEATURE, f"packed documents (cu_seqlens) run on a 1-D mesh, got {mesh.ndim} "
                 "dims")
        return split_packed(x, cu_seqlens, mesh.size(), layout, dim)[coords[0]]
    if mesh.ndim == 1:
        return split_sequence(x, mesh.size(), layout, dim)[coords[0]]
    return hybrid_shard(x, coords[0], mesh.size(0), coords[1], mesh.size(1), layout, dim)


def context_parallel_attn_func(q, k, v, mesh, softmax_scale=None, causal=False, layout="contiguous", mode="auto",
                               window_size=(-1, -1), softcap=0.0, learnable_sink=None):
    """Exact attention over a sequence sharded across a context-parallel DeviceMesh
    (context_parallel_shard cuts the shards). q (batch, seqlen_local, nheads, headdim), k and v
    (batch, seqlen_local, nheads_k, headdim); returns this rank's shard of the output.

    mode: "ring", "ulysses" (all-to-all) or, on a 2-D mesh, "hybrid"; "auto" takes the hybrid on a
    2-D mesh and on a 1-D mesh auto_mode's choice. window_size, softcap: as flash_attn_func, over
    the global positions, in every mode. learnable_sink: as flash_attn_func's, in every mode; its
    gradient is this rank's share (sum it across the ranks, as every parameter's)."""
    _check_mode(mode)
    groups = _groups(mesh)
    if mesh.ndim == 2:
        if mode not in ("auto", "hybrid"):
            fail(ErrorCode.INVALID_ARGUMENT, f"mode={mode!r} on a 2-D mesh: a 2-D mesh runs the hybrid")
        return hybrid_flash_attn_func(q, k, v, groups[0], groups[1], softmax_scale=softmax_scale, causal=causal,
                                      layout=layout, softcap=softcap, window_size=window_size,
                                      learnable_sink=learnable_sink)
    mode = _one_dim_mode(mode, mesh.size(), q.shape[2], k.shape[2], q.shape[1] * mesh.size(), None)
    if mode == "ulysses":
        return ulysses_flash_attn_func(q, k, v, group=groups[0], softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap, layout=layout,
                                       learnable_sink=learnable_sink)
    return ring_flash_attn_func(q, k, v, group=groups[0], softmax_scale=softmax_scale, causal=causal, layout=layout,
                                softcap=softcap, window_size=window_size, learnable_sink=learnable_sink)


def _same_documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether the keys' packed documents are the queries' (self-attention)."""
    if max_seqlen_k != max_seqlen_q:
        return False
    if cu_seqlens_k is cu_seqlens_q:
        return True
    return (isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
            and cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.device == cu_seqlens_k.device
            and torch.equal(cu_seqlens_q, cu_seqlens_k))


def context_parallel_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mesh,
                                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                      mode="auto", layout="contiguous", learnable_sink=None):
    """context_parallel_attn_func for a packed batch of documents (flash_attn_varlen_func's layout)
    on a 1-D mesh: q (total_q / W, nheads, headdim) is this rank's shard of the packed queries, k and
    v (total_k / W, nheads_k, headdim) of the keys and values, cut by context_parallel_shard(x, mesh,
    layout, dim=0, cu_seqlens=cu_seqlens_q): layout "contiguous" (pad the packed batch to a multiple of
    W) or "zigzag" (each document cut into 2W chunks, which balances the ring's causal work; its length
    a multiple of 2W); cu_seqlens_q / cu_seqlens_k and max_seqlen_q / max_seqlen_k describe the whole
    batch, the same on every rank. The all-to-all (ulysses_flash_attn_varlen_func) takes every option
    in the contiguous layout; the ring (ring_flash_attn_varlen_func) self-attention in both layouts, a
    sliding window in the contiguous one. A mode raises UNSUPPORTED_FEATURE naming what it cannot run
    ("auto" takes the other). learnable_sink as context_parallel_attn_func, in every mode and layout.
    Returns this rank's shard of the output, (total_q / W, nheads, headdim)."""
    _check_mode(mode)
    require_process_group("context_parallel_attn_varlen_func", layout)
    if mesh.ndim != 1:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"packed documents (cu_seqlens_q) run on a 1-D mesh, got {mesh.ndim} "
             "dims: the hybrid has no varlen path (take the cp dim of a larger mesh: mesh['cp'])")
    group = _groups(mesh)[0]
    ring_lacks = None
    if not _same_documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        ring_lacks = "cu_seqlens_k, max_seqlen_k other than cu_seqlens_q, max_seqlen_q (cross-attention)"
    elif layout == "zigzag" and window_bounds(window_size, causal) is not None:
        ring_lacks = f"window_size={window_size!r} with layout='zigzag'"
    a2a_lacks = "layout='zigzag' (packed documents cut into chunks)" if layout == "zigzag" else None
    mode = _one_dim_mode(mode, mesh.size(), q.shape[1], k.shape[1], q.shape[0] * mesh.size(), ring_lacks, a2a_lacks)
    if mode == "ulysses":
        return ulysses_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              group=group, softmax_scale=softmax_scale, causal=causal,
                                              window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
    return ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, group=group, softmax_scale=softmax_scale,
                                       causal=causal, softcap=softcap, layout=layout, window_size=window_size,
                                       learnable_sink=learnable_sink)
