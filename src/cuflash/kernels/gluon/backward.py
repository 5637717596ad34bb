"""The backward's dK/dV and dQ kernels for Hopper in Gluon: warp-specialized, two consumer
warpgroups (the structure of kernels/gluon/forward.py applied to the two passes of
kernels/triton/backward.py, which also computes delta = rowsum(dO * O) before them).

dK/dV: a work item is one tile of 2 x 64 keys of one (batch, KV head), which streams the query
tiles (64 rows) of every query head that shares the KV head; one persistent program per SM takes
pairs of items round-robin (as the forward's programs do):
- the loader (one warp) copies an item's K and V once (into one of KV_BUFFERS buffers: with two
  it fetches the next item's during the last one), then each query tile's Q and dO into a ring
  of STAGES buffers with the tensor memory accelerator, each load signalling a "ready" barrier;
  with Q and dO come their rows' -lse / softmax_scale and -delta (kernels/triton/backward.py's AccInit);
- two consumer warpgroups, each owning 64 of the keys, compute per query tile on the tensor cores
  (wgmma) S^T = K Q^T and dP^T = V dO^T, their accumulators starting at those values (so no
  register holds lse and delta per column), then P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta),
  and accumulate dV += P^T dO and dK += dS^T Q in registers (P^T and dS^T from registers), then
  release the buffer on an "empty" barrier that both must arrive at; at the item's end dK and dV
  leave through the item's K and V buffer, which then goes back to the loader.
Fused (FUSED), the dK/dV kernel also computes dQ, so that S and dP are computed once: the
consumers share their dS^T tiles through shared memory and, per query tile, compute dQ = dS K over
the item's 128 keys in 64-column parts, each part added to an fp32 workspace by a TMA reduction
(the order of those additions varies from run to run; kernels/triton/backward.py then casts the sum).
dQ, otherwise: a work item is 2 x 64 query rows of one (batch, head), each consumer 64 of them with
their Q and dO, scheduled as the forward's (persistent programs, pairs of items); the loader streams
the K/V tiles; per tile S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K. Q and dO go back to
the loader after the item's last products, dQ leaves through the item's last V tile. No atomics:
bitwise reproducible.
One consumer's exponentials overlap the other's matrix products.

At D=256 a consumer's registers cannot hold dK and dV of 64 keys: a dK/dV work item is then 64 keys,
which both consumers hold; each computes S^T and dP^T for half of each query tile's rows and half of
dK's and dV's columns, P^T and dS^T passing between them through shared memory (_split_d_tiles); dQ
is not fused there, and the dQ pass is Triton's. So at DeepSeek's (192, 128) (q and k 192 wide, v 128):
Q and K are held as 128 + 64 columns (common.head_parts: Gluon's tensors and shared memory are powers of
two), each part in buffers and TMA boxes of its own, S^T two products accumulating; consumer 0 takes
dK's first 128 columns, consumer 1 its last 64, each half of dV's. There the dQ kernel (unfused) takes
64-key tiles, dQ in two accumulators (128 + 64 columns) that leave through the consumer's own Q tiles.
Only the plain backward is here (kernels/gluon/__init__.py's accepts: 16-bit, head dims 64, 128 and
256 and (192, 128), causal or not, GQA); everything else takes the Triton kernels. GPU only: Triton's
interpreter does not run Gluon.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from ...params import AttentionParams
from ..compat import barrier, tma_load
from ..constants import LOG2E
from ..device import cdiv, num_sms, scratch
from ..variant import Problem, logit_scale, lse_strides, mod_args
from . import Dkdv, Dq
from .common import ROWS, barriers, box_strides, buffers, copy_out, count, descriptor, head_parts, listed_walk, \
    load_kv, load_pair, meet, query_item, ring, tile_key, tiles_of, work


@gluon.jit
def _buffers(dtype: gl.constexpr, HEAD_D: gl.constexpr, HEAD_DV: gl.constexpr, BLOCK: gl.constexpr,
             STAGES: gl.constexpr, HELD: gl.constexpr, PARTS: gl.constexpr = 2):
    """The shared memory of both kernels: HELD buffers of two tensors' tiles of PARTS x 64 rows, each
    held for a work item (K and V for dK/dV, Q and dO for dQ), a ring of STAGES buffers of BLOCK
    rows for the two tensors streamed past them, and the barriers: a "ready" per held buffer and a
    "free" that both consumers arrive at once done with it, a "ready" per streamed tensor and buffer,
    an "empty" per buffer that both consumers arrive at. The first tensor of each pair (K, Q) is HEAD_D
    wide (the first part of a head dim of two parts: common.head_parts), the second (V, dO) HEAD_DV."""
    held_a = buffers(dtype, PARTS * HELD, ROWS, HEAD_D)
    held_b = buffers(dtype, PARTS * HELD, ROWS, HEAD_DV)
    ring_a, ring_b, a_ready, b_ready, empty = ring(dtype, BLOCK, HEAD_D, HEAD_DV, STAGES, 2)
    held_ready = barriers(HELD, 1)
    held_free = barriers(HELD, 2)
    return held_a, held_b, ring_a, ring_b, held_ready, held_free, a_ready, b_ready, empty


@gluon.jit
def _load_held(done, a_desc, b_desc, row0, off_b, off_h, a_smem, b_smem, ready, free, a_rest=None):
    """The loader's copy of work item `done`'s held tiles (PARTS x 64 rows of two tensors from row0)
    into held buffer done % HELD, once both consumers have freed it. a_rest: (descriptor, buffers) of the
    rest of a's columns (a head dim of two parts), loaded beside a's."""
    HELD: gl.constexpr = ready.shape[0]
    PARTS: gl.constexpr = a_smem.shape[0] // HELD
    REST_BYTES: gl.constexpr = 0 if a_rest is None else a_rest[0].block_type.nbytes
    kb = done % HELD
    mbarrier.wait(free.index(kb), ((done // HELD) & 1) ^ 1)
    mbarrier.expect(ready.index(kb), PARTS * (a_desc.block_type.nbytes + b_desc.block_type.nbytes + REST_BYTES))
    for part in gl.static_range(PARTS):
        tma_load(a_desc, [off_b, row0 + part * ROWS, off_h, 0], ready.index(kb),
                 a_smem.index(PARTS * kb + part).reshape([1, ROWS, 1, a_smem.shape[2]]))
        tma_load(b_desc, [off_b, row0 + part * ROWS, off_h, 0], ready.index(kb),
                 b_smem.index(PARTS * kb + part).reshape([1, ROWS, 1, b_smem.shape[2]]))
        if a_rest is not None:
            rest = a_rest[1].index(PARTS * kb + part)
            tma_load(a_rest[0], [off_b, row0 + part * ROWS, off_h, a_smem.shape[2]], ready.index(kb),
                     rest.reshape([1, ROWS, 1, rest.shape[1]]))


@gluon.jit
def _dq_buffers(dtype: gl.constexpr):
    """The fused dK/dV kernel's shared memory for dQ: two tiles' dS^T (each 2 x 64 keys by 64 query
    rows, one half per consumer; tiles alternate) and a 64 x 64 fp32 dQ part per consumer for the TMA
    to add to global memory."""
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], gl.float32)
    ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, ROWS], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS, ROWS], dq_layout)
    return ds_smem, dq_smem


@gluon.jit
def _share_ds(ds, it, fused, HEAD_D: gl.constexpr, WG: gl.constexpr):
    """Puts this consumer's dS^T of the tile in ring position `it` into shared memory for the dQ
    products; the buffer alternates tiles. D=128, where each consumer computes a dQ part every tile
    (_dq_then_dk): the consumers meet there, both halves then in place, and the last readers of the
    buffer's previous contents (tile it - 2's dQ products) were awaited before either came to tile
    it - 1's meeting. D=64, where one consumer computes the whole dQ every other tile (_add_dq): the
    buffer's "free" and "ready" barriers instead, so that the other consumer may run up to a tile ahead
    (meetings there, with dQ issued before dK, cost 7-10% of the kernel's cycles: docs/tuning.md)."""
    ds_smem, dq_smem, ds_ready, ds_free, dq_desc, k_smem, kb, off_b, off_h, softmax_scale = fused
    buf = it % 2
    if HEAD_D == ROWS:
        mbarrier.wait(ds_free.index(buf), ((it // 2) & 1) ^ 1)
    ds_smem.index(2 * buf + WG).store(ds)
    fence_async_shared()
    if HEAD_D == ROWS:
        barrier()  # every thread's part written before the one arrival
        mbarrier.arrive(ds_ready.index(buf), count=1)
    else:
        meet()


@gluon.jit
def _dq_then_dk(ds, q, dk, it, row, fused, WG: gl.constexpr, s_layout: gl.constexpr):
    """D=128: issues this consumer's part of the dQ of the query tile from row `row` (ring position
    `it`; dS^T shared: _share_ds), its 64 columns = dS K over both consumers' keys, then dK += dS^T Q;
    awaits the dQ part and hands it to the TMA (_reduce_dq) while dK's product runs (FlashAttention-4's
    order); returns dK's accumulator, in flight."""
    ds_smem, dq_smem, ds_ready, ds_free, dq_desc, k_smem, kb, off_b, off_h, softmax_scale = fused
    dq = _dq_part(ds_smem, k_smem, it % 2, kb, WG, s_layout)
    dk = warpgroup_mma(ds, q, dk, is_async=True)
    dq = warpgroup_mma_wait(1, deps=(dq,))
    _reduce_dq(dq, [off_b, row, off_h, WG * ROWS], dq_smem.index(WG), dq_desc, softmax_scale)
    return dk


@gluon.jit
def _add_dq(it, row, fused, WG: gl.constexpr, s_layout: gl.constexpr):
    """D=64, after the tile's dK and dV: the consumer whose turn it is (tiles alternate) computes the
    dQ of the query tile from row `row` (ring position `it`) = dS K over both consumers' keys, once both
    halves of dS^T are in (_share_ds), and hands it to the TMA (_reduce_dq); both then free the buffer."""
    ds_smem, dq_smem, ds_ready, ds_free, dq_desc, k_smem, kb, off_b, off_h, softmax_scale = fused
    buf = it % 2
    if it % 2 == WG:
        mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
        dq = warpgroup_mma_wait(0, deps=(_dq_part(ds_smem, k_smem, buf, kb, 0, s_layout),))
        _reduce_dq(dq, [off_b, row, off_h, 0], dq_smem.index(WG), dq_desc, softmax_scale)
    mbarrier.arrive(ds_free.index(buf), count=1)


@gluon.jit
def _dq_part(ds_smem, k_smem, buf, kb, PART: gl.constexpr, s_layout: gl.constexpr):
    """Issues dQ's columns [64 PART, 64 PART + 64) = dS K over both consumers' keys (dS^T in buffer buf,
    K in held buffer kb); returns the accumulator, in flight."""
    dq = gl.zeros([ROWS, ROWS], gl.float32, s_layout)
    for half in gl.static_range(2):
        dq = warpgroup_mma(ds_smem.index(2 * buf + half).permute((1, 0)),
                           k_smem.index(2 * kb + half).slice(PART * ROWS, ROWS, dim=1), dq, use_acc=half == 1,
                           is_async=True)
    return dq


@gluon.jit
def _reduce_dq(dq, coord, buffer, dq_desc, softmax_scale):
    """Starts the TMA reduction that adds softmax_scale x dq to the fp32 dQ at `coord` through this
    consumer's staging buffer, once the previous one has left it."""
    tma.store_wait(0)
    barrier()  # the thread that issued the last reduction has seen it leave shared memory
    copy_out(dq_desc, coord, buffer, dq * softmax_scale, True)


@gluon.jit
def _item(w, n_n, seqlen_q, nheads_k, offset, CAUSAL: gl.constexpr, ITEM: gl.constexpr,
          ALTERNATE: gl.constexpr = False):
    """(first key, batch, KV head, first and end query tile) of work item w: ITEM keys. The key
    tiles of one (batch, KV head) are consecutive items. Under a causal mask the query tiles above
    the first key's diagonal are skipped, and (also with ALTERNATE: a block mask) heavy and light key
    tiles alternate (the first, the last, the second, ...), so that a pair of items costs about the
    same everywhere."""
    tile = w % n_n
    bhk = w // n_n
    if CAUSAL or ALTERNATE:
        tile = gl.where(tile % 2 == 0, tile // 2, n_n - 1 - tile // 2)
    start_n = tile * ITEM
    lo = 0
    if CAUSAL:
        lo = gl.maximum(start_n - offset, 0) // ROWS
    return start_n, bhk // nheads_k, bhk % nheads_k, lo, gl.cdiv(seqlen_q, ROWS)


@gluon.jit
def _load(args, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr, STAGES: gl.constexpr,
          SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, HAS_FULL: gl.constexpr):
    (Q, K, V, DO, AccInit, DK, DV, DQAcc, q_smem, do_smem, k_smem, v_smem, init_smem, kv_ready, kv_free, q_ready,
     do_ready, empty, ds_smem, dq_smem, ds_ready, ds_free, stride_q, stride_k, stride_v, stride_do, stride_dk,
     stride_dv, stride_a, padded_q, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, softmax_scale,
     mods, blocks, q_rest, k_rest) = args
    init_desc = _init_descriptor(AccInit, batch * nheads, padded_q)
    # Q's and K's head dim HEAD_D + HEAD_D_REST in two boxes where it has two parts (common.head_parts)
    q_desc = descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D)
    k_desc = descriptor(K, batch, seqlen_k, nheads_k, stride_k, ROWS, HEAD_D + HEAD_D_REST, HEAD_D)
    q_rest_load, k_rest_load = None, None
    if HEAD_D_REST:
        q_rest_load = (descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D_REST),
                       q_rest)
        k_rest_load = (descriptor(K, batch, seqlen_k, nheads_k, stride_k, ROWS, HEAD_D + HEAD_D_REST, HEAD_D_REST),
                       k_rest)
    do_desc = descriptor(DO, batch, seqlen_q, nheads, stride_do, ROWS, do_smem.shape[2])
    v_desc = descriptor(V, batch, seqlen_k, nheads_k, stride_v, ROWS, v_smem.shape[2])
    ITEM: gl.constexpr = k_smem.shape[0] // kv_ready.shape[0] * ROWS  # keys a work item holds
    n_n, items = tiles_of(seqlen_k, batch, nheads_k, ITEM)
    group = nheads // nheads_k
    it = 0  # query tiles loaded so far: the ring's position
    done = 0  # work items loaded so far
    for c in range(count(items)):
        start_n, off_b, off_hk, lo, hi = _item(work(c), n_n, seqlen_q, nheads_k, offset, CAUSAL, ITEM, SPARSE_KV > 0)
        _load_held(done, k_desc, v_desc, start_n, off_b, off_hk, k_smem, v_smem, kv_ready, kv_free, k_rest_load)
        for g in range(group):
            off_h = off_hk * group + g
            bh = off_b * nheads + off_h
            walk = None
            if SPARSE_KV:  # the query tiles the block mask lists for this head
                walk = listed_walk(blocks, off_b, off_h, start_n, SPARSE_KV, SPARSE_Q, HAS_FULL, ROWS)
                lo, hi = 0, walk[0]
            for j in range(lo, hi):
                load_pair(it, q_desc, do_desc, [off_b, tile_key(j, walk, ROWS, SPARSE_Q), off_h, 0], q_smem, do_smem,
                          q_ready, do_ready, empty, STAGES, (init_desc, init_smem, bh, batch * nheads + bh),
                          q_rest_load)
                it += 1
        done += 1


@gluon.jit
def _init_descriptor(AccInit, rows, padded_q):
    """The TMA descriptor of kernels/triton/backward.py's AccInit, (2 x rows, padded_q): the starting values
    of S^T's and dP^T's accumulators for each (batch, head) and query row (-lse / softmax_scale and
    -delta; padding rows read -inf and 0, so their P is 0), a box per 64 query rows."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, ROWS], gl.float32)
    return tma.make_tensor_descriptor(AccInit, [2 * rows, padded_q], [padded_q, 1], [1, ROWS], layout)


@gluon.jit
def _start(row_smem, layout: gl.constexpr):
    """A 64-row accumulator in `layout` whose every column n starts at the n-th value of row_smem
    (shared memory holding one box of _init_descriptor, or columns of it)."""
    COLS: gl.constexpr = row_smem.shape[1]
    row = row_smem.load(layout)  # [1, COLS]
    return gl.broadcast(gl.zeros([ROWS, COLS], gl.float32, layout), row)[1]


@gluon.jit
def _tiles(dk, dv, k, v, q_smem, do_smem, init_smem, q_ready, do_ready, empty, fused, base, first, last, keys,
           offset, qk_scale, item_mods, walk, MASKED: gl.constexpr, FUSED: gl.constexpr, STAGES: gl.constexpr,
           HEAD_D: gl.constexpr, WG: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
           SCORE_MOD: gl.constexpr, SCORE_MOD_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, SPARSE_Q: gl.constexpr = 0):
    """Query tiles [first, last) of one head, tile j in the ring's position base + j (its rows:
    common.tile_key). MASKED applies the causal diagonal. FUSED also adds dQ = dS K to global memory
    (dS for the keys past seqlen_k is not 0, but their K rows are: zero-filled). The accumulators of
    S^T and dP^T start at -lse / softmax_scale and -delta per column, which the loader brings with Q
    and dO: the scores come out shifted by lse, dP^T less delta, and no register holds the 32 values
    per thread that lse and delta take in S^T's layout. With mods (_modded_p) S^T starts at 0 instead."""
    for j in range(first, last):
        stage = (base + j) % STAGES
        phase = ((base + j) // STAGES) & 1
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        mbarrier.wait(q_ready.index(stage), phase)
        if SCORE_MOD is None and MASK_MOD is None:
            s = warpgroup_mma(k, q.permute((1, 0)), _start(init_smem.index(2 * stage), s_layout), is_async=True)
        else:
            s = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp = warpgroup_mma(v, do.permute((1, 0)), _start(init_smem.index(2 * stage + 1), s_layout), is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if SCORE_MOD is None and MASK_MOD is None:
            x = s * qk_scale
            if MASKED:  # query row i sees key n where n <= i + offset
                cols = j * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
                x = gl.where(gl.expand_dims(cols + offset, 0) >= gl.expand_dims(keys, 1), x, float("-inf"))
            p = gl.exp2(x)
        else:
            cols = tile_key(j, walk, ROWS, SPARSE_Q) + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
            x, p = _modded_p(s, init_smem.index(2 * stage), keys, cols, offset, item_mods, MASKED, s_layout,
                             SCORE_MOD, MASK_MOD)
        dv = warpgroup_mma(gl.convert_layout(p.to(q.dtype), a_layout), do, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp,))
        ds = p * dp
        if SCORE_MOD is not None:  # the gradient of the mod's input; its captured tensors' added to theirs
            ds = SCORE_MOD_GRAD(x, item_mods[0], item_mods[1], gl.expand_dims(cols, 0), gl.expand_dims(keys, 1),
                                item_mods[2], ds, item_mods[5])
        ds = ds.to(q.dtype)
        if FUSED:
            _share_ds(ds, base + j, fused, HEAD_D, WG)
        if FUSED and HEAD_D == 2 * ROWS:
            dk = _dq_then_dk(gl.convert_layout(ds, a_layout), q, dk, base + j, tile_key(j, walk, ROWS, SPARSE_Q), fused,
                             WG, s_layout)
        else:
            dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(empty.index(stage), count=1)
        if FUSED and HEAD_D == ROWS:
            _add_dq(base + j, tile_key(j, walk, ROWS, SPARSE_Q), fused, WG, s_layout)
    return dk, dv


@gluon.jit
def _modded_p(s, init_smem, keys, cols, offset, item_mods, MASKED: gl.constexpr, s_layout: gl.constexpr,
              SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr):
    """P^T of a tile under mods, from S^T = K Q^T (keys `keys` by query rows `cols`): (the score_mod's
    input, the scaled score x, and P^T = exp(mod(x) - lse)), at 0 the mask_mod's hidden keys, those past
    the causal diagonal (MASKED), past seqlen_k and of rows past seqlen_q (so that no gradient reaches a
    captured tensor from them; a block mask's last query block may list tiles past AccInit's padded rows,
    whose boxes read 0, not -lse). item_mods = (batch, head, score_mod's and mask_mod's arguments,
    seqlen_k, gradient buffers, softmax_scale, seqlen_q); init_smem: -lse / softmax_scale per column
    (_start)."""
    b, h, score_args, mask_args, seqlen_k, softmax_scale, seqlen_q = (
        item_mods[0], item_mods[1], item_mods[2], item_mods[3], item_mods[4], item_mods[6], item_mods[7])
    q_idx = gl.expand_dims(cols, 0)
    kv_idx = gl.expand_dims(keys, 1)
    x = s * softmax_scale
    y = x
    if SCORE_MOD is not None:
        y = SCORE_MOD(x, b, h, q_idx, kv_idx, score_args)
    visible = (kv_idx < seqlen_k) & (q_idx < seqlen_q)
    if MASK_MOD is not None:
        visible = visible & MASK_MOD(b, h, q_idx, kv_idx, mask_args)
    if MASKED:  # query row i sees key n where n <= i + offset
        visible = visible & (q_idx + offset >= kv_idx)
    y = gl.where(visible, y, float("-inf"))
    return x, gl.exp2((y + _start(init_smem, s_layout) * softmax_scale) * LOG2E)


@gluon.jit
def _pds_buffers(dtype: gl.constexpr):
    """The split-D consumers' shared memory for P^T and dS^T: two tiles' worth (alternating), each
    both consumers' halves of both (64 keys by 32 query rows; index 4 x tile + 2 x (0: P^T, 1: dS^T)
    + consumer), and per tile buffer a "ready" (both consumers' halves written) and a "free" (both
    consumers' products read them) barrier."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS // 2], dtype)
    return gl.allocate_shared_memory(dtype, [8, ROWS, ROWS // 2], layout), barriers(2, 2), barriers(2, 2)


@gluon.jit
def _split_d_tiles(dk, dv, ks, v, qs, do_smem, init_smem, q_ready, do_ready, empty, pds, base, first, last, keys,
                   offset, qk_scale, MASKED: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
                   s_layout: gl.constexpr):
    """_tiles where one consumer's registers cannot hold a 64-key dK and dV (D=256, (192, 128)): both
    consumers hold the item's 64 keys. Per query tile each computes S^T and dP^T of its half of the query
    rows (32), shares its P^T and dS^T through shared memory and, once both halves are there, adds to its
    columns of dV and dK over all 64 rows: dV[:, cols] += P^T dO[:, cols] and dK[:, cols] += dS^T Q[:, cols]
    (the split FlashAttention-3 makes at D=256). ks and qs: K's held tile and Q's ring, each with those of
    the rest of a head dim of two parts (common.head_parts; else None); this consumer's dK columns are then
    a part's (_dk_columns), and S^T accumulates over both parts."""
    pds_smem, pds_ready, pds_free = pds
    HALF: gl.constexpr = ROWS // 2
    DK_COLS: gl.constexpr = dk.shape[1]
    DV_COLS: gl.constexpr = dv.shape[1]
    for j in range(first, last):
        pos = base + j
        stage = pos % STAGES
        phase = (pos // STAGES) & 1
        q = qs[0].index(stage)
        do = do_smem.index(stage)
        mbarrier.wait(q_ready.index(stage), phase)
        s = warpgroup_mma(ks[0], q.slice(WG * HALF, HALF).permute((1, 0)),
                          _start(init_smem.index(2 * stage).slice(WG * HALF, HALF, dim=1), s_layout), is_async=True)
        if qs[1] is not None:
            s = warpgroup_mma(ks[1], qs[1].index(stage).slice(WG * HALF, HALF).permute((1, 0)), s, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp = warpgroup_mma(v, do.slice(WG * HALF, HALF).permute((1, 0)),
                           _start(init_smem.index(2 * stage + 1).slice(WG * HALF, HALF, dim=1), s_layout),
                           is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        x = s * qk_scale
        if MASKED:  # query row i sees key n where n <= i + offset
            cols = j * ROWS + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
            x = gl.where(gl.expand_dims(cols + offset, 0) >= gl.expand_dims(keys, 1), x, float("-inf"))
        p = gl.exp2(x)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * dp
        buf = pos % 2
        mbarrier.wait(pds_free.index(buf), ((pos // 2) & 1) ^ 1)
        pds_smem.index(4 * buf + WG).store(p.to(v.dtype))
        pds_smem.index(4 * buf + 2 + WG).store(ds.to(v.dtype))
        fence_async_shared()
        barrier()  # every thread's part written before the one arrival
        mbarrier.arrive(pds_ready.index(buf), count=1)
        mbarrier.wait(pds_ready.index(buf), (pos // 2) & 1)
        for half in gl.static_range(2):
            dv = warpgroup_mma(pds_smem.index(4 * buf + half),
                               do.slice(half * HALF, HALF).slice(WG * DV_COLS, DV_COLS, dim=1), dv, is_async=True)
            dk = warpgroup_mma(pds_smem.index(4 * buf + 2 + half), _dk_columns(qs, stage, half, DK_COLS, WG),
                               dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(empty.index(stage), count=1)
        mbarrier.arrive(pds_free.index(buf), count=1)
    return dk, dv


@gluon.jit
def _dk_columns(qs, stage, half, COLS: gl.constexpr, WG: gl.constexpr):
    """The rows of Q's ring buffer `stage` of query half `half` (of 2 x 32), in this split-D consumer's dK
    columns (_consume's DK_COLS): half of Q's columns, or of a head dim of two parts (qs[1] not None) the
    first part (consumer 0) or the rest (consumer 1)."""
    HALF: gl.constexpr = ROWS // 2
    if qs[1] is None:
        part = qs[0].index(stage).slice(half * HALF, HALF).slice(WG * COLS, COLS, dim=1)
    elif WG == 0:
        part = qs[0].index(stage).slice(half * HALF, HALF)
    else:
        part = qs[1].index(stage).slice(half * HALF, HALF)
    return part


@gluon.jit
def _store_cols(T, strides, off_b, off_hk, start_n, seqlen_k, tile, COL0: gl.constexpr, layout: gl.constexpr):
    """Stores a consumer's columns [COL0, COL0 + tile's) of a 64-key dK or dV tile (rows past seqlen_k
    cut off) straight from its registers: once per work item, so no shared memory is set aside for it."""
    COLS: gl.constexpr = tile.shape[1]
    rows = start_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    base = T + off_b.to(gl.int64) * strides[0] + off_hk.to(gl.int64) * strides[2]
    ptrs = base + gl.expand_dims(rows.to(gl.int64) * strides[1], 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, tile.to(T.dtype.element_ty), mask=gl.expand_dims(rows < seqlen_k, 1))


@gluon.jit
def _split_d_item(args, kb, keys, lo, full, hi, base, start_n, off_b, off_hk, group, HEAD_D: gl.constexpr,
                  HEAD_D_REST: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, s_layout: gl.constexpr):
    """A split-D consumer's work item in K/V buffer kb: every head's query tiles (_split_d_tiles) from ring
    position base + lo on (the masked ones before `full`), then K and V back to the loader and this
    consumer's columns of dK and dV stored; returns base past them. Its columns: half of dV's, and half of
    dK's or, of a head dim of two parts (HEAD_D_REST > 0: 192 = 128 + 64), the first part (consumer 0) or
    the rest (consumer 1)."""
    (Q, K, V, DO, AccInit, DK, DV, DQAcc, q_smem, do_smem, k_smem, v_smem, init_smem, kv_ready, kv_free, q_ready,
     do_ready, empty, ds_smem, dq_smem, ds_ready, ds_free, stride_q, stride_k, stride_v, stride_do, stride_dk,
     stride_dv, stride_a, padded_q, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, softmax_scale,
     mods, blocks, q_rest, k_rest) = args
    DK_COLS: gl.constexpr = HEAD_D // 2 if HEAD_D_REST == 0 else HEAD_D if WG == 0 else HEAD_D_REST
    DK_COL0: gl.constexpr = WG * (HEAD_D // 2 if HEAD_D_REST == 0 else HEAD_D)
    DV_COLS: gl.constexpr = v_smem.shape[2] // 2
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DK_COLS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DV_COLS, 16])
    dk = gl.zeros([ROWS, DK_COLS], gl.float32, dk_layout)
    dv = gl.zeros([ROWS, DV_COLS], gl.float32, dv_layout)
    ks = (k_smem.index(kb), None)  # (with the rest of a head dim of two parts: _split_d_tiles')
    if HEAD_D_REST:
        ks = (k_smem.index(kb), k_rest.index(kb))
    v = v_smem.index(kb)
    qs = (q_smem, q_rest)
    pds = (ds_smem, ds_ready, ds_free)
    for g in range(group):
        dk, dv = _split_d_tiles(dk, dv, ks, v, qs, do_smem, init_smem, q_ready, do_ready, empty, pds, base, lo, full,
                                keys, offset, qk_scale, True, STAGES, WG, s_layout)
        dk, dv = _split_d_tiles(dk, dv, ks, v, qs, do_smem, init_smem, q_ready, do_ready, empty, pds, base, full, hi,
                                keys, offset, qk_scale, False, STAGES, WG, s_layout)
        base += hi - lo
    # This consumer's products are done with K and V: the loader may fetch the next item's while its
    # columns of dK and dV are stored straight from the registers.
    mbarrier.arrive(kv_free.index(kb), count=1)
    _store_cols(DV, stride_dv, off_b, off_hk, start_n, seqlen_k, dv, WG * DV_COLS, dv_layout)
    _store_cols(DK, stride_dk, off_b, off_hk, start_n, seqlen_k, dk * softmax_scale, DK_COL0, dk_layout)
    return base


@gluon.jit
def _consume(args, CAUSAL: gl.constexpr, FUSED: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
             STAGES: gl.constexpr, WG: gl.constexpr, SPLIT_D: gl.constexpr, SCORE_MOD: gl.constexpr,
             SCORE_MOD_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
             HAS_FULL: gl.constexpr):
    """A consumer warpgroup's work items: each takes its own 64 of an item's 128 keys and all of dK's
    and dV's columns (_tiles), or with SPLIT_D both take the item's 64 keys and half the columns each
    (_split_d_tiles; no mods there: plan.py; of a head dim of two parts, HEAD_D_REST > 0 (192 = 128 + 64),
    dK's first part or its rest). Per head sharing the KV head, the query tiles that see part of the keys
    (the causal diagonal; a block mask's partly seen tiles, through the mask_mod) and those that see all
    (a block mask's wholly seen ones, without it)."""
    (Q, K, V, DO, AccInit, DK, DV, DQAcc, q_smem, do_smem, k_smem, v_smem, init_smem, kv_ready, kv_free, q_ready,
     do_ready, empty, ds_smem, dq_smem, ds_ready, ds_free, stride_q, stride_k, stride_v, stride_do, stride_dk,
     stride_dv, stride_a, padded_q, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, softmax_scale,
     mods, blocks, q_rest, k_rest) = args
    PARTS: gl.constexpr = k_smem.shape[0] // kv_ready.shape[0]  # 64-key tiles a work item holds (as _load)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS // 2 if SPLIT_D else ROWS, 16])
    # (unsplit: dK and dV have one head dim, kernels/gluon/__init__.py's accepts; split D: _split_d_item's)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if FUSED:
        dq_desc = descriptor(DQAcc, batch, seqlen_q, nheads, stride_a, ROWS, HEAD_D, ROWS)
    if not SPLIT_D:
        dk_desc = descriptor(DK, batch, seqlen_k, nheads_k, stride_dk, ROWS, HEAD_D)
        dv_desc = descriptor(DV, batch, seqlen_k, nheads_k, stride_dv, ROWS, HEAD_D)
    # The loader's schedule, item for item and tile for tile: the barriers' phases count on it.
    n_n, items = tiles_of(seqlen_k, batch, nheads_k, PARTS * ROWS)
    KV_BUFFERS: gl.constexpr = kv_ready.shape[0]
    group = nheads // nheads_k
    it = 0  # query tiles consumed so far: the ring's position
    done = 0  # work items done so far
    for c in range(count(items)):
        start_n, off_b, off_hk, lo, hi = _item(work(c), n_n, seqlen_q, nheads_k, offset, CAUSAL, PARTS * ROWS,
                                               SPARSE_KV > 0)
        key0 = start_n + (0 if SPLIT_D else WG * ROWS)  # this warpgroup's first key
        keys = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        # Query tiles before `full` hold rows that do not see every key of this warpgroup.
        full = lo
        if CAUSAL:
            full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(key0 + ROWS - 1 - offset, 0), ROWS), lo), hi)
        dk = gl.zeros([ROWS, HEAD_D], gl.float32, acc_layout)
        dv = gl.zeros([ROWS, HEAD_D], gl.float32, acc_layout)
        kb = done % KV_BUFFERS
        k = k_smem.index(PARTS * kb + (0 if SPLIT_D else WG))
        v = v_smem.index(PARTS * kb + (0 if SPLIT_D else WG))
        mbarrier.wait(kv_ready.index(kb), (done // KV_BUFFERS) & 1)
        base = it - lo  # tile j of head g at ring position it + (the tiles of heads before g) + j - lo
        if SPLIT_D:
            base = _split_d_item(args, kb, keys, lo, full, hi, base, start_n, off_b, off_hk, group, HEAD_D,
                                 HEAD_D_REST, STAGES, WG, s_layout)
        else:
            for g in range(group):
                off_h = off_hk * group + g
                fused = None
                if FUSED:
                    fused = (ds_smem, dq_smem, ds_ready, ds_free, dq_desc, k_smem, kb, off_b, off_h, softmax_scale)
                item_mods = (off_b, off_h, mods[0], mods[1], seqlen_k, mods[2], softmax_scale, seqlen_q)
                if SPARSE_KV:  # (the loader's walk)
                    walk = listed_walk(blocks, off_b, off_h, start_n, SPARSE_KV, SPARSE_Q, HAS_FULL, ROWS)
                    dk, dv = _tiles(dk, dv, k, v, q_smem, do_smem, init_smem, q_ready, do_ready, empty, fused, base,
                                    0, walk[1], keys, offset, qk_scale, item_mods, walk, False, FUSED, STAGES, HEAD_D,
                                    WG, s_layout, a_layout, SCORE_MOD, SCORE_MOD_GRAD, MASK_MOD, SPARSE_Q)
                    dk, dv = _tiles(dk, dv, k, v, q_smem, do_smem, init_smem, q_ready, do_ready, empty, fused, base,
                                    walk[1], walk[0], keys, offset, qk_scale, item_mods, walk, False, FUSED, STAGES,
                                    HEAD_D, WG, s_layout, a_layout, SCORE_MOD, SCORE_MOD_GRAD, None, SPARSE_Q)
                    base += walk[0]
                else:
                    dk, dv = _tiles(dk, dv, k, v, q_smem, do_smem, init_smem, q_ready, do_ready, empty, fused, base,
                                    lo, full, keys, offset, qk_scale, item_mods, None, True, FUSED, STAGES, HEAD_D,
                                    WG, s_layout, a_layout, SCORE_MOD, SCORE_MOD_GRAD, MASK_MOD)
                    dk, dv = _tiles(dk, dv, k, v, q_smem, do_smem, init_smem, q_ready, do_ready, empty, fused, base,
                                    full, hi, keys, offset, qk_scale, item_mods, None, False, FUSED, STAGES, HEAD_D,
                                    WG, s_layout, a_layout, SCORE_MOD, SCORE_MOD_GRAD, MASK_MOD)
                    base += hi - lo
        it = base + lo
        if not SPLIT_D:
            if FUSED:  # the other consumer's dQ products of the last tile read this one's K tile
                if HEAD_D == 2 * ROWS:
                    meet()
                elif it > 0:
                    mbarrier.wait(ds_free.index((it - 1) % 2), ((it - 1) // 2) & 1)
            # dK and dV leave through this consumer's K and V tiles, which go back to the loader
            # once the copies have read them.
            copy_out(dv_desc, [off_b, key0, off_hk, 0], v, dv.to(DV.dtype.element_ty))
            copy_out(dk_desc, [off_b, key0, off_hk, 0], k, (dk * softmax_scale).to(DK.dtype.element_ty))
            tma.store_wait(0)
            barrier()  # the thread that issued the copies has seen them read the tiles
            mbarrier.arrive(kv_free.index(kb), count=1)
        done += 1


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, AccInit, DK, DV, DQAcc, BlockNum, BlockIdx, FullNum, FullIdx, score_args,
                          mask_args, score_grads,
                          stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, stride_a, stride_blocks,
                          padded_q, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, softmax_scale,
                          CAUSAL: gl.constexpr, FUSED: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
                          HEAD_DV: gl.constexpr, STAGES: gl.constexpr, KV_BUFFERS: gl.constexpr,
                          SPLIT_D: gl.constexpr, CONSUMER_REGS: gl.constexpr, SCORE_MOD: gl.constexpr,
                          SCORE_MOD_GRAD: gl.constexpr, MASK_MOD: gl.constexpr, HAS_FULL: gl.constexpr,
                          SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr):
    # SPLIT_D (dkdv_launch): both consumers take the same 64 keys, each half of dK's and dV's columns (of
    # a head dim of two parts, HEAD_D + HEAD_D_REST (common.head_parts), dK's first part or its rest);
    # else each takes its own 64 of an item's 128. Q's and K's head dim HEAD_D (+ HEAD_D_REST, each part
    # in buffers of its own), V's and dO's HEAD_DV.
    # kv_free: both consumers' dK and dV have left the item's K/V buffer (split D: both are done with it).
    # (A block mask's walk starts every head's query tiles at 0: no causal range beside it; plan.py.)
    gl.static_assert(not (CAUSAL and SPARSE_KV > 0), "a block mask with causal=True")
    gl.static_assert(SPLIT_D or (HEAD_D_REST == 0 and HEAD_DV == HEAD_D), "unsplit: one head dim, one part")
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem, v_smem, q_smem, do_smem, kv_ready, kv_free, q_ready, do_ready, empty = _buffers(
        dtype, HEAD_D, HEAD_DV, ROWS, STAGES, KV_BUFFERS, 1 if SPLIT_D else 2)
    q_rest, k_rest = None, None
    if HEAD_D_REST:
        q_rest = buffers(dtype, STAGES, ROWS, HEAD_D_REST)
        k_rest = buffers(dtype, KV_BUFFERS, ROWS, HEAD_D_REST)
    # Per ring buffer, the boxes of AccInit that come with its Q and its dO.
    init_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, ROWS],
                                          gl.NVMMASharedLayout.get_default_for([1, ROWS], gl.float32))
    # ds_smem, ds_ready, ds_free: the fused kernel's dS^T tiles and, at D=64 (_share_ds), per dS^T buffer a
    # "ready" and a "free" barrier that both consumers arrive at (their half written; their dQ product read
    # it, or they have none); or the split-D consumers' P^T and dS^T.
    ds_smem, dq_smem, ds_ready, ds_free = None, None, None, None
    if FUSED:
        ds_smem, dq_smem = _dq_buffers(Q.dtype.element_ty)
        if HEAD_D == ROWS:
            ds_ready, ds_free = barriers(2, 2), barriers(2, 2)
    if SPLIT_D:
        ds_smem, ds_ready, ds_free = _pds_buffers(Q.dtype.element_ty)
    args = (Q, K, V, DO, AccInit, DK, DV, DQAcc, q_smem, do_smem, k_smem, v_smem, init_smem, kv_ready, kv_free,
            q_ready, do_ready, empty, ds_smem, dq_smem, ds_ready, ds_free, stride_q, stride_k, stride_v, stride_do,
            stride_dk, stride_dv, stride_a, padded_q, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale,
            softmax_scale, (score_args, mask_args, score_grads), (BlockNum, BlockIdx, FullNum, FullIdx, stride_blocks),
            q_rest, k_rest)
    gl.warp_specialize([(_consume, (args, CAUSAL, FUSED, HEAD_D, HEAD_D_REST, STAGES, 0, SPLIT_D, SCORE_MOD,
                                    SCORE_MOD_GRAD, MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL)),
                        (_consume, (args, CAUSAL, FUSED, HEAD_D, HEAD_D_REST, STAGES, 1, SPLIT_D, SCORE_MOD,
                                    SCORE_MOD_GRAD, MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL)),
                        (_load, (args, CAUSAL, HEAD_D, HEAD_D_REST, STAGES, SPARSE_Q, SPARSE_KV, HAS_FULL))], [4, 1],
                       [CONSUMER_REGS, 24])


@gluon.jit
def _dq_load(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
             STAGES: gl.constexpr):
    (Q, K, V, DO, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_free, k_ready, v_ready, kv_empty,
     stride_q, stride_k, stride_v, stride_do, stride_dq, stride_l, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset,
     qk_scale, softmax_scale, q_rest, k_rest) = args
    # Q's and K's head dim HEAD_D + HEAD_D_REST in two boxes where it has two parts (common.head_parts)
    q_desc = descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D)
    k_desc = descriptor(K, batch, seqlen_k, nheads_k, stride_k, BLOCK_N, HEAD_D + HEAD_D_REST, HEAD_D)
    q_rest_load, k_rest_load = None, None
    if HEAD_D_REST:
        q_rest_load = (descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D_REST),
                       q_rest)
        k_rest_load = (descriptor(K, batch, seqlen_k, nheads_k, stride_k, BLOCK_N, HEAD_D + HEAD_D_REST,
                                  HEAD_D_REST), k_rest)
    do_desc = descriptor(DO, batch, seqlen_q, nheads, stride_do, ROWS, do_smem.shape[2])
    v_desc = descriptor(V, batch, seqlen_k, nheads_k, stride_v, BLOCK_N, v_smem.shape[2])
    n_m, items = tiles_of(seqlen_q, batch, nheads, 2 * ROWS)
    it = 0  # K/V tiles loaded so far: the ring's position
    done = 0  # work items loaded so far
    for c in range(count(items)):
        start_m, off_b, off_h, n_tiles = query_item(work(c), n_m, nheads, seqlen_k, offset, CAUSAL, BLOCK_N, 2)
        off_hk = off_h // (nheads // nheads_k)
        _load_held(done, q_desc, do_desc, start_m, off_b, off_h, q_smem, do_smem, qdo_ready, qdo_free, q_rest_load)
        it = load_kv(it, n_tiles, k_desc, v_desc, off_b, off_hk, k_smem, v_smem, k_ready, v_ready, kv_empty,
                     BLOCK_N, STAGES, k_rest=k_rest_load)
        done += 1


@gluon.jit
def _dq_tiles(dq, qs, do, ks, v_smem, k_ready, v_ready, kv_empty, lse, delta, base, first, last, end, rows,
              offset, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr, a_layout: gl.constexpr):
    """K/V tiles [first, last) of a work item whose tile 0 sits at position `base` of the buffer ring;
    each goes back to the loader once done, but the one at position `end`. MASKED applies the causal
    diagonal. Keys past seqlen_k need no mask: their K rows are zero-filled, so they add nothing to dQ.
    qs, ks: Q's held tile and K's ring, each with those of the rest of a head dim of two parts (else
    None); dq: dQ's accumulator, or with two parts the pair of the parts' accumulators."""
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    for j in range(first, last):
        stage = (base + j) % STAGES
        phase = ((base + j) // STAGES) & 1
        k = ks[0].index(stage)
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(qs[0], k.permute((1, 0)), zero, use_acc=False, is_async=True)
        if qs[1] is not None:
            s = warpgroup_mma(qs[1], ks[1].index(stage).permute((1, 0)), s, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do, v_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if MASKED:  # query row i sees key n where n <= i + offset
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows + offset, 1), s, float("-inf"))
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(lse, 1)))
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(k.dtype), a_layout)
        if qs[1] is None:
            dq = warpgroup_mma(ds, k, dq)
        else:
            dq_first = warpgroup_mma(ds, k, dq[0], is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_first, warpgroup_mma(ds, ks[1].index(stage), dq[1], is_async=True)))
        if base + j != end:
            mbarrier.arrive(kv_empty.index(stage), count=1)
    return dq


@gluon.jit
def _dq_consume(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
                STAGES: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup's work items: its 64 of an item's query rows against every K/V tile. dQ leaves
    through the item's last V tile (both consumers' rows), or with a head dim of two parts (HEAD_D_REST >
    0: 192 = 128 + 64; 64-key V tiles, narrower) through this consumer's own Q tiles, which hold its
    shape."""
    (Q, K, V, DO, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_free, k_ready, v_ready, kv_empty,
     stride_q, stride_k, stride_v, stride_do, stride_dq, stride_l, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset,
     qk_scale, softmax_scale, q_rest, k_rest) = args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dq_desc = descriptor(DQ, batch, seqlen_q, nheads, stride_dq, ROWS, HEAD_D + HEAD_D_REST, HEAD_D)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    qs, ks = (q, None), (k_smem, None)
    if HEAD_D_REST:
        rest_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, HEAD_D_REST, 16])
        dq_rest_desc = descriptor(DQ, batch, seqlen_q, nheads, stride_dq, ROWS, HEAD_D + HEAD_D_REST, HEAD_D_REST)
        qs, ks = (q, q_rest.index(WG)), (k_smem, k_rest)
    # The loader's schedule, item for item and tile for tile: the barriers' phases count on it.
    n_m, items = tiles_of(seqlen_q, batch, nheads, 2 * ROWS)
    it = 0  # K/V tiles consumed so far: the ring's position
    done = 0  # work items done so far
    for c in range(count(items)):
        start_m, off_b, off_h, n_tiles = query_item(work(c), n_m, nheads, seqlen_k, offset, CAUSAL, BLOCK_N, 2)
        row0 = start_m + WG * ROWS
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        row_ptrs = off_b.to(gl.int64) * stride_l[0] + off_h.to(gl.int64) * stride_l[1] + rows
        # Rows past seqlen_q read lse = +inf: their P is 0.
        lse = gl.load(Lse + row_ptrs, mask=rows < seqlen_q, other=float("inf")) * LOG2E
        delta = gl.load(Delta + row_ptrs, mask=rows < seqlen_q, other=0.0)
        # Tiles every row of this warpgroup sees whole (below its first row's diagonal) come first.
        n_full = n_tiles
        if CAUSAL:
            n_full = gl.minimum(gl.maximum(row0 + offset + 1, 0) // BLOCK_N, n_tiles)
        dq = gl.zeros([ROWS, HEAD_D], gl.float32, acc_layout)
        if HEAD_D_REST:
            dq = (dq, gl.zeros([ROWS, HEAD_D_REST], gl.float32, rest_layout))
            end = -1  # (every K/V buffer goes back once done)
        else:
            end = it + n_tiles - 1  # the item's last K/V buffer, which dQ leaves through
        mbarrier.wait(qdo_ready.index(0), done & 1)
        dq = _dq_tiles(dq, qs, do, ks, v_smem, k_ready, v_ready, kv_empty, lse, delta, it, 0, n_full, end, rows,
                       offset, qk_scale, False, BLOCK_N, STAGES, s_layout, a_layout)
        dq = _dq_tiles(dq, qs, do, ks, v_smem, k_ready, v_ready, kv_empty, lse, delta, it, n_full, n_tiles, end,
                       rows, offset, qk_scale, True, BLOCK_N, STAGES, s_layout, a_layout)
        if HEAD_D_REST:
            # dQ's parts leave through this consumer's Q tiles (only its own products read them, all done),
            # which go back to the loader with dO once the copies have read them.
            copy_out(dq_desc, [off_b, row0, off_h, 0], q, (dq[0] * softmax_scale).to(DQ.dtype.element_ty))
            copy_out(dq_rest_desc, [off_b, row0, off_h, HEAD_D], qs[1], (dq[1] * softmax_scale).to(DQ.dtype.element_ty))
            tma.store_wait(0)
            barrier()  # the thread that issued the copies has seen them read the tiles
            mbarrier.arrive(qdo_free.index(0), count=1)
        else:
            # Q and dO go back to the loader, which fetches the next item's while this one finishes;
            # once both consumers have released them, no product reads the last K/V buffer either:
            # dQ leaves through its V tile, which then goes back too.
            mbarrier.arrive(qdo_free.index(0), count=1)
            mbarrier.wait(qdo_free.index(0), done & 1)
            copy_out(dq_desc, [off_b, row0, off_h, 0], v_smem.index(end % STAGES),
                     (dq * softmax_scale).to(DQ.dtype.element_ty), PART=WG)
            tma.store_wait(0)
            barrier()  # the thread that issued the copy has seen it read the tile
            mbarrier.arrive(kv_empty.index(end % STAGES), count=1)
        it += n_tiles
        done += 1


@gluon.jit
def _attn_bwd_dq_hopper(Q, K, V, DO, Lse, Delta, DQ,
                        stride_q, stride_k, stride_v, stride_do, stride_dq, stride_l, batch, nheads, nheads_k,
                        seqlen_q, seqlen_k, offset, qk_scale, softmax_scale,
                        CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
                        HEAD_DV: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Q's and K's head dim HEAD_D (+ HEAD_D_REST: a head dim of two parts, common.head_parts, each in
    buffers of its own), V's and dO's HEAD_DV."""
    gl.static_assert(HEAD_D_REST > 0 or (BLOCK_N == 2 * ROWS and HEAD_DV == HEAD_D),
                     "dQ leaves through a V tile: both consumers' rows, as wide as dQ")
    dtype: gl.constexpr = Q.dtype.element_ty
    # qdo_free: both consumers are done with the item's Q and dO.
    q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_free, k_ready, v_ready, kv_empty = _buffers(
        dtype, HEAD_D, HEAD_DV, BLOCK_N, STAGES, 1)
    q_rest, k_rest = None, None
    if HEAD_D_REST:
        q_rest = buffers(dtype, 2, ROWS, HEAD_D_REST)
        k_rest = buffers(dtype, STAGES, BLOCK_N, HEAD_D_REST)
    args = (Q, K, V, DO, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_free, k_ready, v_ready,
            kv_empty, stride_q, stride_k, stride_v, stride_do, stride_dq, stride_l, batch, nheads, nheads_k, seqlen_q,
            seqlen_k, offset, qk_scale, softmax_scale, q_rest, k_rest)
    gl.warp_specialize([(_dq_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, 0)),
                        (_dq_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, 1)),
                        (_dq_load, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES))], [4, 1],
                       [CONSUMER_REGS, 24])


def _shared_args(tensors: dict, prob: Problem, params: AttentionParams) -> dict:
    q, k, v, dout = (tensors[name] for name in ("Q", "K", "V", "DO"))
    triton.set_allocator(scratch)  # the kernels build their tensor descriptors in global scratch
    qk_scale = logit_scale(params)
    return dict(Q=q, K=k, V=v, DO=dout,
                stride_q=box_strides(prob, q), stride_k=box_strides(prob, k), stride_v=box_strides(prob, v),
                stride_do=box_strides(prob, dout), batch=prob.batch, nheads=prob.nheads,
                nheads_k=prob.nheads_k, seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k,
                offset=(prob.seqlen_k - prob.seqlen_q) * params.bottom_right, qk_scale=qk_scale,
                softmax_scale=params.softmax_scale, CAUSAL=params.window_right == 0,
                # 9 warps run as 3 warpgroups of 168 registers a thread, which the partitions
                # trade: 240 each for the consumers, 24 for the loader.
                CONSUMER_REGS=240, num_warps=4, maxnreg=168)


def dkdv_launch(tensors: dict, prob: Problem, params: AttentionParams, cfg: Dkdv):
    """(kernel, grid, keyword arguments) of the dK/dV kernel for kernels/launch.py: a work item
    per 128 keys (D=256, (192, 128): 64) of a (batch, KV head), one persistent program per SM taking pairs
    of items round-robin; 64-row query tiles in a ring of cfg.stages buffers; tensors["AccInit"] as
    kernels/triton/backward.py's delta kernel writes it. With cfg.fuse_dq, the kernel also adds dQ to
    tensors["DQAcc"] (fp32, shaped like Q, zero-filled)."""
    dk, dv, init = tensors["DK"], tensors["DV"], tensors["AccInit"]
    acc = tensors["DQAcc"] if cfg.fuse_dq else None
    # Beyond D=128 a consumer's registers hold half a 64-key dK and dV: split-D consumers.
    split_d = prob.head_dim > 128
    if acc is not None and split_d:
        raise ValueError("the Gluon dK/dV kernel fuses dQ up to head dim 128")
    item_keys = ROWS.value if split_d else 2 * ROWS.value
    items = cdiv(prob.seqlen_k, item_keys) * prob.batch * prob.nheads_k
    width = prob.head_dim + prob.head_dim_v  # (a row of K and V, of Q and dO)

    def smem(kv_buffers):  # bytes: K/V buffers, the Q/dO ring, P^T and dS^T (split D) or dS^T and dQ (fused)
        shared = 32768 if split_d else 65536 if acc is not None else 0
        return (kv_buffers * item_keys + cfg.stages * ROWS.value) * width * 2 + shared + cfg.stages * 512
    # Two K/V buffers (the loader fetches the next item's K and V during the last one) where shared
    # memory holds them: not the fused kernel at D=128 (one: 192 of 227 KB), nor split D at D=256 (one:
    # 224 KB); at (192, 128) two (193 KB).
    kv_buffers = 2 if smem(2) <= 227 * 1024 else 1
    if smem(kv_buffers) > 227 * 1024:
        raise ValueError(f"the Gluon dK/dV kernel's buffers take {smem(kv_buffers)} bytes of shared memory, over "
                         f"227 KB: fewer than {cfg.stages} Q/dO buffers")
    head_d, head_d_rest = head_parts(prob.head_dim)
    acc_strides = box_strides(prob, acc) if acc is not None else (0, 0, 0)
    mods = mod_args(params, prob, "dkdv")
    del mods["SPARSE"], mods["EVEN_BLOCKS"]  # (SPARSE_KV > 0; _modded_p checks both bounds)
    return _attn_bwd_dkdv_hopper, (min(cdiv(items, 2), num_sms(dk.device)),), dict(
        **mods, **_shared_args(tensors, prob, params), AccInit=init, padded_q=init.shape[2], DK=dk, DV=dv, DQAcc=acc,
        stride_dk=box_strides(prob, dk), stride_dv=box_strides(prob, dv), stride_a=acc_strides,
        FUSED=cfg.fuse_dq, STAGES=cfg.stages, KV_BUFFERS=kv_buffers, SPLIT_D=split_d, HEAD_D=head_d,
        HEAD_D_REST=head_d_rest, HEAD_DV=prob.head_dim_v)


def dq_launch(tensors: dict, prob: Problem, params: AttentionParams, cfg: Dq):
    """(kernel, grid, keyword arguments) of the dQ kernel for kernels/launch.py: a work item per
    2 x 64 query rows of a (batch, head), one persistent program per SM taking pairs of items
    round-robin (the forward's schedule); cfg.block_n-key K/V tiles in a ring of cfg.stages buffers."""
    dq = tensors["DQ"]
    items = cdiv(prob.seqlen_q, 2 * ROWS.value) * prob.batch * prob.nheads
    grid = (min(cdiv(items, 2), num_sms(dq.device)),)
    head_d, head_d_rest = head_parts(prob.head_dim)
    return _attn_bwd_dq_hopper, grid, dict(
        **_shared_args(tensors, prob, params), Lse=tensors["Lse"], Delta=tensors["Delta"],
        stride_l=lse_strides(prob, params), DQ=dq, stride_dq=box_strides(prob, dq), BLOCK_N=cfg.block_n,
        STAGES=cfg.stages, HEAD_D=head_d, HEAD_D_REST=head_d_rest, HEAD_DV=prob.head_dim_v)
