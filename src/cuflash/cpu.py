"""Blocked attention in plain PyTorch: the same algorithm as the Triton kernels (online softmax
over K/V tiles, recomputation from the log-sum-exp in the backward), for tensors on any device.

Working memory is O(seqlen): one (block_m x block_n) score tile per head at a time, plus the
fp32 output and gradient accumulators. The query heads that share a KV head are folded into the
rows of one matrix, so K/V are never repeated and the GQA sums of dK/dV come out of the matmuls.
Every option of AttentionParams is supported; a varlen batch runs one sequence at a time (a paged
one gathers each sequence's keys from its pages). Mods (score_mod, mask_mod, a block mask; softcap and
ALiBi are score_mods, builtin_mods.resolved) are
computed with torch ops on each tile (mods/evaluate.py), the score_mod's gradient by torch's autograd
through them, tile by tile; with a block mask the tiles lie within its blocks and those it lists for
no head are skipped.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import blocks as block_lists
from .builtin_mods import resolved
from .dropout import head_ids, keep_mask
from .cache import append_to_cache, cache_slot
from .dtypes import lse_dtype
from .mods import Mods
from .mods.evaluate import evaluate
from .mods.trace import INDEX_DTYPE
from .params import AttentionParams, per_sequence
from .sinks import sink_grad

BLOCK_M = 256  # query rows and keys per tile where the call asks for none (AttentionParams.block_m/_n)
BLOCK_N = 512


def _grouped(x: torch.Tensor, nheads_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, N, H, D) -> (B, Hk, G, N, D) in the compute dtype."""
    b, n, h, d = x.shape
    return x.to(dtype).view(b, n, nheads_k, h // nheads_k, d).permute(0, 2, 3, 1, 4)


def _rows(x: torch.Tensor, m0: int, m1: int) -> torch.Tensor:
    """Rows m0:m1 of a (B, Hk, G, N, ...) tensor, with G folded into the rows: (B, Hk, G*bm, ...)."""
    blk = x[:, :, :, m0:m1]
    return blk.reshape(blk.shape[0], blk.shape[1], -1, *blk.shape[4:])


class ScoreTiles:
    """The score tiles of one dense problem: which key tiles a query tile visits, and the scores
    of a tile with the mods, attn_mask, window/causal mask and the dropout pattern. Tiles are
    handled as (B, Hk, G, bm, bn) views of the (B, Hk, G*bm, bn) matmul results."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, p: AttentionParams, first_batch: int = 0):
        self.batch, self.seqlen_q, self.nheads, _ = q.shape
        self.seqlen_k, self.nheads_k = k.shape[1], k.shape[2]
        self.group = self.nheads // self.nheads_k
        self.dtype = lse_dtype(q.dtype)
        self.p = p = resolved(p, self.seqlen_q, self.seqlen_k, self.dtype)
        self.block_m, self.block_n = p.block_m or BLOCK_M, p.block_n or BLOCK_N
        self.mods = None if p.mods is None else ModTiles(p.mods, self, first_batch, q.device)
        if p.mods is not None and p.mods.blocks is not None:  # tiles within the blocks
            self.block_m = _divisor(p.mods.blocks.q_block, self.block_m)
            self.block_n = _divisor(p.mods.blocks.kv_block, self.block_n)
        self.offset = self.seqlen_k - self.seqlen_q if p.bottom_right else 0
        grouped = (self.batch, self.nheads_k, self.group)
        self.mask = None
        if p.attn_mask is not None:
            self.mask = p.attn_mask.view(*grouped, self.seqlen_q, self.seqlen_k)
        # (batch * nheads + head) of each (B, Hk, G): the dropout stream of that head.
        self.off_bh = None if p.dropout_p == 0 else \
            head_ids(first_batch, self.batch, self.nheads, q.device).view(*grouped, 1, 1)

    def blocks(self, m0: int, m1: int):
        """(n0, n1, masked) for the key tiles that rows m0:m1 visit: keys [full_lo, full_hi) are
        visible to all of them (no mask needed), [lo, full_lo) and [full_hi, hi) to some."""
        p, off = self.p, self.offset
        lo, full_lo, hi, full_hi = 0, 0, self.seqlen_k, self.seqlen_k
        if p.window_left >= 0:
            lo = max(0, m0 + off - p.window_left)
            full_lo = max(0, m1 - 1 + off - p.window_left)
        if p.window_right >= 0:
            hi = min(self.seqlen_k, max(0, m1 + off + p.window_right))
            full_hi = min(self.seqlen_k, max(0, m0 + off + p.window_right + 1))
        hi = max(hi, lo)
        full_lo = min(max(full_lo, lo), hi)
        full_hi = min(max(full_hi, full_lo), hi)
        if self.mods is not None and self.mods.kinds is not None:
            yield from self.mods.blocks(m0, lo, full_lo, full_hi, hi, self.block_n)
            return
        for start, end, masked in ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)):
            for n0 in range(start, end, self.block_n):
                yield n0, min(n0 + self.block_n, end), masked

    def score_mod(self, x: torch.Tensor, m0: int, m1: int, n0: int, n1: int, grad: bool = False):
        """Replaces the logits tile x by the score_mod's value of it, in place (none: nothing). grad:
        returns what score_grad takes (the mods' score_grad)."""
        if self.mods is None:
            return None
        return self.mods.score(x.view(self.batch, self.nheads_k, self.group, m1 - m0, n1 - n0), m0, m1, n0, n1, grad)

    def score_grad(self, computed: tuple, ds: torch.Tensor) -> torch.Tensor:
        """The gradient of the logits tile from ds, that of its scores after score_mod (ModTiles')."""
        assert self.mods is not None  # (score_mod returned `computed`)
        return self.mods.score_grad(computed, ds)

    def scores(self, x: torch.Tensor, m0: int, m1: int, n0: int, n1: int, masked: bool) -> torch.Tensor:
        """Adds an additive attn_mask to the logits tile x (after score_mod) and sets hidden keys
        (mask_mod and the block mask's too) to -inf, in place."""
        p = self.p
        s = x.view(self.batch, self.nheads_k, self.group, m1 - m0, n1 - n0)
        rows, cols = _coords(m0, m1, n0, n1, x.device)
        if self.mask is not None:
            tile = self.mask[:, :, :, m0:m1, n0:n1]
            if tile.dtype == torch.bool:
                s.masked_fill_(~tile, float("-inf"))
            else:
                s.add_(tile.to(s.dtype))
        if masked:
            hidden = torch.zeros(rows.shape[0], cols.shape[1], dtype=torch.bool, device=x.device)
            if p.window_right >= 0:
                hidden |= cols > rows + self.offset + p.window_right
            if p.window_left >= 0:
                hidden |= cols < rows + self.offset - p.window_left
            s.masked_fill_(hidden, float("-inf"))
        if self.mods is not None:
            self.mods.mask(s, m0, m1, n0, n1)
        return x

    def keep(self, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor:
        """The dropout scale of each probability of the tile: 0 (dropped) or 1 / (1 - dropout_p)."""
        seed, off_bh = self.p.rng_seed, self.off_bh
        assert seed is not None and off_bh is not None  # (called with dropout_p > 0, which comes with a seed)
        rows, cols = _coords(m0, m1, n0, n1, off_bh.device)
        kept = keep_mask(seed, off_bh, rows, cols, self.p.dropout_p)
        scale = torch.where(kept, 1.0 / (1.0 - self.p.dropout_p), 0.0).to(self.dtype)
        return scale.reshape(self.batch, self.nheads_k, -1, n1 - n0)


@contextlib.contextmanager
def _recording():
    """Grad mode on, and autograd's dispatch keys back where a custom op's implementation runs (which
    excludes them: the ops would record nothing there): the score_mod's gradient is torch's autograd
    through its ops (ModTiles.score_grad), under the custom ops too."""
    excluded = torch._C._dispatch_tls_local_exclude_set() - torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _coords(m0: int, m1: int, n0: int, n1: int, device, dtype=torch.int64):
    """The query rows m0:m1 as a column and the keys n0:n1 as a row."""
    return (torch.arange(m0, m1, dtype=dtype, device=device)[:, None],
            torch.arange(n0, n1, dtype=dtype, device=device)[None, :])


def _divisor(block: int, most: int) -> int:
    """The largest divisor of block up to most: a tile size that never straddles two blocks."""
    return next(d for d in range(min(block, most), 0, -1) if block % d == 0)


class ModTiles:
    """A call's mods on the tiles of ScoreTiles (b the batch index from first_batch on, h the query
    head), and the block mask's states: `kinds[i][j]` says of query block i and key block j whether
    no head sees it (SKIPPED: the tile is skipped), every head sees it whole (FULL: no mask_mod) or
    else (PARTIAL: each head's state, and mask_mod where it is partial)."""

    def __init__(self, mods: Mods, tiles: ScoreTiles, first_batch: int, device: torch.device):
        self.mods = mods
        self.grouped = (tiles.batch, tiles.nheads_k, tiles.group)
        self.b = torch.arange(first_batch, first_batch + tiles.batch, dtype=INDEX_DTYPE, device=device)
        self.b = self.b.view(-1, 1, 1, 1, 1)
        self.h = torch.arange(tiles.nheads, dtype=INDEX_DTYPE, device=device).view(1, *self.grouped[1:], 1, 1)
        # The score_mod's captured tensors; in a backward that computes the gradients of those that ask for one
        # (mods.grads), leaves standing for those, which its ops are recorded from (score_grad: inside a custom
        # op the tensors themselves do not require grad).
        self.tensors = [] if mods.score is None else list(mods.score.tensors)
        self.leaves: tuple[torch.Tensor, ...] = ()
        if mods.score is not None and mods.grads:
            self.tensors = [t.detach().requires_grad_() if needed else t
                            for t, needed in zip(self.tensors, mods.score.requires_grad)]
            self.leaves = tuple(t for t, needed in zip(self.tensors, mods.score.requires_grad) if needed)
        self.states = self.kinds = None
        blocks = mods.blocks
        if blocks is not None:
            nrows, ncols = -(-tiles.seqlen_q // blocks.q_block), -(-tiles.seqlen_k // blocks.kv_block)
            states = block_lists.states(blocks, nrows, ncols)[first_batch:first_batch + tiles.batch]
            self.states = states.reshape(*self.grouped, nrows, ncols)
            heads = states.flatten(0, 1)
            full, seen = (heads == block_lists.FULL).all(0), (heads != block_lists.SKIPPED).any(0)
            self.kinds = torch.where(full, block_lists.FULL,
                                     torch.where(seen, block_lists.PARTIAL, block_lists.SKIPPED)).tolist()

    def blocks(self, m0: int, lo: int, full_lo: int, full_hi: int, hi: int, block_n: int):
        """ScoreTiles.blocks with a block mask: key tiles of block_n (a divisor of its key blocks) over
        keys lo:hi, but those of blocks no head sees."""
        assert self.mods.blocks is not None and self.kinds is not None
        kinds = self.kinds[m0 // self.mods.blocks.q_block]
        n0 = lo
        while n0 < hi:
            n1 = min((n0 // block_n + 1) * block_n, hi)
            if kinds[n0 // self.mods.blocks.kv_block] != block_lists.SKIPPED:
                yield n0, n1, not full_lo <= n0 < n1 <= full_hi
            n0 = n1

    def score(self, s: torch.Tensor, m0: int, m1: int, n0: int, n1: int, grad: bool):
        """score_mod's value of the (batch, nheads_k, group, rows, keys) logits s, written into s.
        grad: returns (the input it was computed from, its value) for score_grad."""
        mod = self.mods.score
        if mod is None:
            return None
        rows, cols = _coords(m0, m1, n0, n1, s.device, INDEX_DTYPE)
        with _recording() if grad else torch.no_grad():
            x = s.clone().requires_grad_() if grad else s
            value = evaluate(mod.graph, (x, self.b, self.h, rows, cols), self.tensors, list(mod.scalars))
        s.copy_(value)
        return (x, value) if grad else None

    def score_grad(self, computed: tuple, ds: torch.Tensor) -> torch.Tensor:
        """The gradient with respect to the logits of the tile whose scores after score_mod have
        gradient ds (batch, nheads_k, group * rows, keys), through score (computed: what it
        returned); the gradients of the captured tensors that ask for one are added to mods.grads."""
        x, value = computed
        grads = self.mods.grads or ()  # (none: no gradient of the captured tensors is asked for)
        if not value.requires_grad:  # the mod reads neither the score nor a tensor that needs a gradient
            return torch.zeros_like(ds)
        with _recording():
            found = torch.autograd.grad(value, (x, *self.leaves), ds.view(x.shape).to(value.dtype), allow_unused=True)
        for buffer, g in zip(grads, found[1:]):
            if g is not None:
                buffer.add_(g)
        return torch.zeros_like(ds) if found[0] is None else found[0].view(ds.shape)

    def mask(self, s: torch.Tensor, m0: int, m1: int, n0: int, n1: int) -> None:
        """Sets the keys of the (batch, nheads_k, group, rows, keys) scores s that mask_mod hides (in
        blocks partial for the head) or the block mask skips (for the head) to -inf, in place."""
        mask, blocks = self.mods.mask, self.mods.blocks
        state = None
        if blocks is not None and self.states is not None and self.kinds is not None:
            i, j = m0 // blocks.q_block, n0 // blocks.kv_block
            if self.kinds[i][j] == block_lists.FULL:
                return
            state = self.states[..., i, j, None, None]
        hidden = None
        if mask is not None:
            rows, cols = _coords(m0, m1, n0, n1, s.device, INDEX_DTYPE)
            hidden = ~evaluate(mask.graph, (self.b, self.h, rows, cols), list(mask.tensors), list(mask.scalars))
        if state is not None:
            skipped = state == block_lists.SKIPPED
            hidden = skipped if hidden is None else skipped | (hidden & (state == block_lists.PARTIAL))
        if hidden is not None:
            s.masked_fill_(hidden, float("-inf"))


def attention_probs(q: torch.Tensor, k: torch.Tensor, p: AttentionParams, first_batch: int = 0) -> torch.Tensor:
    """The softmax probabilities (B, H, Nq, Nk) of a dense problem (q (B, Nq, H, D), k (B, Nk, Hk, D);
    first_batch: the batch index of q's first sequence, for the dropout pattern) with the masks and
    logits of ScoreTiles in lse_dtype (mods too, but a block mask: return_attn_probs' functions take
    none), for return_attn_probs: rows that see no key are 0 and, in flash-attn's encoding, a
    probability that dropout drops is negated."""
    tiles = ScoreTiles(q, k, p, first_batch)
    seqlen_q, seqlen_k = tiles.seqlen_q, tiles.seqlen_k
    qg = _rows(_grouped(q, tiles.nheads_k, tiles.dtype), 0, seqlen_q) * p.softmax_scale
    kg = k.to(tiles.dtype).transpose(1, 2)
    x = qg @ kg.transpose(-1, -2)
    tiles.score_mod(x, 0, seqlen_q, 0, seqlen_k)
    s = tiles.scores(x, 0, seqlen_q, 0, seqlen_k, True)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if p.learnable_sink is not None:  # (its share of each row: the probabilities sum to less than 1)
        lse = torch.logaddexp(lse, _sink_rows(p.learnable_sink, tiles, seqlen_q, lse.dtype)[..., None])
    probs = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
    if p.dropout_p > 0:
        probs = torch.where(tiles.keep(0, seqlen_q, 0, seqlen_k) > 0, probs, -probs)
    return probs.view(tiles.batch, tiles.nheads, seqlen_q, seqlen_k)


def _sink_rows(sink: torch.Tensor, tiles: ScoreTiles, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The learnable sink's logit of each row of a tile of `rows` query rows in the grouped layout,
    (1, Hk, G * rows): the rows' heads' (as _rows folds them)."""
    return sink.detach().to(dtype).view(1, tiles.nheads_k, tiles.group, 1).expand(-1, -1, -1, rows).flatten(2)


def _sequences(p: AttentionParams):
    """(b, its query rows, its key rows, its params) for each sequence of a varlen batch: the rows it
    uses (AttentionParams.spans)."""
    dense = p.sequence()
    for b, q_rows, k_rows in p.spans():
        yield b, q_rows, k_rows, dense


def attention_forward(q, k, v, params: AttentionParams, plans: dict | None = None):
    """Same contract as kernels.attention_forward (plans: the kernels' launch plans; none here)."""
    if not params.varlen:
        return _forward(q, k, v, params)
    # Rows past a sequence's seqused_q keep out 0 and lse +inf.
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))  # (v's head dim)
    lse = torch.full(params.lse_shape(q), float("inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for b, q_rows, k_rows, p in _sequences(params):
        k_b, v_b = (params.sequence_keys(t, b, k_rows.start, k_rows.stop) for t in (k, v))
        out_b, lse_b = _forward(q[None, q_rows], k_b[None], v_b[None], p, b)
        out[q_rows], lse[:, q_rows] = out_b[0], lse_b[0]
    return out, lse


def attention_backward(dout, q, k, v, out, lse, params: AttentionParams, plans: dict | None = None,
                       dlse: torch.Tensor | None = None):
    """Same contract as kernels.attention_backward (plans: as attention_forward's)."""
    if not params.varlen:
        dq, dk, dv, delta = _backward(dout, q, k, v, out, lse, params, dlse=dlse)
    else:
        # Rows past a sequence's seqused_q / seqused_k keep gradient 0, and delta 0 (their lse is +inf: the
        # sink's gradient takes nothing from them).
        dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        delta = torch.zeros(lse.shape, dtype=lse_dtype(q.dtype), device=q.device)
        for b, q_rows, k_rows, p in _sequences(params):
            dq[q_rows], dk[k_rows], dv[k_rows], delta[:, q_rows] = (g[0] for g in _backward(
                dout[None, q_rows], q[None, q_rows], k[None, k_rows], v[None, k_rows], out[None, q_rows],
                lse[None, :, q_rows], p, b, None if dlse is None else dlse[None, :, q_rows]))
    if params.learnable_sink is None:
        return dq, dk, dv
    return dq, dk, dv, sink_grad(params.learnable_sink, lse, delta)


def _forward(q, k, v, p: AttentionParams, first_batch: int = 0):
    batch, seqlen_q, nheads = q.shape[:3]
    dim_v = v.shape[3]  # (the output's head dim: v's, which may differ from q's and k's)
    tiles = ScoreTiles(q, k, p, first_batch)
    nheads_k, group, dtype = tiles.nheads_k, tiles.group, tiles.dtype
    qg = _grouped(q, nheads_k, dtype)
    kg = k.to(dtype).transpose(1, 2).contiguous()  # (B, Hk, Nk, D): matmuls on strided K run slower
    vg = v.to(dtype).transpose(1, 2).contiguous()
    out = torch.empty(batch, nheads_k, group, seqlen_q, dim_v, dtype=dtype, device=q.device)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=lse_dtype(q.dtype), device=q.device)
    for m0 in range(0, seqlen_q, tiles.block_m):
        m1 = min(m0 + tiles.block_m, seqlen_q)
        q_blk = _rows(qg, m0, m1) * p.softmax_scale
        rows = q_blk.shape[2]
        m_i = torch.full((batch, nheads_k, rows), float("-inf"), dtype=dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        if p.learnable_sink is not None:  # as if a key of logit sink and value 0 had been seen (sinks.py)
            m_i = _sink_rows(p.learnable_sink, tiles, m1 - m0, dtype).expand_as(m_i).clone()
            l_i = (m_i != float("-inf")).to(dtype)
        acc = torch.zeros(batch, nheads_k, rows, dim_v, dtype=dtype, device=q.device)
        for n0, n1, masked in tiles.blocks(m0, m1):
            x = q_blk @ kg[:, :, n0:n1].transpose(-1, -2)
            tiles.score_mod(x, m0, m1, n0, n1)
            s = tiles.scores(x, m0, m1, n0, n1, masked)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p_blk = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p_blk.sum(-1)
            if p.dropout_p > 0:  # the softmax sum counts every probability, the output only the kept
                p_blk.mul_(tiles.keep(m0, m1, n0, n1))
            acc.mul_(alpha[..., None]).add_(p_blk @ vg[:, :, n0:n1])
            m_i = m_new
        empty = l_i == 0  # rows that saw no key: out 0, lse +inf
        l_safe = torch.where(empty, 1.0, l_i)
        shape = (batch, nheads_k, group, m1 - m0)
        out[:, :, :, m0:m1] = (acc / l_safe[..., None]).view(*shape, dim_v)
        lse[:, :, :, m0:m1] = torch.where(empty, float("inf"), m_i + torch.log(l_safe)).view(shape)
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, dim_v)
    return out.to(q.dtype).contiguous(), lse.view(batch, nheads, seqlen_q)


def _backward(dout, q, k, v, out, lse, p: AttentionParams, first_batch: int = 0, dlse: torch.Tensor | None = None):
    """(dq, dk, dv, delta (B, H, Nq) in the compute dtype: rowsum(dO * O) - dlse, for the sink's gradient)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    tiles = ScoreTiles(q, k, p, first_batch)
    nheads_k, group, dtype, seqlen_k = tiles.nheads_k, tiles.group, tiles.dtype, tiles.seqlen_k
    qg = _grouped(q, nheads_k, dtype)
    dog = _grouped(dout, nheads_k, dtype)
    delta = (dog * _grouped(out, nheads_k, dtype)).sum(-1)  # (B, Hk, G, Nq)
    if dlse is not None:  # d lse_i / d s_ij = p_ij: dS = P (dP - delta + dlse)
        delta -= dlse.reshape(batch, nheads_k, group, seqlen_q).to(dtype)
    lseg = lse.reshape(batch, nheads_k, group, seqlen_q).to(dtype)
    kg = k.to(dtype).transpose(1, 2).contiguous()  # (B, Hk, Nk, D): matmuls on strided K run slower
    vg = v.to(dtype).transpose(1, 2).contiguous()
    dq = torch.empty(batch, nheads_k, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    dk = torch.zeros(batch, nheads_k, seqlen_k, head_dim, dtype=dtype, device=q.device)
    dv = torch.zeros(batch, nheads_k, seqlen_k, v.shape[3], dtype=dtype, device=q.device)
    for m0 in range(0, seqlen_q, tiles.block_m):
        m1 = min(m0 + tiles.block_m, seqlen_q)
        q_blk, do_blk = _rows(qg, m0, m1), _rows(dog, m0, m1)
        lse_blk, delta_blk = _rows(lseg, m0, m1), _rows(delta, m0, m1)
        dq_blk = torch.zeros_like(q_blk)
        for n0, n1, masked in tiles.blocks(m0, m1):
            k_blk, v_blk = kg[:, :, n0:n1], vg[:, :, n0:n1]
            x = (q_blk @ k_blk.transpose(-1, -2)).mul_(p.softmax_scale)
            modded = tiles.score_mod(x, m0, m1, n0, n1, grad=True)
            s = tiles.scores(x, m0, m1, n0, n1, masked)
            p_blk = s.sub_(lse_blk[..., None]).exp_()  # lse = +inf gives p = 0
            dp = do_blk @ v_blk.transpose(-1, -2)
            if p.dropout_p > 0:
                keep = tiles.keep(m0, m1, n0, n1)
                dv[:, :, n0:n1] += (p_blk * keep).transpose(-1, -2) @ do_blk
                dp.mul_(keep)
            else:
                dv[:, :, n0:n1] += p_blk.transpose(-1, -2) @ do_blk
            ds = p_blk.mul_(dp.sub_(delta_blk[..., None]))
            if modded is not None:
                ds = tiles.score_grad(modded, ds)
            dq_blk += ds @ k_blk
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ q_blk
        dq[:, :, :, m0:m1] = dq_blk.view(batch, nheads_k, group, m1 - m0, head_dim)
    dq = (dq * p.softmax_scale).permute(0, 3, 1, 2, 4).reshape(q.shape)
    dk = (dk * p.softmax_scale).transpose(1, 2)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.transpose(1, 2).to(v.dtype).contiguous(),
            delta.view(batch, nheads, seqlen_q))


def decode_forward(q, k_cache, v_cache, cache_seqlens, seqlen_new: int, leftpad, cache_rows, block_table,
                   params: AttentionParams, num_splits: int = 0, k_new=None, v_new=None, plans: dict | None = None,
                   rotary_end: int | None = None):
    """Same contract as kernels.decode_forward but for the index values, which the caller checked
    (cache.index_violation; plans, rotary_end: not used here): k_new, v_new appended (append_to_cache),
    then each sequence's keys (cache positions leftpad[b] .. cache_seqlens[b] + seqlen_new - 1)
    gathered into one packed tensor, attended as a varlen batch. num_splits changes only the
    kernels' rounding: not used here."""
    if k_new is not None:
        append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_rows, block_table)
    batch, seqlen_q, nheads, head_dim = q.shape
    starts = per_sequence(0 if leftpad is None else leftpad, batch, q.device)
    lengths = per_sequence(cache_seqlens, batch, q.device) + seqlen_new - starts
    cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    total = int(cu_seqlens_k[-1])
    owner = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    positions = starts[owner] + torch.arange(total, device=q.device) - cu_seqlens_k[owner].long()
    source = cache_slot(owner, positions, k_cache.shape[1], block_table, cache_rows)
    k_packed, v_packed = k_cache[source], v_cache[source]
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    params = dataclasses.replace(params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=seqlen_q, max_seqlen_k=max(1, int(lengths.max())))
    out, lse = attention_forward(q.reshape(batch * seqlen_q, nheads, head_dim), k_packed, v_packed, params)
    out = out.view(batch, seqlen_q, nheads, v_cache.shape[3])
    return out, lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()
