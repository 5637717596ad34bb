"""Context parallelism over a DeviceMesh, the way torch's distributed training describes its ranks
(a context-parallel mesh, or the "cp" dimension of a larger one beside FSDP2's data-parallel one):
a 1-D mesh runs the all-to-all or the ring over its ranks, a 2-D mesh the hybrid (ring over dim 0,
all-to-all within dim 1, e.g. nodes x GPUs of a node)."""
from __future__ import annotations

import torch

from ..errors import ErrorCode, fail
from ..validate import check_window
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func
from .shards import split_sequence
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
    length where the ring cannot run the call (ring_can False: a sliding window, packed
    cross-attention); else the ring."""
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


def _window_lacks(window_size, causal) -> str | None:
    """The ring's blocks have no sliding window: window_size named where it bounds more than the
    causal mask does, else None."""
    left, right = check_window(window_size)
    return f"window_size={window_size!r} (a sliding window)" if left >= 0 or (right >= 0 and not causal) else None


def _one_dim_mode(mode: str, size: int, nheads: int, nheads_k: int, seqlen: int, ring_lacks: str | None) -> str:
    """The mode a 1-D mesh of `size` ranks runs: mode, or auto_mode's choice. ring_lacks names what of
    the call the ring cannot do (None: nothing): the ring then fails naming it."""
    if mode == "hybrid":
        fail(ErrorCode.INVALID_ARGUMENT, "mode='hybrid' needs a 2-D mesh (ring dim, all-to-all dim)")
    if mode == "auto":
        mode = auto_mode(nheads, nheads_k, seqlen, size, ring_can=ring_lacks is None)
    if mode == "ring" and ring_lacks is not None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"{ring_lacks}: the ring cannot run it; the all-to-all (mode='ulysses') "
             f"can, where nheads ({nheads}) and nheads_k ({nheads_k}) are multiples of the mesh's {size} ranks")
    return mode


def context_parallel_shard(x: torch.Tensor, mesh, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's shard of the whole sequence x (along dim) for context_parallel_attn_func on `mesh`."""
    coords = mesh.get_coordinate()
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
    the global positions; a sliding window runs through the all-to-all only (the ring and the hybrid
    raise UNSUPPORTED_FEATURE naming it; "auto" takes the all-to-all for it at any length).
    learnable_sink: as flash_attn_func's, in every mode; its gradient is this rank's share (sum it
    across the ranks, as every parameter's)."""
    _check_mode(mode)
    groups = _groups(mesh)
    window = _window_lacks(window_size, causal)
    if mesh.ndim == 2:
        if mode not in ("auto", "hybrid"):
            fail(ErrorCode.INVALID_ARGUMENT, f"mode={mode!r} on a 2-D mesh: a 2-D mesh runs the hybrid")
        if window is not None:
            fail(ErrorCode.UNSUPPORTED_FEATURE, f"{window}: a 2-D mesh runs the hybrid, whose ring cannot run it; "
                 "the all-to-all over a 1-D mesh (mode='ulysses') can")
        return hybrid_flash_attn_func(q, k, v, groups[0], groups[1], softmax_scale=softmax_scale, causal=causal,
                                      layout=layout, softcap=softcap, learnable_sink=learnable_sink)
    mode = _one_dim_mode(mode, mesh.size(), q.shape[2], k.shape[2], q.shape[1] * mesh.size(), window)
    if mode == "ulysses":
        return ulysses_flash_attn_func(q, k, v, group=groups[0], softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap, layout=layout,
                                       learnable_sink=learnable_sink)
    return ring_flash_attn_func(q, k, v, group=groups[0], softmax_scale=softmax_scale, causal=causal, layout=layout,
                                softcap=softcap, learnable_sink=learnable_sink)


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
                                      mode="auto", learnable_sink=None):
    """context_parallel_attn_func for a packed batch of documents (flash_attn_varlen_func's layout)
    on a 1-D mesh: q (total_q / W, nheads, headdim) is this rank's contiguous share of the packed
    queries (context_parallel_shard(x, mesh, dim=0)), k and v (total_k / W, nheads_k, headdim) of the
    keys and values (pad the packed batch to a multiple of W); cu_seqlens_q / cu_seqlens_k and
    max_seqlen_q / max_seqlen_k describe the whole batch, the same on every rank. The all-to-all
    (ulysses_flash_attn_varlen_func) takes every option; the ring (ring_flash_attn_varlen_func)
    self-attention without a sliding window, and raises UNSUPPORTED_FEATURE naming what else it is
    given ("auto" takes the all-to-all for it at any length). learnable_sink as
    context_parallel_attn_func. Returns this rank's share of the output, (total_q / W, nheads, headdim)."""
    _check_mode(mode)
    if mesh.ndim != 1:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"packed documents (cu_seqlens_q) run on a 1-D mesh, got {mesh.ndim} "
             "dims: the hybrid has no varlen path (take the cp dim of a larger mesh: mesh['cp'])")
    group = _groups(mesh)[0]
    lacks = _window_lacks(window_size, causal)
    if lacks is None and not _same_documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        lacks = "cu_seqlens_k, max_seqlen_k other than cu_seqlens_q, max_seqlen_q (cross-attention)"
    mode = _one_dim_mode(mode, mesh.size(), q.shape[1], k.shape[1], q.shape[0] * mesh.size(), lacks)
    if mode == "ulysses":
        return ulysses_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              group=group, softmax_scale=softmax_scale, causal=causal,
                                              window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
    return ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, group=group, softmax_scale=softmax_scale,
                                       causal=causal, softcap=softcap, learnable_sink=learnable_sink)
