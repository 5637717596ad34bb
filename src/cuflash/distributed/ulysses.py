"""All-to-all (DeepSpeed-Ulysses style) attention: each rank holds a shard of the sequence with every
head; one all-to-all trades it for the whole sequence of nheads / W heads (W ranks), each rank runs
cuflash on its heads with any option the single-GPU call has (causal, windows, softcap, ALiBi, GQA),
and a second all-to-all returns the output to the sequence shards. The backward runs the same two
exchanges in reverse. Per rank it moves q, k, v and out once each way, whatever the sequence length;
the ring (ring.py) instead moves K/V W - 1 times, but needs no head count divisible by W. The hybrid
runs the all-to-all inside a node and the ring across nodes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend import backend_name
from ..errors import ErrorCode, fail
from ..interface import flash_attn_func, flash_attn_varlen_func
from ..validate import check_attention_inputs, check_learnable_sink
from .ring import ring_flash_attn_func
from .shards import check_shards, join_sequence, require_process_group, split_sequence


def _seq_to_heads(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """(B, seqlen_local, H, D) shards of the sequence -> (B, seqlen, H / W, D): this rank's heads."""
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=2)]
    received = [torch.empty_like(p) for p in parts]
    dist.all_to_all(received, parts, group=group)  # received[j]: rank j's shard of this rank's heads
    return join_sequence(received, layout)


def _heads_to_seq(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """_seq_to_heads's inverse: (B, seqlen, H / W, D) -> (B, seqlen_local, H, D)."""
    parts = [p.contiguous() for p in split_sequence(x, dist.get_world_size(group), layout)]
    received = [torch.empty_like(p) for p in parts]
    dist.all_to_all(received, parts, group=group)  # received[j]: this rank's shard of rank j's heads
    return torch.cat(received, dim=2)


class _Exchange(torch.autograd.Function):
    """An all-to-all whose gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, layout, to_heads: bool):
        ctx.args = (group, layout, to_heads)
        return _seq_to_heads(x, group, layout) if to_heads else _heads_to_seq(x, group, layout)

    @staticmethod
    def backward(ctx, grad):
        group, layout, to_heads = ctx.args
        return (_heads_to_seq(grad, group, layout) if to_heads else _seq_to_heads(grad, group, layout)), None, None, \
            None


def _check_heads(q: torch.Tensor, k: torch.Tensor, group) -> None:
    world = dist.get_world_size(group)
    for name, heads in (("nheads", q.shape[2]), ("nheads_k", k.shape[2])):
        if heads % world:
            fail(ErrorCode.SHAPE_MISMATCH, f"all-to-all attention gives each of the {world} ranks {name} / {world} "
                 f"heads: {name} = {heads} is not a multiple of {world} (ring_flash_attn_func takes any count)")


def ulysses_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, layout="contiguous", learnable_sink=None):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world),
    by exchanging heads for sequence (all-to-all).

    Args:
        q: (batch, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, nheads_k, headdim), the same positions' keys and values.
            nheads and nheads_k must be multiples of the group's size W (each rank attends with
            nheads / W query heads and their nheads_k / W KV heads).
        softmax_scale, causal, window_size, softcap: as flash_attn_func, over the global positions.
        alibi_slopes: (nheads,) or (batch, nheads) fp32, the same on every rank.
        layout: how the sequence was cut: "contiguous" or "zigzag" (see shards.py).
        learnable_sink: as flash_attn_func's, (nheads,), the same on every rank; its gradient here is
            that of this rank's heads (0 for the others; sum it across the ranks, as every parameter's).
    Returns:
        this rank's shard of the output, (batch, seqlen_local, nheads, headdim).
    """
    require_process_group("ulysses_flash_attn_func", layout)
    if alibi_slopes is not None:  # this rank's heads
        alibi_slopes = alibi_slopes.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)]
    sink = _rank_heads(learnable_sink, q, group)
    return _exchanged(q, k, v, group, layout, lambda a, b, c: flash_attn_func(
        a, b, c, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, learnable_sink=sink))


def ulysses_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, group=None,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, learnable_sink=None):
    """ulysses_flash_attn_func for a packed batch of documents (flash_attn_varlen_func's layout): q
    (total_q / W, nheads, headdim) is this rank's contiguous share of the packed queries, k and v
    (total_k / W, nheads_k, headdim) of the keys and values (pad the packed batch to a multiple of W);
    cu_seqlens_q / cu_seqlens_k, max_seqlen_q / max_seqlen_k describe the whole batch, the same on
    every rank; learnable_sink as ulysses_flash_attn_func. Returns this rank's share of the output,
    (total_q / W, nheads, headdim)."""
    require_process_group("ulysses_flash_attn_varlen_func", "contiguous")
    world = dist.get_world_size(group)
    for name, t, cu in (("q", q, cu_seqlens_q), ("k", k, cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            fail(ErrorCode.INVALID_DIMENSION, f"{name} must be (total / world_size, nheads, headdim), got "
                 f"{getattr(t, 'shape', t)!r}")
        if isinstance(cu, torch.Tensor) and t.shape[0] * world != int(cu[-1]):
            fail(ErrorCode.SHAPE_MISMATCH, f"{name} holds {t.shape[0]} tokens on each of {world} ranks, but the "
                 f"packed batch has {int(cu[-1])}: pad it to a multiple of {world}")
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.chunk(world, dim=-1)[dist.get_rank(group)]
    sink = _rank_heads(learnable_sink, q[None], group)
    out = _exchanged(q[None], k[None], v[None], group, "contiguous", lambda a, b, c: flash_attn_varlen_func(
        a[0], b[0], c[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        learnable_sink=sink)[None], same_positions=False)
    return out[0]


def _rank_heads(learnable_sink, q: torch.Tensor, group):
    """This rank's share of a learnable sink (nheads,) of q (B, N, nheads, D): the heads the
    all-to-all gives it (None without a sink); checked first."""
    if learnable_sink is None:
        return None
    if isinstance(q, torch.Tensor) and q.dim() == 4:  # (q's own checks come later)
        check_learnable_sink(learnable_sink, q.shape[2], q.device)
    return learnable_sink.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def _exchanged(q, k, v, group, layout: str, attend, same_positions: bool = True):
    """attend(q, k, v) on the whole sequence of this rank's heads, between the two all-to-alls."""
    check_attention_inputs(q, k, v, value_dim=False)
    backend_name(q.device, q.dtype)
    check_shards(q, k, group, layout, same_positions)
    _check_heads(q, k, group)
    q, k, v = (_Exchange.apply(t, group, layout, True) for t in (q, k, v))
    return _Exchange.apply(attend(q, k, v), group, layout, False)

def hybrid_flash_attn_func(q, k, v, ring_group, a2a_group, softmax_scale=None, causal=False, layout="contiguous",
                           softcap=0.0, window_size=(-1, -1), learnable_sink=None):
    """All-to-all inside `a2a_group` (the GPUs of a node), ring across `ring_group` (the nodes): each
    rank holds shard a2a_rank of its ring shard (hybrid_shard), one all-to-all gives it the ring shard
    of nheads / A heads (A = a2a_group's size), ring attention runs over ring_group on those, and the
    output goes back the same way. layout: the ring's ("contiguous" or "zigzag"; see shards.py);
    softcap, window_size as flash_attn_func (over the global positions), learnable_sink as
    ulysses_flash_attn_func. nheads and nheads_k must be multiples of A. Returns this rank's shard of
    the output."""
    require_process_group("hybrid_flash_attn_func", layout)
    sink = _rank_heads(learnable_sink, q, a2a_group)
    return _exchanged(q, k, v, a2a_group, "contiguous", lambda a, b, c: ring_flash_attn_func(
        a, b, c, group=ring_group, softmax_scale=softmax_scale, causal=causal, layout=layout, softcap=softcap,
        window_size=window_size, learnable_sink=sink))


def hybrid_shard(x: torch.Tensor, ring_rank: int, ring_size: int, a2a_rank: int, a2a_size: int,
                 layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The shard of the whole sequence x that hybrid_flash_attn_func expects on the rank at
    (ring_rank, a2a_rank): chunk a2a_rank of a2a_size of ring shard ring_rank (in `layout`)."""
    return split_sequence(x, ring_size, layout, dim)[ring_rank].chunk(a2a_size, dim=dim)[a2a_rank]
