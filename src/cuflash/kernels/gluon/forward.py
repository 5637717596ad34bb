"""Forward pass for Hopper in Gluon: warp-specialized, two or three consumer warpgroups
(FlashAttention-3's structure, written with Triton's Gluon dialect).

A work item is CONSUMERS x 64 query rows of one (batch, head) (2 or 3 consumers); a program runs
pairs of items round-robin (persistent). The partitions share the program's shared memory:
- the loader (one warp) copies each item's Q tile (into one of Q_BUFFERS buffers) and its K/V
  tiles into a ring of STAGES buffers with the tensor memory accelerator, each load signalling a
  "ready" barrier; it runs ahead into the next item while the consumers finish the last;
- the consumer warpgroups, each owning 64 of the rows, run S = Q K^T, the online softmax and
  O += P V on the tensor cores (wgmma; P from registers), then release the K/V buffer on an
  "empty" barrier that all must arrive at (with early_k, the K buffer on one of its own as soon as
  the S products have read it); each writes its rows of O into shared memory it no
  longer reads (its part of the Q buffer, or with a single Q buffer, which goes back to the loader
  once every consumer's last S is done, the item's last K tile where that has O's shape), which the
  tensor memory accelerator copies to global memory, and then releases that buffer the same way.
The consumers run independent instruction streams, so one's softmax overlaps the others' matrix
products; with `turns` (D=64 and 128, 128-key tiles) they issue their products in turn, round-robin
on hardware barriers (common.take_turn), so that the softmax phases stay apart; within a consumer,
the product P V of one tile runs while the softmax of the next is computed. Tile-level Triton (one
instruction stream per program, each dot awaited before its result is used) expresses neither.

Logits are in base 2 (qk_scale has LOG2E folded in). Only the plain forward is here: 16-bit
inputs, head dims 64, 128 and 256, causal or not (either alignment), GQA; other inputs take the Triton
kernel (kernels/triton/forward.py). GPU only: Triton's interpreter does not run Gluon.

At (192, 128) (DeepSeek's MLA: q and k 192 wide, v 128) Q and K are held as 128 + 64 columns
(common.head_parts: Gluon's tensors and shared memory are powers of two), each part in buffers of its
own, loaded by boxes of its own, and S = Q K^T is two wgmma products accumulating; V and O are 128 wide,
as Q's and K's first part, through which O leaves as at D=128.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ...params import AttentionParams
from ..compat import barrier, tma_load
from ..constants import LN2, LOG2E
from ..device import cdiv, num_sms, scratch
from ..variant import Problem, logit_scale, lse_strides, mod_args
from . import Forward
from .common import ROWS, barriers, box_strides, buffers, copy_out, count, descriptor, head_parts, listed_walk, \
    load_kv, open_turns, pass_turn, query_item, ring, take_turn, tile_key, tiles_of, work


@gluon.jit
def _load(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
          STAGES: gl.constexpr, CONSUMERS: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
          HAS_FULL: gl.constexpr):
    (Q, K, V, Out, Lse, q_smem, q_rest, k_smem, k_rest, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, stride_q,
     stride_k, stride_v, stride_o, stride_l, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, mods,
     blocks, Sink) = args
    # Q's and K's head dim HEAD_D + HEAD_D_REST in two boxes where it has two parts (common.head_parts)
    q_desc = descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D)
    k_desc = descriptor(K, batch, seqlen_k, nheads_k, stride_k, BLOCK_N, HEAD_D + HEAD_D_REST, HEAD_D)
    q_rest_desc, k_rest_load = None, None
    if HEAD_D_REST:
        q_rest_desc = descriptor(Q, batch, seqlen_q, nheads, stride_q, ROWS, HEAD_D + HEAD_D_REST, HEAD_D_REST)
        k_rest_load = (descriptor(K, batch, seqlen_k, nheads_k, stride_k, BLOCK_N, HEAD_D + HEAD_D_REST, HEAD_D_REST),
                       k_rest)
    v_desc = descriptor(V, batch, seqlen_k, nheads_k, stride_v, BLOCK_N, v_smem.shape[2])
    n_m, items = tiles_of(seqlen_q, batch, nheads, CONSUMERS * ROWS)
    it = 0  # K/V tiles loaded so far: the ring's position
    done = 0  # work items loaded so far
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    Q_BYTES: gl.constexpr = CONSUMERS * ROWS * (HEAD_D + HEAD_D_REST) * q_smem.dtype.primitive_bitwidth // 8
    for k in range(count(items)):
        start_m, off_b, off_h, n_tiles = query_item(work(k), n_m, nheads, seqlen_k, offset, CAUSAL, BLOCK_N, CONSUMERS,
                                                    SPARSE_KV > 0)
        walk = None
        if SPARSE_KV:  # the tiles the block mask lists (at least one: see query_item)
            walk = listed_walk(blocks, off_b, off_h, start_m, SPARSE_Q, SPARSE_KV, HAS_FULL, BLOCK_N)
            n_tiles = gl.maximum(walk[0], 1)
        off_hk = off_h // (nheads // nheads_k)
        qb = done % Q_BUFFERS
        mbarrier.wait(q_empty.index(qb), ((done // Q_BUFFERS) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qb), Q_BYTES)
        for part in gl.static_range(CONSUMERS):
            tma_load(q_desc, [off_b, start_m + part * ROWS, off_h, 0], q_ready.index(qb),
                     q_smem.index(qb * CONSUMERS + part).reshape([1, ROWS, 1, HEAD_D]))
            if HEAD_D_REST:
                tma_load(q_rest_desc, [off_b, start_m + part * ROWS, off_h, HEAD_D], q_ready.index(qb),
                         q_rest.index(qb * CONSUMERS + part).reshape([1, ROWS, 1, HEAD_D_REST]))
        it = load_kv(it, n_tiles, k_desc, v_desc, off_b, off_hk, k_smem, v_smem, k_ready, v_ready, kv_empty,
                     BLOCK_N, STAGES, walk, SPARSE_KV, k_rest_load)
        done += 1


@gluon.jit
def _softmax(s, m_i, l_i, key, rows, seqlen_k, offset, qk_scale, mods, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr):
    """One online-softmax step on the scores of the K/V tile from key `key`: (p, alpha, m_new, l_new),
    the maxima in base-2 logits. MASKED applies the key bound and the causal diagonal (tiles that
    need neither skip the selects). SCORE_MOD and MASK_MOD are the mods' functions
    (kernels/triton/mods.py; mods = (batch, head, their argument tuples)): the score_mod sees the
    scaled score in natural units and its result is taken to base 2; the mask_mod hides keys.
    Without a score_mod (qk_scale > 0: accepts) the row maximum of the logits is that of the scores
    times qk_scale, so each score is scaled once, inside the exponential's argument (a fused
    multiply-add, spelled out: Triton 3.10 stops contracting a multiply and an add by default),
    not also before the maximum."""
    cols = key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    scale = qk_scale
    if SCORE_MOD is not None:
        s = SCORE_MOD(s * qk_scale, mods[0], mods[1], gl.expand_dims(rows, 1), gl.expand_dims(cols, 0),
                      mods[2]) * LOG2E
        scale = 1.0
    if MASK_MOD is not None:
        s = gl.where(MASK_MOD(mods[0], mods[1], gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), mods[3]), s,
                     float("-inf"))
    if MASKED:
        if CAUSAL:  # a row sees keys up to its diagonal and the key bound: one compare a score
            visible = gl.expand_dims(cols, 0) <= gl.expand_dims(gl.minimum(rows + offset, seqlen_k - 1), 1)
        else:
            visible = gl.expand_dims(cols < seqlen_k, 0)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    # (times -1 folds into the FFMA as a negated operand; Triton's -x is 0 - x, an instruction a row)
    p = gl.exp2(gl.fma(s, scale, gl.expand_dims(m_safe * -1.0, 1)))
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _pack(p, dtype: gl.constexpr):
    """P (fp32) rounded to `dtype`, the two columns of a pair in one 32-bit register: the form the next
    tile's P V reads it in. Carried across the loop as 16-bit values instead, P cost a byte permute a
    register every iteration (ptxas regrouping the halves)."""
    even, odd = gl.split(gl.reshape(p, [p.shape[0], p.shape[1] // 2, 2]))
    CVT: gl.constexpr = "cvt.rn.bf16x2.f32" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32"
    return gl.inline_asm_elementwise(CVT + " $0, $2, $1;", "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _unpack(packed, dtype: gl.constexpr, layout: gl.constexpr):
    """_pack's P as a `dtype` tensor in `layout` (the A operand of P V)."""
    # The result types as plain dtypes (a list of the constexpr parameter would hold its wrappers).
    even, odd = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [packed],
                                          dtype=[dtype.value, dtype.value], is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(even, odd), [packed.shape[0], 2 * packed.shape[1]]), layout)


@gluon.jit
def _scores(qs, ks, stage, zero):
    """Issues S = Q K^T (asynchronous) on K/V buffer `stage`: qs and ks are (Q's buffer, K's ring) and the
    same of the rest of a head dim of two parts (common.head_parts), whose product accumulates into S
    (None where there is none)."""
    s = warpgroup_mma(qs[0], ks[0].index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    if qs[1] is not None:
        s = warpgroup_mma(qs[1], ks[1].index(stage).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _tiles(acc, m_i, l_i, p, qs, ks, v_smem, k_ready, v_ready, kv_empty, base, first, last, rows, seqlen_k,
           offset, qk_scale, mods, walk, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
           STAGES: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr,
           SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, SPARSE_KV: gl.constexpr, WG: gl.constexpr,
           TURNS: gl.constexpr):
    """K/V tiles [first, last) of a work item whose tile 0 sits at position `base` of the buffer
    ring (tile j's keys: common.tile_key), software-pipelined: p holds the probabilities of tile
    j - 1 (packed by _pack) whose product with V is still to do; it runs on the tensor cores while
    this warpgroup computes the softmax of tile j (S of tile j is issued first, so waiting for all
    but one product gives S). A tile's two products are issued in this consumer's turn (take_turn).
    qs, ks: as _scores'."""
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    for j in range(first, last):
        stage = (base + j) % STAGES
        prev = (base + j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), ((base + j) // STAGES) & 1)
        take_turn(WG, TURNS)
        s = _scores(qs, ks, stage, zero)
        mbarrier.wait(v_ready.index(prev), ((base + j - 1) // STAGES) & 1)
        acc = warpgroup_mma(_unpack(p, v_smem.dtype, p_layout), v_smem.index(prev), acc, is_async=True)
        pass_turn(WG, TURNS)
        s = warpgroup_mma_wait(1, deps=(s,))
        _release_k(kv_empty, stage, STAGES)
        p_new, alpha, m_i, l_i = _softmax(s, m_i, l_i, tile_key(j, walk, BLOCK_N, SPARSE_KV), rows, seqlen_k,
                                          offset, qk_scale, mods, MASKED, CAUSAL, BLOCK_N, s_layout, SCORE_MOD,
                                          MASK_MOD)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release_v(kv_empty, prev, STAGES)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = _pack(p_new, v_smem.dtype)
    return acc, m_i, l_i, p


@gluon.jit
def _release_k(kv_empty, stage, STAGES: gl.constexpr):
    """This consumer is done with the K buffer `stage` (its S product has read it, or it skips the
    tile). Without EARLY_K (one "empty" per K/V buffer) K goes back with V instead (_release_v)."""
    if kv_empty.shape[0] == 2 * STAGES:
        mbarrier.arrive(kv_empty.index(stage), count=1)


@gluon.jit
def _release_v(kv_empty, stage, STAGES: gl.constexpr):
    """This consumer is done with the V buffer `stage` (and, with one "empty" per K/V buffer, with K's)."""
    if kv_empty.shape[0] == 2 * STAGES:
        mbarrier.arrive(kv_empty.index(STAGES + stage), count=1)
    else:
        mbarrier.arrive(kv_empty.index(stage), count=1)


@gluon.jit
def _hand_back(buffer, q_empty, kv_empty, O_IN_K: gl.constexpr):
    """Once the tensor memory accelerator has read O out of `buffer`, hands it back: the K/V buffer
    (O_IN_K) or the Q buffer of that index."""
    tma.store_wait(0)
    barrier()  # the thread that issued the copy has seen it read the buffer
    if O_IN_K:
        mbarrier.arrive(kv_empty.index(buffer), count=1)
    else:
        mbarrier.arrive(q_empty.index(buffer), count=1)


@gluon.jit
def _hand_back_pending(pending, q_empty, kv_empty, O_IN_K: gl.constexpr):
    """_hand_back of the buffer `pending`, if any (not where -1)."""
    if pending >= 0:
        _hand_back(pending, q_empty, kv_empty, O_IN_K)


@gluon.jit
def _finish_tiles(acc, p, v_smem, k_ready, v_ready, kv_empty, it, n_mine, n_tiles, end, STAGES: gl.constexpr,
                  p_layout: gl.constexpr, WG: gl.constexpr, TURNS: gl.constexpr):
    """The end of a work item's tiles for one warpgroup: those its rows do not see (ring positions
    it + n_mine to it + n_tiles - 1) released once loaded unless at or past `end` (the loader refills a
    buffer only after every consumer's release), each taking a turn that issues nothing (every consumer
    takes a turn a tile, or the round-robin stalls), then the last seen tile's product with V (p), that
    tile released too unless it is `end`."""
    for j in range(it + n_mine, it + n_tiles):
        if j < end:
            mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
            _release_k(kv_empty, j % STAGES, STAGES)
            _release_v(kv_empty, j % STAGES, STAGES)
        take_turn(WG, TURNS)
        pass_turn(WG, TURNS)
    if n_mine > 0:
        last = it + n_mine - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(_unpack(p, v_smem.dtype, p_layout), v_smem.index(last % STAGES), acc)
        if last < end:
            _release_v(kv_empty, last % STAGES, STAGES)
    return acc


@gluon.jit
def _write_out(acc, m_i, l_i, lse_ptrs, row_ok, o_desc, coord, q, k_smem, k_ready, v_ready, q_empty, qb, end, done,
               O_IN_K: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, dtype: gl.constexpr,
               o_layout: gl.constexpr):
    """Stores this warpgroup's lse and starts the copy of its rows of O (at `coord`) through shared memory:
    its part of the Q buffer qb, or (O_IN_K) of the item's last K tile, at ring position `end`. Returns
    the buffer to hand back once the copy has read it. Rows that saw no key (l_i == 0) get out = 0 and
    lse = +inf, as in the Triton kernel."""
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
    gl.store(lse_ptrs, lse, mask=row_ok)
    out = (acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)).to(dtype)
    if O_IN_K:
        # Loaded (no row of this consumer may have seen it), and read by every S product once all
        # consumers released the Q buffer.
        mbarrier.wait(k_ready.index(end % STAGES), (end // STAGES) & 1)
        mbarrier.wait(v_ready.index(end % STAGES), (end // STAGES) & 1)
        mbarrier.wait(q_empty.index(qb), done & 1)
        copy_out(o_desc, coord, k_smem.index(end % STAGES), out, PART=WG)
        buffer = end % STAGES
    else:
        copy_out(o_desc, coord, q, out)
        buffer = qb
    return buffer


@gluon.jit
def _seen(row0, n_tiles, walk, seqlen_q, seqlen_k, offset, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
          SPARSE_KV: gl.constexpr):
    """Of a work item's tiles, (those that the warpgroup whose rows start at row0 sees, where its loops
    split them): none past the last query, under a causal mask those up to its last row's diagonal,
    and, split at, those every row sees whole (below its first row's diagonal, within the keys);
    with a block mask (SPARSE_KV) those it lists, split at the end of the partly seen ones. The
    tiles that only other warpgroups' rows see it just releases."""
    if SPARSE_KV:
        n_mine = gl.where(row0 < seqlen_q, walk[0], 0)
        split = gl.minimum(walk[1], n_mine)
    else:
        n_mine = gl.where(row0 < seqlen_q, n_tiles, 0)
        split = seqlen_k // BLOCK_N
        if CAUSAL:
            n_mine = gl.minimum(n_mine, gl.cdiv(gl.minimum(gl.maximum(row0 + ROWS + offset, 0), seqlen_k), BLOCK_N))
            split = gl.minimum(split, gl.maximum(row0 + offset + 1, 0) // BLOCK_N)
        split = gl.maximum(gl.minimum(split, n_mine), 1)
    return n_mine, split


@gluon.jit
def _first_tile(m_i, l_i, qs, ks, k_ready, kv_empty, it, split, rows, seqlen_k, offset, qk_scale, mods, walk,
                CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, SPARSE_KV: gl.constexpr, WG: gl.constexpr,
                TURNS: gl.constexpr):
    """A work item's tile 0 alone, before the pipelined loops: its S product (issued in this consumer's
    turn, take_turn) and masked softmax (it may hold the diagonal or the key bound; with a block mask, the
    mask_mod only where the tile is listed as partly seen, split > 0). Returns (p packed by _pack, m_i,
    l_i). qs, ks: as _scores'."""
    mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
    take_turn(WG, TURNS)
    s = _scores(qs, ks, it % STAGES, gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout))
    pass_turn(WG, TURNS)
    s = warpgroup_mma_wait(0, deps=(s,))
    _release_k(kv_empty, it % STAGES, STAGES)
    key = tile_key(0, walk, BLOCK_N, SPARSE_KV)
    if SPARSE_KV and MASK_MOD is not None:
        if split > 0:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, key, rows, seqlen_k, offset, qk_scale, mods, True, CAUSAL,
                                          BLOCK_N, s_layout, SCORE_MOD, MASK_MOD)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, key, rows, seqlen_k, offset, qk_scale, mods, True, CAUSAL,
                                          BLOCK_N, s_layout, SCORE_MOD, None)
    else:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, key, rows, seqlen_k, offset, qk_scale, mods, True, CAUSAL,
                                      BLOCK_N, s_layout, SCORE_MOD, MASK_MOD)
    return _pack(p, ks[0].dtype), m_i, l_i


@gluon.jit
def _row_state(Sink, off_h, s_layout: gl.constexpr, o_layout: gl.constexpr, HEAD_D: gl.constexpr,
               BLOCK_N: gl.constexpr, dtype: gl.constexpr):
    """A warpgroup's rows at a work item's start: (running max, running sum, O's accumulator, the P of no
    tile yet, packed), the learnable sink seen first where there is one (cuflash/sinks.py;
    triton/common.sink_state)."""
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    if Sink is not None:
        m_i = gl.load(Sink + off_h).to(gl.float32) * LOG2E + l_i
        l_i = gl.where(m_i == float("-inf"), l_i, l_i + 1.0)
    return m_i, l_i, gl.zeros([ROWS, HEAD_D], gl.float32, o_layout), _pack(gl.zeros([ROWS, BLOCK_N], gl.float32,
                                                                                     s_layout), dtype)


@gluon.jit
def _consume(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
             STAGES: gl.constexpr, CONSUMERS: gl.constexpr, WG: gl.constexpr, SCORE_MOD: gl.constexpr,
             MASK_MOD: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, HAS_FULL: gl.constexpr,
             EVEN_BLOCKS: gl.constexpr, TURNS: gl.constexpr):
    (Q, K, V, Out, Lse, q_smem, q_rest, k_smem, k_rest, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, stride_q,
     stride_k, stride_v, stride_o, stride_l, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale, mods,
     blocks, Sink) = args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    # (O is HEAD_D wide: V's head dim is Q's and K's first part, _attn_fwd_hopper)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = Q.dtype.element_ty
    o_desc = descriptor(Out, batch, seqlen_q, nheads, stride_o, ROWS, HEAD_D)
    # The loader's schedule, item for item and tile for tile: the barriers' phases count on it.
    n_m, items = tiles_of(seqlen_q, batch, nheads, CONSUMERS * ROWS)
    it = 0  # K/V tiles consumed so far: the ring's position
    done = 0  # work items done so far
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    # O leaves through a K tile where a tile has O's shape (see the item's end)
    O_IN_K: gl.constexpr = Q_BUFFERS == 1 and CONSUMERS * ROWS == BLOCK_N
    # At D=128 under a causal mask the buffer that O leaves through goes back after the next item's
    # tile 0 (the copy reading it meanwhile), not once the copy has read it: faster there, not
    # without the mask (docs/tuning.md).
    # Never where that buffer is the only Q buffer: the next item's Q, which tile 0 waits for, would wait
    # for it.
    DEFER: gl.constexpr = HEAD_D == 128 and HEAD_D_REST == 0 and CAUSAL and (O_IN_K or Q_BUFFERS == 2)
    pending = -1  # the buffer that the last item's O is leaving through, until it goes back
    ks = (k_smem, k_rest)  # (_scores')
    open_turns(WG, TURNS)
    for k in range(count(items)):
        start_m, off_b, off_h, n_tiles = query_item(work(k), n_m, nheads, seqlen_k, offset, CAUSAL, BLOCK_N, CONSUMERS,
                                                    SPARSE_KV > 0)
        walk = None
        if SPARSE_KV:  # the tiles the block mask lists (the loader's: at least one)
            walk = listed_walk(blocks, off_b, off_h, start_m, SPARSE_Q, SPARSE_KV, HAS_FULL, BLOCK_N)
            n_tiles = gl.maximum(walk[0], 1)
        row0 = start_m + WG * ROWS
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        n_mine, split = _seen(row0, n_tiles, walk, seqlen_q, seqlen_k, offset, CAUSAL, BLOCK_N, SPARSE_KV)
        item_mods = (off_b, off_h, mods[0], mods[1])
        m_i, l_i, acc, p = _row_state(Sink, off_h, s_layout, o_layout, HEAD_D, BLOCK_N, dtype)
        qb = done % Q_BUFFERS
        q = q_smem.index(qb * CONSUMERS + WG)
        qs = (q, q_rest.index(qb * CONSUMERS + WG) if HEAD_D_REST else None)  # (_scores')
        mbarrier.wait(q_ready.index(qb), (done // Q_BUFFERS) & 1)
        if n_mine > 0:
            # Tile 0 alone, then the pipelined loops: up to the split, the tiles every row sees whole
            # (unmasked), then those the diagonal or the keys' end cuts; with a block mask the partly
            # seen tiles (masked, through the mask_mod), then the wholly seen ones (without it, the keys'
            # end checked unless the blocks are whole).
            p, m_i, l_i = _first_tile(m_i, l_i, qs, ks, k_ready, kv_empty, it, split, rows, seqlen_k, offset,
                                      qk_scale, item_mods, walk, CAUSAL, BLOCK_N, STAGES, s_layout, SCORE_MOD,
                                      MASK_MOD, SPARSE_KV, WG, TURNS)
            if DEFER:  # the last item's O has left its buffer during tile 0: the buffer goes back
                # (before any wait for a tile that the loader may need it for)
                _hand_back_pending(pending, q_empty, kv_empty, O_IN_K)
                pending = -1
            acc, m_i, l_i, p = _tiles(acc, m_i, l_i, p, qs, ks, v_smem, k_ready, v_ready, kv_empty, it, 1,
                                      split, rows, seqlen_k, offset, qk_scale, item_mods, walk, SPARSE_KV > 0,
                                      CAUSAL, BLOCK_N, STAGES, s_layout, p_layout, o_layout, SCORE_MOD, MASK_MOD,
                                      SPARSE_KV, WG, TURNS)
            if SPARSE_KV:
                acc, m_i, l_i, p = _tiles(acc, m_i, l_i, p, qs, ks, v_smem, k_ready, v_ready, kv_empty, it,
                                          gl.maximum(split, 1), n_mine, rows, seqlen_k, offset, qk_scale, item_mods,
                                          walk, not EVEN_BLOCKS, CAUSAL, BLOCK_N, STAGES, s_layout, p_layout,
                                          o_layout, SCORE_MOD, None, SPARSE_KV, WG, TURNS)
            else:
                acc, m_i, l_i, p = _tiles(acc, m_i, l_i, p, qs, ks, v_smem, k_ready, v_ready, kv_empty, it,
                                          split, n_mine, rows, seqlen_k, offset, qk_scale, item_mods, walk, True,
                                          CAUSAL, BLOCK_N, STAGES, s_layout, p_layout, o_layout, SCORE_MOD,
                                          MASK_MOD, SPARSE_KV, WG, TURNS)
        if DEFER:  # (where this warpgroup's rows see no tile)
            _hand_back_pending(pending, q_empty, kv_empty, O_IN_K)
            pending = -1
        # Each consumer's rows of O leave through shared memory, copied out by the TMA: through the
        # consumer's part of the item's Q buffer, which goes back to the loader once the copy has read
        # it; or (O_IN_K: one Q buffer, as at D=128 with 128-key tiles, where there is no room for a
        # second) the Q buffer goes back once every consumer's last S is done, so that the next item's
        # Q arrives while this one finishes, and O leaves through the item's last K tile (S products
        # only read it), held until the copy has read it. (D=256 has one Q buffer but 32- or 64-key
        # tiles, narrower than O: the next Q waits for the copy.)
        if O_IN_K:
            mbarrier.arrive(q_empty.index(qb), count=1)
            end = it + n_tiles - 1  # the tiles before `end` go back as soon as they are done
        else:
            end = it + n_tiles
        acc = _finish_tiles(acc, p, v_smem, k_ready, v_ready, kv_empty, it, n_mine, n_tiles, end, STAGES, p_layout,
                            WG, TURNS)

        lse_ptrs = Lse + off_b.to(gl.int64) * stride_l[0] + off_h * stride_l[1] + rows
        buffer = _write_out(acc, m_i, l_i, lse_ptrs, rows < seqlen_q, o_desc, [off_b, row0, off_h, 0], q, k_smem,
                            k_ready, v_ready, q_empty, qb, end, done, O_IN_K, STAGES, WG, dtype, o_layout)
        if DEFER:
            pending = buffer
        else:
            _hand_back(buffer, q_empty, kv_empty, O_IN_K)
        it += n_tiles
        done += 1
    if DEFER:  # (shared memory must outlive the copies)
        _hand_back_pending(pending, q_empty, kv_empty, O_IN_K)


@gluon.jit
def _attn_fwd_hopper(Q, K, V, Out, Lse, Sink, BlockNum, BlockIdx, FullNum, FullIdx, score_args, mask_args,
                     stride_q, stride_k, stride_v, stride_o, stride_l, stride_blocks,
                     batch, nheads, nheads_k, seqlen_q, seqlen_k, offset, qk_scale,
                     CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D_REST: gl.constexpr,
                     HEAD_DV: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
                     EARLY_K: gl.constexpr, CONSUMER_REGS: gl.constexpr, SCORE_MOD: gl.constexpr,
                     MASK_MOD: gl.constexpr, HAS_FULL: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                     EVEN_BLOCKS: gl.constexpr, TURNS: gl.constexpr):
    """Q's and K's head dim is HEAD_D (+ HEAD_D_REST: a head dim of two parts, common.head_parts, each in
    buffers of its own), V's and O's HEAD_DV."""
    # O leaves through a Q or a K buffer (or its first part), of O's shape (kernels/gluon/__init__.py accepts)
    gl.static_assert(HEAD_DV == HEAD_D, "V's head dim is Q's and K's (first part)")
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = buffers(dtype, Q_BUFFERS * CONSUMERS, ROWS, HEAD_D)
    # EARLY_K: each K buffer goes back once every S product has read it, before its V's products
    # are done, so the loader fetches the next K that much earlier (one "empty" barrier per tensor).
    k_smem, v_smem, k_ready, v_ready, kv_empty = ring(dtype, BLOCK_N, HEAD_D, HEAD_DV, STAGES, CONSUMERS, EARLY_K)
    q_rest, k_rest = None, None
    if HEAD_D_REST:
        q_rest = buffers(dtype, Q_BUFFERS * CONSUMERS, ROWS, HEAD_D_REST)
        k_rest = buffers(dtype, STAGES, BLOCK_N, HEAD_D_REST)
    q_ready = barriers(Q_BUFFERS, 1)
    q_empty = barriers(Q_BUFFERS, CONSUMERS)  # every consumer releases a buffer
    args = (Q, K, V, Out, Lse, q_smem, q_rest, k_smem, k_rest, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
            stride_q, stride_k, stride_v, stride_o, stride_l, batch, nheads, nheads_k, seqlen_q, seqlen_k, offset,
            qk_scale, (score_args, mask_args), (BlockNum, BlockIdx, FullNum, FullIdx, stride_blocks), Sink)
    if CONSUMERS == 3:
        gl.warp_specialize([(_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, 0, SCORE_MOD,
                                        MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL, EVEN_BLOCKS, TURNS)),
                            (_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, 1, SCORE_MOD,
                                        MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL, EVEN_BLOCKS, TURNS)),
                            (_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, 2, SCORE_MOD,
                                        MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL, EVEN_BLOCKS, TURNS)),
                            (_load, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, SPARSE_Q,
                                     SPARSE_KV, HAS_FULL))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, 0, SCORE_MOD,
                                        MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL, EVEN_BLOCKS, TURNS)),
                            (_consume, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, 1, SCORE_MOD,
                                        MASK_MOD, SPARSE_Q, SPARSE_KV, HAS_FULL, EVEN_BLOCKS, TURNS)),
                            (_load, (args, CAUSAL, BLOCK_N, HEAD_D, HEAD_D_REST, STAGES, CONSUMERS, SPARSE_Q,
                                     SPARSE_KV, HAS_FULL))],
                           [4, 1], [CONSUMER_REGS, 24])


def launch_args(tensors: dict, prob: Problem, params: AttentionParams, cfg: Forward):
    """(kernel, grid, keyword arguments) for kernels/launch.py, with the launch's consumer warpgroups
    (2 or 3) x 64 query rows, its key tile (128, 64 or 32) and ring of K/V buffers (3 at D=128 with
    128-key tiles). One persistent program per SM, whose loader fetches the next work item during the
    last one's epilogue, taking pairs of items round-robin (faster than one program per item; both
    in docs/tuning.md)."""
    q, k, v, out = tensors["Q"], tensors["K"], tensors["V"], tensors["Out"]
    # Two Q buffers (the loader fetches an item's Q during the last one) where the shared memory holds
    # them beside the K/V ring: not at D=128 with 128-key tiles, which takes 224 of 227 KB with one (3 K/V
    # buffers of 64 KB, Q 32 KB); that one goes back to the loader after the item's last S, O leaving
    # through a K tile instead (faster than O through the Q buffer, released after the copy;
    # docs/tuning.md). At (192, 128) Q's and K's 192 columns are 128 + 64 (common.head_parts).
    def smem(q_buffers):  # bytes of the Q buffers and the K/V ring
        return (q_buffers * cfg.consumers * ROWS.value * prob.head_dim
                + cfg.stages * cfg.block_n * (prob.head_dim + prob.head_dim_v)) * 2

    q_buffers = 2 if smem(2) <= 227 * 1024 else 1
    if smem(q_buffers) > 227 * 1024:
        raise ValueError(f"the Gluon forward's buffers take {smem(q_buffers)} bytes of shared memory, over 227 KB: "
                         f"fewer than {cfg.stages} K/V buffers")
    if cfg.early_k and q_buffers == 1 and cfg.consumers * ROWS.value == cfg.block_n:
        raise ValueError("early_k: O leaves through the item's last K tile here, which must stay until O's copy "
                         "has read it")
    triton.set_allocator(scratch)  # the kernel builds its tensor descriptors in global scratch
    qk_scale = logit_scale(params)
    items = cdiv(prob.seqlen_q, cfg.consumers * ROWS) * prob.batch * prob.nheads
    # The warps (4 per consumer, 1 loader) run as whole warpgroups that share the register file,
    # 64K a program, which the partitions trade: 2 consumers: 3 warpgroups of 168 registers a thread,
    # 240 each for the consumers, 24 for the loader; 3 consumers: 4 of 128, 160 and 24.
    regs, consumer_regs = (168, 240) if cfg.consumers == 2 else (128, 160)
    mods = mod_args(params, prob, "fwd")
    del mods["SPARSE"]  # (SPARSE_KV > 0)
    head_d, head_d_rest = head_parts(prob.head_dim)
    return _attn_fwd_hopper, (min(cdiv(items, 2), num_sms(q.device)),), dict(
        **mods, Q=q, K=k, V=v, Out=out, Lse=tensors["Lse"], Sink=tensors.get("Sink"), stride_q=box_strides(prob, q),
        stride_k=box_strides(prob, k), stride_v=box_strides(prob, v), stride_o=box_strides(prob, out),
        stride_l=lse_strides(prob, params),
        batch=prob.batch, nheads=prob.nheads, nheads_k=prob.nheads_k, seqlen_q=prob.seqlen_q,
        seqlen_k=prob.seqlen_k, offset=(prob.seqlen_k - prob.seqlen_q) * params.bottom_right, qk_scale=qk_scale,
        CAUSAL=params.window_right == 0, BLOCK_N=cfg.block_n, HEAD_D=head_d, HEAD_D_REST=head_d_rest,
        HEAD_DV=prob.head_dim_v, STAGES=cfg.stages,
        CONSUMERS=cfg.consumers, Q_BUFFERS=q_buffers, EARLY_K=cfg.early_k, TURNS=cfg.consumers if cfg.turns else 0,
        CONSUMER_REGS=consumer_regs, num_warps=4,
        maxnreg=regs)
