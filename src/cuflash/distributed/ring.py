"""Ring attention: each rank holds a shard of the sequence (a layout of shards.py); every rank's K/V
shard reaches every other rank (torch.distributed batch_isend_irecv, the transfers started before the
steps that use them), partial outputs merge exactly through their log-sum-exps, and the backward
sends the dK/dV accumulators around the ring, one hop per step. A learnable sink is counted once, as
the partial every row starts from (out 0, lse sink), and its gradient is this rank's rows' share."""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from .. import ops
from ..backend import backend_name
from ..dtypes import lse_dtype
from ..params import AttentionParams
from ..sinks import empty_lse, sink_grad
from ..validate import check_attention_inputs, check_cu_seqlens, check_learnable_sink, check_softcap, check_tensor, \
    resolve_scale
from .shards import check_shards, require_process_group

# The most bytes of other ranks' K/V shards a rank gathers before its first step (_Ring.shards), and
# at most an eighth of its GPU's memory (so that a smaller GPU keeps the rest for the steps); past it,
# each shard travels a step ahead of its use.
KV_PREFETCH_BYTES = 8 << 30


def prefetch_budget(device: torch.device) -> int:
    """The most bytes of other ranks' K/V shards a rank on `device` gathers before its first step."""
    if device.type == "cuda":
        return min(KV_PREFETCH_BYTES, torch.cuda.get_device_properties(device).total_memory // 8)
    return KV_PREFETCH_BYTES


class _Ring:
    """Sends lists of tensors `hops` ranks ahead and receives those of the rank as far behind,
    asynchronously; several exchanges may be in flight (every rank starts them in the same order,
    which is how the sends and receives pair up)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank % self.size) if self.group is not None else rank % self.size

    def start(self, tensors, hops: int = 1) -> tuple[list[torch.Tensor], list]:
        """Starts one exchange; returns (the tensors being received, the requests to wait for). A
        whole turn of the ring (hops a multiple of the size) keeps the tensors where they are."""
        if hops % self.size == 0:
            return list(tensors), []
        to, source = self._global(self.rank + hops), self._global(self.rank - hops)
        received = [torch.empty_like(t) for t in tensors]
        ops_ = [dist.P2POp(dist.isend, t, to, self.group) for t in tensors]
        ops_ += [dist.P2POp(dist.irecv, r, source, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops_)

    @staticmethod
    def wait(exchange) -> list[torch.Tensor]:
        """The received tensors of an exchange, once it is complete (its sends too)."""
        received, requests = exchange
        for req in requests:
            req.wait()
        return received

    def shards(self, kv: list[torch.Tensor], steps: int) -> Iterator[list[torch.Tensor]]:
        """The K/V shard of each of `steps` steps: this rank's own, then at step s rank (rank - s)'s,
        sent straight from its owner. Where the other shards fit in prefetch_budget, all of them
        arrive before the first step computes: NCCL's copy kernels running beside the attention kernels
        slow them far more than the transfers take alone (docs/tuning.md). Otherwise each shard is sent
        a step ahead of its use, its transfer beside the step before."""
        if (steps - 1) * sum(t.numel() * t.element_size() for t in kv) <= prefetch_budget(kv[0].device):
            exchanges = [self.start(kv, hops) for hops in range(1, steps)]
            received = [self.wait(exchange) for exchange in exchanges]
            yield kv
            yield from received
            return
        incoming = self.start(kv, 1)
        yield kv
        for step in range(1, steps):
            arrived = self.wait(incoming)
            if step + 1 < steps:
                incoming = self.start(kv, step + 1)
            yield arrived


# A block of one ring step: this rank's query rows, the rows of the K/V shard it holds, and the
# call (AttentionParams) attending from those to these.
Block = tuple[slice, slice, AttentionParams]


def _dense_blocks(rank: int, src: int, seqlen: int, causal: bool, layout: str, scale: float,
                  softcap: float) -> list[Block]:
    """What rank's queries attend to in src's K/V shard of a (batch, seqlen_local) sharding."""
    everything = slice(0, seqlen)
    # Causal blocks are the square diagonal blocks: top-left aligned, row i sees keys j <= i.
    full = AttentionParams(scale, softcap=softcap)
    diagonal = AttentionParams(scale, window_right=0, bottom_right=False, softcap=softcap)
    if not causal:
        return [(everything, everything, full)]
    if src == rank:
        return [(everything, everything, diagonal)]  # zigzag: both halves keep their order, so one causal mask
    if layout == "contiguous":
        return [(everything, everything, full)] if src < rank else []
    half = seqlen // 2
    if src < rank:
        return [(everything, slice(0, half), full)]  # all of q after src's first chunk, before its second
    return [(slice(half, seqlen), everything, full)]  # only q's second chunk comes after both of src's


def _packed_span(bounds: list[int], rank: int, src: int, share: int, causal: bool):
    """What rank's queries attend to in src's K/V shard of a packed batch of documents (prefix sums
    `bounds`) cut into contiguous shares of `share` tokens, or None for nothing: one varlen call over
    the documents that meet rank's share, each document's queries in the share against its keys in
    src's share (none: a zero-length part; causal: every key when src's share comes first, the
    diagonal's causal mask when it is rank's own share, nothing after). Returns the call's query and
    key prefix sums and its first key's position in src's share."""
    if causal and src > rank:
        return None
    q_lo, q_hi, k_lo, k_hi = rank * share, (rank + 1) * share, src * share, (src + 1) * share
    docs = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < q_hi and b > q_lo]
    cu_q = [max(a, q_lo) - q_lo for a, _ in docs] + [share]
    cu_k = [min(max(a, k_lo), k_hi) for a, _ in docs] + [min(max(docs[-1][1], k_lo), k_hi)]
    first = cu_k[0]
    cu_k = [c - first for c in cu_k]
    return None if cu_k[-1] == 0 else (cu_q, cu_k, first - k_lo)  # None: no key of src's share in them


def packed_steps(bounds: list[int], rank: int, size: int, share: int, causal: bool, scale: float,
                  device: torch.device, softcap: float = 0.0) -> list[list[Block]]:
    """rank's blocks at each step of the ring over a packed batch, up to the last step at which any
    rank has a block: documents shorter than a share meet few shards, and later steps would only
    move K/V and dK/dV around."""
    spans = [[_packed_span(bounds, r, (r - s) % size, share, causal) for s in range(size)] for r in range(size)]
    steps = 1 + max(s for r in range(size) for s in range(size) if spans[r][s] is not None)
    blocks: list[list[Block]] = []
    for s, span in enumerate(spans[rank][:steps]):
        if span is None:
            blocks.append([])
            continue
        cu_q, cu_k, start = span
        params = AttentionParams(
            scale, window_right=0 if causal and s == 0 else -1, softcap=softcap,
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])))
        blocks.append([(slice(0, share), slice(start, start + cu_k[-1]), params)])
    return blocks


def _merge_into(out, lse, block_out, block_lse) -> None:
    """Merges a block's partial attention into (out, lse) in place, exactly, by their log-sum-exps
    (lse +inf marks a row with no key yet). In place, out is read and written once more per merge
    instead of through four temporaries of its size."""
    a = torch.where(torch.isposinf(lse), float("-inf"), lse)
    b = torch.where(torch.isposinf(block_lse), float("-inf"), block_lse)
    new = torch.logaddexp(a, b)
    safe = torch.where(torch.isneginf(new), 0.0, new)
    out.mul_(torch.exp(a - safe).transpose(1, 2).unsqueeze(-1))  # (B, N, H, 1) weights
    out.addcmul_(block_out, torch.exp(b - safe).transpose(1, 2).unsqueeze(-1))
    lse.copy_(torch.where(torch.isneginf(new), float("inf"), new))


def _unbatched(packed: bool, *tensors):
    """A packed batch travels as one sequence of a batch of one; the varlen calls take it without."""
    return tuple(t[0] for t in tensors) if packed else tensors


def _batched(packed: bool, *tensors):
    return tuple(t[None] for t in tensors) if packed else tensors


def _ring_forward(q, k, v, sink, steps: list[list[Block]], packed: bool, group):
    """steps[s]: the blocks of step s, whose K/V shard is that of rank (rank - s); the same number of
    steps on every rank. sink: the learnable sink (H,) or None."""
    ring = _Ring(group)
    batch, seqlen, nheads, _ = q.shape
    acc_dtype = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    if sink is None:
        lse = torch.full((batch, nheads, seqlen), float("inf"), dtype=acc_dtype, device=q.device)
    else:  # every row starts from the sink's partial: out 0, lse sink (sinks.py)
        lse = empty_lse(sink, (batch, nheads, seqlen), acc_dtype)
    merged = sink is not None
    for blocks, kv in zip(steps, ring.shards([k, v], len(steps))):
        for qs, ks, params in blocks:
            q_b, k_b, v_b = _unbatched(packed, q[:, qs], kv[0][:, ks], kv[1][:, ks])
            o, o_lse = _batched(packed, *ops.forward(q_b, k_b, v_b, params))
            if merged:
                _merge_into(out[:, qs], lse[..., qs], o, o_lse)
            else:  # the first block: its rows hold nothing yet, so they take its result as it is
                out[:, qs], lse[..., qs] = o, o_lse
                merged = True
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, steps: list[list[Block]], packed: bool, group):
    """At step s a rank holds the K/V shard of rank (rank - s) (_Ring.shards) and computes its
    gradients' share into fresh buffers while the dK/dV accumulated for this shard by the ranks before
    it arrive (sent by the previous rank at the end of its step s - 1). The sum leaves for
    the next rank at the end of the step; after the last step it goes home (the next rank after a
    whole turn, else len(steps) - 1 ranks back)."""
    ring = _Ring(group)
    acc_dtype = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    grads_in = None
    for step, (blocks, kv) in enumerate(zip(steps, ring.shards([k, v], len(steps)))):
        last = step + 1 == len(steps)
        dk, dv = (torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv)
        for qs, ks, params in blocks:
            d_o, q_b, k_b, v_b, o_b, lse_b = _unbatched(packed, dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks],
                                                        out[:, qs], lse[..., qs])
            g_q, g_k, g_v = _batched(packed, *ops.backward(d_o, q_b, k_b, v_b, o_b, lse_b, params))
            dq[:, qs] += g_q
            dk[:, ks] += g_k
            dv[:, ks] += g_v
        if grads_in is not None:  # what the ranks before this one accumulated for the shard
            before_k, before_v = ring.wait(grads_in)
            dk += before_k
            dv += before_v
        grads_in = ring.start([dk, dv], 1 - len(steps) if last else 1)
    dk, dv = ring.wait(grads_in)  # this rank's own shard, from the rank that held it last
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttn(torch.autograd.Function):
    """q, k, v (batch, seqlen_local, heads, headdim); a packed batch as a batch of one."""

    @staticmethod
    def forward(ctx, q, k, v, sink, steps, packed, group):
        # K and V travel between ranks, which takes contiguous tensors: gloo refuses others, and NCCL
        # would send the memory a strided view spans.
        k, v = k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, sink, steps, packed, group)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (steps, packed, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        dsink = None
        if sink is not None:  # this rank's rows' share; delta = rowsum(dO * O), as (B, H, N)
            delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)
            dsink = sink_grad(sink, lse, delta)
        return dq, dk, dv, dsink, None, None, None


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, layout="contiguous", softcap=0.0,
                         learnable_sink=None):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    Args:
        q: (batch, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, nheads_k, headdim), this rank's shard of keys and values
            (the same positions as q); nheads a multiple of nheads_k.
        softmax_scale: default 1/sqrt(headdim).
        causal: causal mask over the global positions.
        layout: how the sequence was cut: "contiguous" (rank r holds chunk r) or "zigzag"
            (see zigzag_shard; balances the causal work).
        softcap: as flash_attn_func (0: off).
        learnable_sink: as flash_attn_func's, the same on every rank; its gradient here is this rank's
            rows' share (sum it across the ranks, as every parameter's).
    Returns:
        this rank's shard of the output, (batch, seqlen_local, nheads, headdim).
    """
    require_process_group("ring_flash_attn_func", layout)
    check_attention_inputs(q, k, v, value_dim=False)
    backend_name(q.device, q.dtype)
    check_shards(q, k, group, layout)
    scale, softcap = resolve_scale(softmax_scale, q.shape[-1]), check_softcap(softcap)
    sink = check_learnable_sink(learnable_sink, q.shape[2], q.device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    steps = [_dense_blocks(rank, (rank - s) % size, q.shape[1], bool(causal), layout, scale, softcap)
             for s in range(size)]
    return _RingFlashAttn.apply(q, k, v, sink, steps, False, group)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=None, softmax_scale=None, causal=False,
                                softcap=0.0, learnable_sink=None):
    """ring_flash_attn_func for a packed batch of documents (flash_attn_varlen_func's layout, self-
    attention): q (total / W, nheads, headdim) is this rank's contiguous share of the packed tokens,
    k and v (total / W, nheads_k, headdim) of the same tokens' keys and values (pad the packed batch
    to a multiple of W; documents may cross the shares' edges). cu_seqlens ((batch + 1,) int32) and
    max_seqlen describe the whole batch, the same on every rank; causal masks within each document;
    softcap and learnable_sink as ring_flash_attn_func. Returns this rank's share of the output, (total / W,
    nheads, headdim)."""
    require_process_group("ring_flash_attn_varlen_func", "contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, "(total / world_size, heads, headdim)")
    check_attention_inputs(q[None], k[None], v[None], value_dim=False)
    backend_name(q.device, q.dtype)
    check_shards(q[None], k[None], group, "contiguous")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    share = q.shape[0]
    check_cu_seqlens("cu_seqlens", cu_seqlens, "max_seqlen", max_seqlen, share * size,
                     f"the packed batch ({share} tokens on each of {size} ranks: pad it to a multiple of {size})",
                     q.device)
    scale, softcap = resolve_scale(softmax_scale, q.shape[-1]), check_softcap(softcap)
    sink = check_learnable_sink(learnable_sink, q.shape[1], q.device)
    steps = packed_steps(cu_seqlens.tolist(), rank, size, share, bool(causal), scale, q.device, softcap)
    return _RingFlashAttn.apply(q[None], k[None], v[None], sink, steps, True, group)[0]
