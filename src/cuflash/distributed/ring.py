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
from ..errors import ErrorCode, fail
from ..params import AttentionParams
from ..sinks import empty_lse, sink_grad
from ..validate import (check_attention_inputs, check_cu_seqlens, check_learnable_sink, check_softcap, check_tensor,
                        check_window, resolve_scale)
from .shards import check_packed_zigzag, check_shards, require_process_group

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


def window_bounds(window_size, causal: bool) -> tuple[int, int] | None:
    """(left, right) of a sliding window over the global positions, checked (causal makes right 0), or
    None where it bounds no more than causal does (the blocks then need no window)."""
    left, right = check_window(window_size)
    right = 0 if causal else right
    return None if left < 0 and (right < 0 or causal) else (left, right)


def _window_span(q_rows: tuple[int, int], q_at: int, k_rows: tuple[int, int], k_at: int, left: int,
                 right: int) -> tuple[int, int, int, int, int, int] | None:
    """The queries at local rows q_rows = (start, end) (global positions from q_at) against the keys at
    k_rows (from k_at) under the window (left, right) over the global positions (-1: unbounded): the
    rows and keys trimmed to those that see or are seen, (q start, q end, k start, k end, left, right)
    with the window shifted to their local positions, top-left aligned (trimmed, every bound is >= 0
    or none: -1 also where every pair meets it), or None where no query sees a key."""
    n, m = q_rows[1] - q_rows[0], k_rows[1] - k_rows[0]
    k0 = max(k_at, q_at - left) if left >= 0 else k_at
    k1 = min(k_at + m, q_at + n + right) if right >= 0 else k_at + m
    q0 = max(q_at, k0 - right) if right >= 0 else q_at
    q1 = min(q_at + n, k1 + left) if left >= 0 else q_at + n
    if k0 >= k1 or q0 >= q1:
        return None
    shift = q0 - k0  # a local query row i is at global q0 + i, a local key j at k0 + j
    local_left = left - shift if left >= 0 and left - shift < q1 - q0 - 1 else -1
    local_right = right + shift if right >= 0 and right + shift < k1 - k0 - 1 else -1
    return (q_rows[0] + q0 - q_at, q_rows[0] + q1 - q_at, k_rows[0] + k0 - k_at, k_rows[0] + k1 - k_at, local_left,
            local_right)


def _windowed_blocks(q_chunks: list[tuple[int, int, int]], k_chunks: list[tuple[int, int, int]],
                     window: tuple[int, int], scale: float, softcap: float) -> list[Block]:
    """Blocks of the chunk pairs (local start, local end, global position of the start) under a window."""
    blocks = []
    for q_lo, q_hi, q_at in q_chunks:
        for k_lo, k_hi, k_at in k_chunks:
            span = _window_span((q_lo, q_hi), q_at, (k_lo, k_hi), k_at, *window)
            if span is not None:
                params = AttentionParams(scale, span[4], span[5], bottom_right=False, softcap=softcap)
                blocks.append((slice(span[0], span[1]), slice(span[2], span[3]), params))
    return blocks


def _dense_chunks(rank: int, size: int, seqlen: int, layout: str) -> list[tuple[int, int, int]]:
    """rank's shard of a (batch, seqlen_local) sharding as chunks (local start, end, global position)."""
    if layout == "contiguous":
        return [(0, seqlen, rank * seqlen)]
    half = seqlen // 2
    return [(0, half, rank * half), (half, seqlen, (2 * size - 1 - rank) * half)]


def _dense_blocks(rank: int, src: int, size: int, seqlen: int, causal: bool, layout: str, scale: float,
                  softcap: float, window: tuple[int, int] | None = None) -> list[Block]:
    """What rank's queries attend to in src's K/V shard of a (batch, seqlen_local) sharding."""
    if window is not None:
        return _windowed_blocks(_dense_chunks(rank, size, seqlen, layout), _dense_chunks(src, size, seqlen, layout),
                                window, scale, softcap)
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


def dense_steps(rank: int, size: int, seqlen: int, causal: bool, layout: str, scale: float, softcap: float = 0.0,
                window: tuple[int, int] | None = None) -> list[list[Block]]:
    """rank's blocks at each ring step of a (batch, seqlen_local) sharding, up to the last step at which
    any rank has a block (a window shorter than the sequence leaves the later steps nothing to do)."""
    def blocks(r: int, s: int) -> list[Block]:
        return _dense_blocks(r, (r - s) % size, size, seqlen, causal, layout, scale, softcap, window)
    steps = size if window is None else 1 + max(s for r in range(size) for s in range(size) if blocks(r, s))
    return [blocks(rank, s) for s in range(steps)]


# A span of a packed batch's ring step: (first query row, the queries' prefix sums, first key row, the
# keys' prefix sums, window_left, window_right) of one varlen call.
Span = tuple[int, list[int], int, list[int], int, int]


def _packed_span(bounds: list[int], rank: int, src: int, share: int, causal: bool,
                 window: tuple[int, int] | None) -> Span | None:
    """What rank's queries attend to in src's K/V shard of a packed batch of documents (prefix sums
    `bounds`) cut into contiguous shares of `share` tokens, or None for nothing: one varlen call over
    the documents that meet rank's share, each document's queries in the share against its keys in
    src's share (none: a zero-length part; causal: every key when src's share comes first, the
    diagonal's causal mask when it is rank's own share, nothing after). A window (bottom-right aligned
    in each document's part: the parts of the diagonal are the same positions) trims the parts of
    another share, which only one document can meet (it crosses the shares between them)."""
    if causal and src > rank:
        return None
    q_lo, q_hi, k_lo, k_hi = rank * share, (rank + 1) * share, src * share, (src + 1) * share
    docs = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < q_hi and b > q_lo]
    if window is not None and src != rank:
        crossing = [(a, b) for a, b in docs if a < k_hi and b > k_lo]
        if not crossing:
            return None
        a, b = crossing[0]
        q_rows, k_rows = (max(a, q_lo), min(b, q_hi)), (max(a, k_lo), min(b, k_hi))
        span = _window_span((q_rows[0] - q_lo, q_rows[1] - q_lo), q_rows[0], (k_rows[0] - k_lo, k_rows[1] - k_lo),
                            k_rows[0], *window)
        return None if span is None else (span[0], [0, span[1] - span[0]], span[2], [0, span[3] - span[2]], *span[4:])
    cu_q = [max(a, q_lo) - q_lo for a, _ in docs] + [share]
    cu_k = [min(max(a, k_lo), k_hi) for a, _ in docs] + [min(max(docs[-1][1], k_lo), k_hi)]
    first = cu_k[0]
    cu_k = [c - first for c in cu_k]
    if cu_k[-1] == 0:
        return None  # no key of src's share in them
    left, right = window if window is not None else (-1, 0 if causal and src == rank else -1)
    return 0, cu_q, first - k_lo, cu_k, left, right


def _span_block(span: Span, scale: float, softcap: float, device: torch.device) -> Block:
    q_start, cu_q, k_start, cu_k, left, right = span
    # Top-left aligned, as a window span's shifted window is; the other spans attend fully or over the
    # same positions in each document, where both alignments are the same.
    params = AttentionParams(scale, left, right, bottom_right=False, softcap=softcap,
                             cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                             cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                             max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
                             max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])))
    return slice(q_start, q_start + cu_q[-1]), slice(k_start, k_start + cu_k[-1]), params


def packed_steps(bounds: list[int], rank: int, size: int, share: int, causal: bool, scale: float,
                 device: torch.device, softcap: float = 0.0,
                 window: tuple[int, int] | None = None) -> list[list[Block]]:
    """rank's blocks at each step of the ring over a packed batch in contiguous shares, up to the last
    step at which any rank has a block: documents shorter than a share meet few shards (a window few
    of those), and later steps would only move K/V and dK/dV around."""
    spans = [[_packed_span(bounds, r, (r - s) % size, share, causal, window) for s in range(size)]
             for r in range(size)]
    steps = 1 + max(s for r in range(size) for s in range(size) if spans[r][s] is not None)
    return [[] if span is None else [_span_block(span, scale, softcap, device)] for span in spans[rank][:steps]]


def zigzag_packed_steps(bounds: list[int], rank: int, size: int, causal: bool, scale: float, device: torch.device,
                        softcap: float = 0.0) -> list[list[Block]]:
    """rank's blocks at each ring step over a packed batch in the zigzag layout (shards.py: chunk r of
    every document, then chunk 2W-1-r of every document; the same chunk lengths on every rank). Each
    block is one varlen call of a part of the queries (the first or the second chunks) against a part
    of the keys; under a causal mask: the diagonal's first chunks causally, its second chunks against
    its first ones and causally against themselves; an earlier rank's first chunks from both parts; a
    later rank's both parts from the second chunks. Every rank and step does the same work."""
    chunks = check_packed_zigzag(bounds, size)
    half = sum(chunks)
    cu = torch.tensor([0] + chunks, device=device).cumsum(0).to(torch.int32)
    longest = max(chunks, default=0)
    parts = (slice(0, half), slice(half, 2 * half))
    params = {masked: AttentionParams(scale, window_right=0 if masked else -1, bottom_right=False, softcap=softcap,
                                      cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
              for masked in (False, True)}
    steps = []
    for s in range(size):
        src = (rank - s) % size
        if not causal:
            pairs = [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]
        elif src == rank:
            pairs = [(0, 0, True), (1, 0, False), (1, 1, True)]
        else:
            pairs = [(0, 0, False), (1, 0, False)] if src < rank else [(1, 0, False), (1, 1, False)]
        steps.append([(parts[q], parts[k], params[masked]) for q, k, masked in pairs])
    return steps


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
                         window_size=(-1, -1), learnable_sink=None):
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
        window_size: (left, right) sliding window over the global positions, as flash_attn_func's
            (-1: unbounded); each block of a step takes the window shifted to its chunks, and the
            ring stops after the last step whose shards any window reaches.
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
    window = window_bounds(window_size, bool(causal))
    sink = check_learnable_sink(learnable_sink, q.shape[2], q.device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    steps = dense_steps(rank, size, q.shape[1], bool(causal), layout, scale, softcap, window)
    return _RingFlashAttn.apply(q, k, v, sink, steps, False, group)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=None, softmax_scale=None, causal=False,
                                softcap=0.0, layout="contiguous", window_size=(-1, -1), learnable_sink=None):
    """ring_flash_attn_func for a packed batch of documents (flash_attn_varlen_func's layout, self-
    attention): q (total / W, nheads, headdim) is this rank's shard of the packed tokens, k and v
    (total / W, nheads_k, headdim) of the same tokens' keys and values. layout (shards.py, which
    split_packed / context_parallel_shard(..., cu_seqlens=) cut): "contiguous", a contiguous share
    (pad the packed batch to a multiple of W; documents may cross the shares' edges), or "zigzag",
    chunks r and 2W-1-r of every document (each document's length a multiple of 2W), which gives every
    rank the same causal work however long the documents are. cu_seqlens ((batch + 1,) int32) and
    max_seqlen describe the whole batch, the same on every rank; causal masks within each document;
    softcap, window_size as flash_attn_varlen_func (a window with the contiguous layout, under which
    the work is balanced already), learnable_sink as ring_flash_attn_func, in both layouts. Returns this
    rank's shard of the output, (total / W, nheads, headdim)."""
    require_process_group("ring_flash_attn_varlen_func", layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, "(total / world_size, heads, headdim)")
    check_attention_inputs(q[None], k[None], v[None], value_dim=False)
    backend_name(q.device, q.dtype)
    check_shards(q[None], k[None], group, "contiguous")  # (zigzag_packed_steps checks each document's chunks)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    share = q.shape[0]
    check_cu_seqlens("cu_seqlens", cu_seqlens, "max_seqlen", max_seqlen, share * size,
                     f"the packed batch ({share} tokens on each of {size} ranks: pad it to a multiple of {size})",
                     q.device)
    scale, softcap = resolve_scale(softmax_scale, q.shape[-1]), check_softcap(softcap)
    window = window_bounds(window_size, bool(causal))
    sink = check_learnable_sink(learnable_sink, q.shape[1], q.device)
    bounds = cu_seqlens.tolist()
    if layout == "contiguous":
        steps = packed_steps(bounds, rank, size, share, bool(causal), scale, q.device, softcap, window)
    elif window is not None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"window_size={window_size!r} with the packed zigzag layout: its blocks "
             "pair chunks of different lengths in one call; take layout='contiguous' (a window balances the work "
             "already)")
    else:
        steps = zigzag_packed_steps(bounds, rank, size, bool(causal), scale, q.device, softcap)
    return _RingFlashAttn.apply(q[None], k[None], v[None], sink, steps, True, group)[0]
