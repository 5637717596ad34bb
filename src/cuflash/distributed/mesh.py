"""Context parallelism over a DeviceMesh, the way torch's distributed training describes its ranks
(a context-parallel mesh, or the "cp" dimension of a larger one beside FSDP2's data-parallel one):
a 1-D mesh runs the all-to-all or the ring over its ranks, a 2-D mesh the hybrid (ring over dim 0,
all-to-all within dim 1, e.g. nodes x GPUs of a node)."""
from __future__ import annotations

import torch

from ..errors import ErrorCode, fail
from .ring import ring_flash_attn_func
from .shards import split_sequence
from .ulysses import hybrid_flash_attn_func, hybrid_shard, ulysses_flash_attn_func

MODES = ("auto", "ring", "ulysses", "hybrid")
# The longest whole sequence the all-to-all takes in auto mode. It runs one call over the whole
# sequence of a rank's heads, and on an H100 such calls slow down from 256k keys (the causal
# backward at 32 heads: ~550 TFLOP/s at 128k, ~420 at 256k; docs/tuning.md), while the ring's calls
# stay shard-sized. On 2 H100s (benchmarks/results/h100x2) the all-to-all led up to 128k tokens (97%
# of one GPU forward+backward against the ring's 92%), the ring from 256k (94% against 74%); on 4
# (h100x4) the all-to-all at 128k (91% against 90%; forward 95% against 91%), the ring from 256k (93%
# against 84%).
ULYSSES_MAX_TOKENS = 131072


def auto_mode(nheads: int, nheads_k: int, seqlen: int, size: int) -> str:
    """The 1-D mode for a whole sequence of seqlen tokens on `size` ranks: the all-to-all where both
    head counts divide among the ranks and the sequence is at most ULYSSES_MAX_TOKENS, else the ring."""
    if nheads % size == 0 and nheads_k % size == 0 and seqlen <= ULYSSES_MAX_TOKENS:
        return "ulysses"
    return "ring"


def _groups(mesh):
    if mesh.ndim not in (1, 2):
        fail(ErrorCode.INVALID_ARGUMENT, f"a context-parallel mesh has 1 or 2 dims, got {mesh.ndim} "
             "(take the cp dims of a larger mesh: mesh['cp'])")
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def context_parallel_shard(x: torch.Tensor, mesh, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's shard of the whole sequence x (along dim) for context_parallel_attn_func on `mesh`."""
    coords = mesh.get_coordinate()
    if mesh.ndim == 1:
        return split_sequence(x, mesh.size(), layout, dim)[coords[0]]
    return hybrid_shard(x, coords[0], mesh.size(0), coords[1], mesh.size(1), layout, dim)


def context_parallel_attn_func(q, k, v, mesh, softmax_scale=None, causal=False, layout="contiguous", mode="auto"):
    """Exact attention over a sequence sharded across a context-parallel DeviceMesh
    (context_parallel_shard cuts the shards). q (batch, seqlen_local, nheads, headdim), k and v
    (batch, seqlen_local, nheads_k, headdim); returns this rank's shard of the output.

    mode: "ring", "ulysses" (all-to-all) or, on a 2-D mesh, "hybrid"; "auto" takes the hybrid on a
    2-D mesh and on a 1-D mesh auto_mode's choice."""
    if mode not in MODES:
        fail(ErrorCode.INVALID_ARGUMENT, f"mode={mode!r}; accepted: {', '.join(MODES)}")
    groups = _groups(mesh)
    if mesh.ndim == 2:
        if mode not in ("auto", "hybrid"):
            fail(ErrorCode.INVALID_ARGUMENT, f"mode={mode!r} on a 2-D mesh: a 2-D mesh runs the hybrid")
        return hybrid_flash_attn_func(q, k, v, groups[0], groups[1], softmax_scale=softmax_scale, causal=causal,
                                      layout=layout)
    if mode == "hybrid":
        fail(ErrorCode.INVALID_ARGUMENT, "mode='hybrid' needs a 2-D mesh (ring dim, all-to-all dim)")
    if mode == "auto":
        mode = auto_mode(q.shape[2], k.shape[2], q.shape[1] * mesh.size(), mesh.size())
    fn = ulysses_flash_attn_func if mode == "ulysses" else ring_flash_attn_func
    return fn(q, k, v, group=groups[0], softmax_scale=softmax_scale, causal=causal, layout=layout)
