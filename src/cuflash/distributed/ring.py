"""Ring attention: each rank holds a shard of the sequence; K/V shards travel around the ring
(torch.distributed batch_isend_irecv, the next transfer in flight while the current block
computes), partial outputs merge exactly through their log-sum-exps, and the backward sends the
dK/dV accumulators around the ring with their K/V.

Layouts of the shards along the sequence (world size W, sequence cut into chunks):
- "contiguous": rank r holds chunk r of W.
- "zigzag": the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r, so that
  under a causal mask every rank does the same work (zigzag_shard / zigzag_unshard).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..errors import ErrorCode, check_attention_inputs, fail, lse_dtype, resolve_scale
from ..params import AttentionParams

LAYOUTS = ("contiguous", "zigzag")


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of the full tensor x: chunks rank and 2*world_size-1-rank of
    x cut into 2*world_size equal chunks along dim (the sequence dim, 1 in flash-attn's layout)."""
    if x.shape[dim] % (2 * world_size) != 0:
        fail(ErrorCode.SHAPE_MISMATCH, f"zigzag needs the sequence length ({x.shape[dim]} in dim {dim}) to be a "
             f"multiple of 2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of zigzag_shard: gathers every rank's shard and returns the full tensor (on every rank)."""
    world_size = dist.get_world_size(group)
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


class _Ring:
    """Sends a list of tensors to the next rank and receives the previous rank's, asynchronously."""

    def __init__(self, group):
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
        self.pending = []

    def start(self, tensors):
        received = [torch.empty_like(t) for t in tensors]
        ops_ = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops_ += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        self.pending = dist.batch_isend_irecv(ops_)
        return received

    def wait(self):
        for req in self.pending:
            req.wait()
        self.pending = []


def _blocks(rank: int, src: int, seqlen: int, causal: bool, layout: str):
    """What rank's queries attend to in src's K/V shard: a list of (q slice, kv slice, causal)."""
    everything = slice(0, seqlen)
    if not causal:
        return [(everything, everything, False)]
    if src == rank:
        return [(everything, everything, True)]  # zigzag: both halves keep their order, so one causal mask
    if layout == "contiguous":
        return [(everything, everything, False)] if src < rank else []
    half = seqlen // 2
    if src < rank:
        return [(everything, slice(0, half), False)]  # all of q after src's first chunk, before its second
    return [(slice(half, seqlen), everything, False)]  # only q's second chunk comes after both of src's


def _merge(out, lse, block_out, block_lse):
    """Exact merge of two partial attentions by their log-sum-exps (lse +inf marks 'no key yet')."""
    a = torch.where(torch.isposinf(lse), float("-inf"), lse)
    b = torch.where(torch.isposinf(block_lse), float("-inf"), block_lse)
    new = torch.logaddexp(a, b)
    safe = torch.where(torch.isneginf(new), 0.0, new)
    wa = torch.exp(a - safe).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1)
    wb = torch.exp(b - safe).transpose(1, 2).unsqueeze(-1)
    return out * wa + block_out.to(out.dtype) * wb, torch.where(torch.isneginf(new), float("inf"), new)


def _block_params(scale: float, causal: bool) -> AttentionParams:
    # Causal blocks are the square diagonal blocks: top-left aligned, row i sees keys j <= i.
    return AttentionParams(scale, window_right=0 if causal else -1, bottom_right=False)


def _ring_forward(q, k, v, scale, causal, layout, group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ring = _Ring(group)
    batch, seqlen, nheads, _ = q.shape
    acc_dtype = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full((batch, nheads, seqlen), float("inf"), dtype=lse_dtype(q.dtype), device=q.device)
    kv = [k, v]
    for step in range(size):
        if step + 1 < size:
            incoming = ring.start(kv)
        src = (rank - step) % size
        for qs, ks, blk_causal in _blocks(rank, src, seqlen, causal, layout):
            o, o_lse = ops.forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], _block_params(scale, blk_causal))
            out[:, qs], lse[..., qs] = _merge(out[:, qs], lse[..., qs], o, o_lse)
        if step + 1 < size:
            ring.wait()
            kv = incoming
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, causal, layout, group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ring = _Ring(group)
    acc_dtype = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    # K/V travel with the dK/dV accumulated for them so far (fp32, or fp64 for fp64 inputs).
    travel = [k, v, torch.zeros(k.shape, dtype=acc_dtype, device=k.device),
              torch.zeros(v.shape, dtype=acc_dtype, device=v.device)]
    for step in range(size):
        src = (rank - step) % size
        kk, vv, dk, dv = travel
        # The K/V shards can leave as soon as they arrive; the accumulators only after this step.
        incoming_kv = ring.start([kk, vv]) if step + 1 < size else None
        for qs, ks, blk_causal in _blocks(rank, src, q.shape[1], causal, layout):
            g_q, g_k, g_v = ops.backward(dout[:, qs], q[:, qs], kk[:, ks], vv[:, ks], out[:, qs],
                                         lse[..., qs], _block_params(scale, blk_causal))
            dq[:, qs] += g_q
            dk[:, ks] += g_k
            dv[:, ks] += g_v
        ring.wait()
        # dK/dV of src's shard move on with it; after the last step they go one more hop, home.
        incoming_grads = ring.start([dk, dv])
        ring.wait()
        if incoming_kv is not None:
            travel = incoming_kv + incoming_grads
        else:
            travel = [None, None] + incoming_grads
    return dq.to(q.dtype), travel[2].to(k.dtype), travel[3].to(v.dtype)


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, group):
        out, lse = _ring_forward(q, k, v, scale, causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, layout, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _check_shards(q, k, group, layout):
    """Every rank must hold shards of the same shape; all ranks see the same gathered shapes and
    so raise together, instead of one rank raising and the others hanging in the ring."""
    size = dist.get_world_size(group)
    mine = torch.tensor(list(q.shape) + list(k.shape), dtype=torch.int64,
                        device=q.device if dist.get_backend(group) == "nccl" else "cpu")
    shapes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(shapes, mine, group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    if len(set(shapes)) != 1:
        listing = ", ".join(f"rank {r}: q {s[:4]}, k {s[4:]}" for r, s in enumerate(shapes))
        fail(ErrorCode.SHAPE_MISMATCH, f"ring attention needs shards of the same shape on every rank; got {listing}")
    if q.shape[1] != k.shape[1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"q and k shards must cover the same positions (seqlen {q.shape[1]} vs "
             f"{k.shape[1]})")
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        fail(ErrorCode.SHAPE_MISMATCH, f"a zigzag shard holds two equal chunks; its seqlen {q.shape[1]} is odd")


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, layout="contiguous"):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    Args:
        q: (batch, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, nheads_k, headdim), this rank's shard of keys and values
            (the same positions as q); nheads a multiple of nheads_k.
        softmax_scale: default 1/sqrt(headdim).
        causal: causal mask over the global positions.
        layout: how the sequence was cut: "contiguous" (rank r holds chunk r) or "zigzag"
            (see zigzag_shard; balances the causal work).
    Returns:
        this rank's shard of the output, (batch, seqlen_local, nheads, headdim).
    """
    if not dist.is_available() or not dist.is_initialized():
        fail(ErrorCode.INVALID_ARGUMENT, "ring_flash_attn_func needs an initialized torch.distributed process "
             "group (torch.distributed.init_process_group)")
    if layout not in LAYOUTS:
        fail(ErrorCode.INVALID_ARGUMENT, f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
    check_attention_inputs(q, k, v)
    ops.backend_name(q.device, q.dtype)
    _check_shards(q, k, group, layout)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    return _RingFlashAttn.apply(q, k, v, scale, bool(causal), layout, group)
