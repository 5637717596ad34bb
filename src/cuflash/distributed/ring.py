"""Ring attention: each rank holds a shard of the sequence (a layout of shards.py); K/V shards
travel around the ring (torch.distributed batch_isend_irecv, the next transfer in flight while the
current block computes), partial outputs merge exactly through their log-sum-exps, and the
backward sends the dK/dV accumulators around the ring with their K/V."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..errors import check_attention_inputs, lse_dtype, resolve_scale
from ..params import AttentionParams
from .shards import check_shards, require_process_group

class _Ring:
    """Sends lists of tensors to the next rank and receives the previous rank's, asynchronously;
    several exchanges may be in flight (every rank starts them in the same order, which is how the
    sends and receives pair up)."""

    def __init__(self, group):
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size

    def start(self, tensors) -> tuple[list[torch.Tensor], list]:
        """Starts one exchange; returns (the tensors being received, the requests to wait for)."""
        received = [torch.empty_like(t) for t in tensors]
        ops_ = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops_ += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops_)

    @staticmethod
    def wait(exchange) -> list[torch.Tensor]:
        """The received tensors of an exchange, once it is complete (its sends too)."""
        received, requests = exchange
        for req in requests:
            req.wait()
        return received


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
        incoming = ring.start(kv) if step + 1 < size else None
        src = (rank - step) % size
        for qs, ks, blk_causal in _blocks(rank, src, seqlen, causal, layout):
            o, o_lse = ops.forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], _block_params(scale, blk_causal))
            out[:, qs], lse[..., qs] = _merge(out[:, qs], lse[..., qs], o, o_lse)
        if incoming is not None:
            kv = ring.wait(incoming)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, causal, layout, group):
    """At step s a rank holds the K/V shard of rank (rank - s) and computes its gradients' share into
    fresh buffers while two exchanges run: the next K/V shard, and the dK/dV accumulated for this shard
    by the ranks before it (sent by the previous rank at the end of its step s - 1). The sum leaves for
    the next rank at the end of the step; after the last step it arrives home."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ring = _Ring(group)
    acc_dtype = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv, grads_in = [k, v], None
    for step in range(size):
        src = (rank - step) % size
        kv_in = ring.start(kv) if step + 1 < size else None
        dk, dv = (torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv)
        for qs, ks, blk_causal in _blocks(rank, src, q.shape[1], causal, layout):
            g_q, g_k, g_v = ops.backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                         lse[..., qs], _block_params(scale, blk_causal))
            dq[:, qs] += g_q
            dk[:, ks] += g_k
            dv[:, ks] += g_v
        if grads_in is not None:  # what the ranks before this one accumulated for the shard
            before_k, before_v = ring.wait(grads_in)
            dk += before_k
            dv += before_v
        grads_in = ring.start([dk, dv])
        if kv_in is not None:
            kv = ring.wait(kv_in)
    dk, dv = ring.wait(grads_in)  # this rank's own shard, from the previous rank after the last step
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
    require_process_group("ring_flash_attn_func", layout)
    check_attention_inputs(q, k, v)
    ops.backend_name(q.device, q.dtype)
    check_shards(q, k, group, layout)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    return _RingFlashAttn.apply(q, k, v, scale, bool(causal), layout, group)
