"""The Gluon kernels' building blocks: the persistent schedule (pairs of work items round-robin over
one program per SM), tensor descriptors, the shared-memory ring of buffers with its barriers, and the
copies into and out of shared memory by the tensor memory accelerator."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..compat import barrier, tma_add, tma_load, tma_store
from ..lists import listed_blocks
from ..variant import Problem
from . import ROWS as _ROWS

ROWS = gl.constexpr(_ROWS)  # query rows per consumer warpgroup: one wgmma M


@gluon.jit
def count(items):
    """How many work items this program runs (work): programs take pairs of consecutive items,
    round-robin; the last pair of an odd count is one item."""
    pairs = gl.cdiv(gl.cdiv(items, 2) - gl.program_id(0), gl.num_programs(0))
    last = gl.program_id(0) + (pairs - 1) * gl.num_programs(0)  # this program's last pair
    return 2 * pairs - (2 * last + 1 >= items).to(gl.int32)


@gluon.jit
def work(k):
    """The k-th work item of this program."""
    return 2 * (gl.program_id(0) + k // 2 * gl.num_programs(0)) + k % 2


@gluon.jit
def tiles_of(seqlen, batch, heads, ROWS_PER_ITEM: gl.constexpr):
    """(tiles of ROWS_PER_ITEM rows per (batch, head), work items): the schedule's size."""
    n = gl.cdiv(seqlen, ROWS_PER_ITEM)
    return n, n * batch * heads


@gluon.jit
def load_kv(it, n_tiles, k_desc, v_desc, off_b, off_hk, k_smem, v_smem, k_ready, v_ready, kv_empty,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, walk=None, SPARSE_KV: gl.constexpr = 0, k_rest=None):
    """The loader's copies of a work item's n_tiles K/V tiles into the ring from position `it` (the
    keys from 0 on; with SPARSE_KV, those a block mask lists, `walk` from listed_walk); returns the
    ring's position after them. k_rest: load_pair's a_rest for K (a head dim of two parts)."""
    for j in range(n_tiles):
        load_pair(it, k_desc, v_desc, [off_b, tile_key(j, walk, BLOCK_N, SPARSE_KV), off_hk, 0], k_smem, v_smem,
                  k_ready, v_ready, kv_empty, STAGES, a_rest=k_rest)
        it += 1
    return it


@gluon.jit
def listed_walk(blocks, off_b, off_h, start, BLOCK: gl.constexpr, LISTED: gl.constexpr, HAS_FULL: gl.constexpr,
                TILE: gl.constexpr):
    """The tiles that a block mask lists for the BLOCK-wide block holding index `start` (a query row in
    the forward, a key in dK/dV) of one (batch, head), blocks = (its lists' Num, Idx, FullNum, FullIdx
    and their strides): (tiles listed, of them the partly seen ones, which come first, then where each
    list's indices are: partial (pointer, stride), full (pointer, stride)). A listed block is
    LISTED // TILE tiles."""
    row = start // BLOCK
    n_part, part, part_stride = listed_blocks(blocks[0], blocks[1], blocks[4], False, off_b, off_h, row)
    if HAS_FULL:
        n_whole, whole, whole_stride = listed_blocks(blocks[2], blocks[3], blocks[4], True, off_b, off_h, row)
    else:
        n_whole, whole, whole_stride = 0, part, part_stride
    PER_BLOCK: gl.constexpr = LISTED // TILE
    return (n_part + n_whole) * PER_BLOCK, n_part * PER_BLOCK, part, part_stride, whole, whole_stride


@gluon.jit
def tile_key(j, walk, TILE: gl.constexpr, LISTED: gl.constexpr):
    """The first index (a key in the forward, a query row in dK/dV) of a work item's tile j: j * TILE,
    or (LISTED, the lists' block size) of the j-th tile that `walk` (listed_walk) lists, 0 where it
    lists none (the forward's loader still loads a tile: see query_item)."""
    if LISTED:
        PER_BLOCK: gl.constexpr = LISTED // TILE
        block = j // PER_BLOCK
        key = j * 0  # (a tensor, as the branches' keys)
        if j < walk[0]:
            if j < walk[1]:
                key = gl.load(walk[2] + block * walk[3]) * LISTED + (j % PER_BLOCK) * TILE
            else:
                key = gl.load(walk[4] + (block - walk[1] // PER_BLOCK) * walk[5]) * LISTED + (j % PER_BLOCK) * TILE
    else:
        key = j * TILE
    return key


@gluon.jit
def query_item(w, n_m, nheads, seqlen_k, offset, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
               CONSUMERS: gl.constexpr, ALTERNATE: gl.constexpr = False):
    """(first query row, batch, head, K/V tiles to visit) of work item w. The query tiles of one
    (batch, head) are consecutive items (their K/V stay in L2). Under a causal mask (and with
    ALTERNATE, as for a block mask, whose masks mostly grow with the row as a causal one does) heavy
    and light tiles alternate (the last, the first, the second last, ...), so that a pair of items
    costs about the same everywhere and the round-robin over pairs balances the programs."""
    bh = w // n_m
    tile = w % n_m
    if CAUSAL or ALTERNATE:
        tile = gl.where(tile % 2 == 0, n_m - 1 - tile // 2, tile // 2)
    if CAUSAL:
        hi = gl.minimum(gl.maximum((tile + 1) * CONSUMERS * ROWS + offset, 0), seqlen_k)
    else:
        hi = seqlen_k
    # At least one tile (seen by no row where no row sees a key): the item's last K/V buffer carries its
    # output out (with one Q buffer; the backward's dQ kernel).
    return tile * CONSUMERS * ROWS, bh // nheads, bh % nheads, gl.maximum(gl.cdiv(hi, BLOCK_N), 1)


@gluon.jit
def descriptor(T, batch, seqlen, nheads, strides, BOX_ROWS: gl.constexpr, HEAD_D: gl.constexpr,
               BOX_COLS: gl.constexpr = None):
    """The TMA descriptor of a (batch, seqlen, nheads, HEAD_D) tensor with (batch, row, head) strides,
    one for a whole program: a box is BOX_ROWS rows (of BOX_COLS columns, all by default) of one
    (batch, head), cut (zero-filled) at its sequence's end."""
    box: gl.constexpr = [1, BOX_ROWS, 1, HEAD_D if BOX_COLS is None else BOX_COLS]
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(box, T.dtype.element_ty)
    return tma.make_tensor_descriptor(T, [batch, seqlen, nheads, HEAD_D], [strides[0], strides[1], strides[2], 1], box,
                                      layout)


@gluon.jit
def copy_out(desc, coord, buffer, tile, ADD: gl.constexpr = False, PART: gl.constexpr = None):
    """Starts the copy of a consumer's register tile to global memory through `buffer`, shared memory
    of the tile's shape (or, with PART, rows [PART * tile rows, (PART + 1) * tile rows) of it) that only
    this consumer writes and no one reads any more, with the tensor memory accelerator (whole lines;
    rows past the tensor's end cut off); ADD adds the tile to what is there instead. tma.store_wait(0)
    and a barrier then tell when the copy has read the buffer, which the program must await before it
    ends."""
    box = buffer.reshape([1, buffer.shape[0], 1, buffer.shape[1]])
    if PART is not None:
        buffer = buffer.slice(PART * tile.shape[0], tile.shape[0])
        box = box.slice(PART * tile.shape[0], tile.shape[0], dim=1)
    buffer.store(tile)
    fence_async_shared()
    barrier()  # every thread's rows written before the copy is issued
    if ADD:
        tma_add(desc, coord, box)
    else:
        tma_store(desc, coord, box)


@gluon.jit
def load_pair(it, a_desc, b_desc, coord, a_smem, b_smem, a_ready, b_ready, empty, STAGES: gl.constexpr, rows=None,
              a_rest=None):
    """The loader's step of a ring of STAGES buffers: once every consumer has released position `it`'s
    buffers, the TMA copies the box at `coord` of two tensors into them, each signalling its "ready"
    barrier. With 2 x STAGES "empty" barriers (ring's EMPTY_EACH) each tensor's buffer has its own, and
    a's copy waits only for a's release. With rows = (descriptor of a 2D tensor, shared memory of 2 x
    STAGES of its boxes, a's row, b's row), each tensor's box comes with the box of that row at column
    coord[1]. With a_rest = (descriptor, ring), a's head dim has two parts (head_parts: 192 = 128 + 64):
    the rest of a's columns, after a_desc's box, come into that ring beside a's."""
    stage = it % STAGES
    phase = ((it // STAGES) & 1) ^ 1
    EMPTY_EACH: gl.constexpr = empty.shape[0] == 2 * STAGES
    mbarrier.wait(empty.index(stage), phase)
    row_bytes: gl.constexpr = 0 if rows is None else rows[0].block_type.nbytes
    rest_bytes: gl.constexpr = 0 if a_rest is None else a_rest[0].block_type.nbytes
    for i in gl.static_range(2):
        if i == 1 and EMPTY_EACH:
            mbarrier.wait(empty.index(STAGES + stage), phase)
        desc, smem, ready = (a_desc, a_smem, a_ready) if i == 0 else (b_desc, b_smem, b_ready)
        mbarrier.expect(ready.index(stage), desc.block_type.nbytes + row_bytes + (rest_bytes if i == 0 else 0))
        tma_load(desc, coord, ready.index(stage), smem.index(stage).reshape([1, smem.shape[1], 1, smem.shape[2]]))
        if i == 0 and a_rest is not None:
            rest = a_rest[1].index(stage)
            tma_load(a_rest[0], [coord[0], coord[1], coord[2], coord[3] + a_smem.shape[2]], ready.index(stage),
                     rest.reshape([1, rest.shape[0], 1, rest.shape[1]]))
        if rows is not None:
            tma_load(rows[0], [rows[2 + i], coord[1]], ready.index(stage), rows[1].index(2 * stage + i))


@gluon.jit
def barriers(n: gl.constexpr, arrivals: gl.constexpr):
    """n barriers in shared memory, each complete once `arrivals` arrivals (and the expected bytes) are in."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def buffers(dtype: gl.constexpr, n: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr):
    """n buffers of rows x cols in shared memory, in the layout the TMA and wgmma take."""
    return gl.allocate_shared_memory(dtype, [n, rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], dtype))


@gluon.jit
def ring(dtype: gl.constexpr, BLOCK: gl.constexpr, A_D: gl.constexpr, B_D: gl.constexpr, STAGES: gl.constexpr,
         CONSUMERS: gl.constexpr, EMPTY_EACH: gl.constexpr = False):
    """A ring of STAGES buffers of BLOCK rows for each of two tensors streamed past the consumers (K
    and V, or Q and dO), of A_D and B_D columns, and its barriers: a "ready" per tensor and buffer, which
    the loader's copy completes, and an "empty" per buffer that every consumer arrives at once done with
    it (EMPTY_EACH: one per tensor and buffer, a's at [stage], b's at [STAGES + stage])."""
    a_smem = buffers(dtype, STAGES, BLOCK, A_D)
    b_smem = buffers(dtype, STAGES, BLOCK, B_D)
    empty = barriers(2 * STAGES if EMPTY_EACH else STAGES, CONSUMERS)
    return a_smem, b_smem, barriers(STAGES, 1), barriers(STAGES, 1), empty


# The hardware barriers of two consumer warpgroups: Triton's warp specialization takes barriers 0
# and 1 and one for each partition from 2 on (five at most here). The forward's turns take 8 to 10
# (take_turn), the fused backward's meeting point 11 (meet).
TURN_BARRIER = gl.constexpr(8)
MEET_BARRIER = gl.constexpr(11)


@gluon.jit
def _named_barrier(INSTRUCTION: gl.constexpr, ID: gl.constexpr):
    """bar.sync or bar.arrive on hardware barrier ID by the calling warpgroup, 2 x 128 threads a phase
    (this warpgroup's and the other one's, arriving or waiting too): one instruction a thread, through a
    tensor of one element a thread (Gluon has no statement of inline PTX)."""
    one_each: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.inline_asm_elementwise(INSTRUCTION + " $1, 256;", "=r,r", [gl.full([128], ID, gl.int32, one_each)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def take_turn(WG: gl.constexpr, TURNS: gl.constexpr):
    """With TURNS (the consumer warpgroups taking turns, 0 for none), waits until consumer WG's turn:
    the consumers issue their matrix products in turn, round-robin (FlashAttention-3's schedule), so
    that one's softmax runs while the others' products do, and their exponentials never contend for
    the same cycles. A turn ends with pass_turn; consumer 0 opens the first (open_turns)."""
    if TURNS:
        _named_barrier("bar.sync", TURN_BARRIER + WG)


@gluon.jit
def pass_turn(WG: gl.constexpr, TURNS: gl.constexpr):
    """Ends consumer WG's turn: the next consumer's take_turn returns (take_turn)."""
    if TURNS:
        _named_barrier("bar.arrive", TURN_BARRIER + (WG + 1) % TURNS)


@gluon.jit
def open_turns(WG: gl.constexpr, TURNS: gl.constexpr):
    """Consumer 0's first turn needs no one before it: it arrives at its own barrier once (take_turn)."""
    if TURNS and WG == 0:
        _named_barrier("bar.arrive", TURN_BARRIER)


@gluon.jit
def meet():
    """Waits until both consumer warpgroups are here (bar.sync of 256 threads): what either wrote to
    shared memory before it, fenced for the async proxy, the other's matrix products may read after."""
    _named_barrier("bar.sync", MEET_BARRIER)


def head_parts(head_dim: int) -> tuple[int, int]:
    """A head dim as the kernels hold it: a power of two, or (192) the largest power of two below it
    and the rest, 128 + 64 (Gluon's tensors and shared memory are powers of two: a product over such a
    head dim is two wgmma products accumulating), as (first, rest), rest 0 for a power of two."""
    first = 1 << (head_dim.bit_length() - 1)
    return first, head_dim - first


def box_strides(prob: Problem, t: torch.Tensor) -> tuple[int, ...]:
    """prob.strides for a tensor descriptor: a dim of size 1 is never stepped over, but the
    descriptor still wants a positive multiple of 16 bytes there."""
    return tuple(stride if n > 1 else 128 for stride, n in zip(prob.strides(t), t.shape))
