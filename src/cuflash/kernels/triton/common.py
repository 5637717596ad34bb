"""Helpers shared by the attention kernels: tile loads/stores, the score of a tile (mods, attn_mask,
sliding window), the band of tiles a window leaves, varlen offsets and dropout."""
import triton
import triton.language as tl

from ..constants import BOOL_MASK, LOG2E, NO_MASK


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Loads a [rows, cols] tile, zero-filling out-of-range elements; the checks are compile-time
    flags so that tiles known to be in range pay for no mask."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def mma(a, b, acc, INPUT_PRECISION: tl.constexpr):
    """a @ b (+ acc) in fp32. With TF32, operands are first rounded to nearest TF32: the tensor
    cores would otherwise drop the 13 low mantissa bits, a bias that triples the error. tf32x3
    (three TF32 passes on the split operands, as exact as ieee) goes to tl.dot as it is."""
    if INPUT_PRECISION == "tf32":
        a = tf32_round(a)
        b = tf32_round(b)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def tf32_round(x):
    """fp32 x rounded to the nearest TF32 (the tensor cores would truncate it to its top 19 bits)."""
    return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def tile_ptrs(base, strides, off_b, off_h, start, rows, cols):
    """Pointers to rows start + rows, columns cols of one (batch, head) of a (B, N, H, D) tensor whose
    strides are (batch, row, head). off_b and off_h are int64 and start is widened, so offsets past
    2^31 elements stay exact."""
    stride_row = strides[1]
    return (base + off_b * strides[0] + off_h * strides[2] + tl.cast(start, tl.int64) * stride_row
            + rows[:, None] * stride_row + cols[None, :])


@triton.jit
def read_tile(base, strides, off_b, off_h, first, start, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
    """Rows start + rows (zero from row n_rows and, with CHECK_COLS, column n_cols on) of the sequence
    whose first row is `first`, of one (batch, head)."""
    ptrs = tile_ptrs(base, strides, off_b, off_h, first + start, rows, cols)
    return load_tile(ptrs, start + rows, n_rows, cols, n_cols, True, CHECK_COLS)


@triton.jit
def row_source(base, strides, off_b, off_h, first, n_rows, n_cols, rows, cols, BLOCK_ROWS: tl.constexpr,
               BLOCK_COLS: tl.constexpr, TMA: tl.constexpr):
    """What a loop reads its tiles from, rows [first, first + n_rows) of one (batch, head): a
    tensor descriptor (TMA: the copy engine fetches each tile whole and zero-fills rows and
    columns past n_rows and n_cols, as the masked loads do) or pointers to the first tile, which
    the loop moves on itself (advance). The launcher turns TMA on only for 16-byte aligned tensors."""
    if TMA:  # (one return statement: Triton wants every return of a function to have one type)
        src = tl.make_tensor_descriptor(
            base + off_b * strides[0] + off_h * strides[2] + tl.cast(first, tl.int64) * strides[1],
            shape=[n_rows, n_cols], strides=[strides[1], 1], block_shape=[BLOCK_ROWS, BLOCK_COLS])
    else:
        src = tile_ptrs(base, strides, off_b, off_h, first, rows, cols)
    return src


@triton.jit
def advance(srcs, strides, n, TMA: tl.constexpr):
    """Two row_sources that a loop walks together (with their row strides), n rows on: pointers move
    (n int64 where it may be large), a descriptor stays (its loads name their row)."""
    a_src, b_src = srcs
    if not TMA:
        a_src += n * strides[0]
        b_src += n * strides[1]
    return a_src, b_src


@triton.jit
def load_rows(src, start, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr,
              TMA: tl.constexpr):
    """The tile of rows start + [0, BLOCK_ROWS) from a row_source (pointers: already at start)."""
    if TMA:
        tile = src.load([start, 0])
    else:
        tile = load_tile(src, rows, n_rows, cols, n_cols, CHECK_ROWS, CHECK_COLS)
    return tile


@triton.jit
def load_pair(srcs, start, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_A: tl.constexpr,
              CHECK_B: tl.constexpr, TMA: tl.constexpr):
    """load_rows from both row_sources of srcs (see advance), each with its own columns: cols and n_cols
    are pairs (q's and dO's, or k's and v's, head dims), CHECK_A and CHECK_B their checks."""
    a = load_rows(srcs[0], start, rows, n_rows, cols[0], n_cols[0], CHECK_ROWS, CHECK_A, TMA)
    b = load_rows(srcs[1], start, rows, n_rows, cols[1], n_cols[1], CHECK_ROWS, CHECK_B, TMA)
    return a, b


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
    if CHECK_COLS:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
    else:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)


@triton.jit
def sequence(cu_seqlens, used, off_b, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence off_b: from the prefix sums of a varlen batch, its length cut to
    used[off_b] where `used` (seqused_q / seqused_k) is given (None: a constant, so the plain varlen
    path compiles without the read), or (0, seqlen) for a padded batch, whose sequences start at their
    own batch offset."""
    if VARLEN:
        first = tl.load(cu_seqlens + off_b)
        if used is not None:
            length = tl.load(used + off_b)
        else:
            length = tl.load(cu_seqlens + off_b + 1) - first
    else:
        first = 0
        length = seqlen
    return first, length


@triton.jit
def query_program(CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, seqlen_q, seqlen_k, nheads, BLOCK_M: tl.constexpr,
                  HEAVY_LAST: tl.constexpr, VARLEN: tl.constexpr):
    """What a program of query tiles works on (grid: query tiles x batch * nheads): (first query row,
    batch * nheads + head, batch, head, and its sequence's first query row, query count, first key
    row, key count; the counts those it uses: common.sequence)."""
    start_m = query_tile(HEAVY_LAST) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    q_first, seqlen_q = sequence(CuSeqlensQ, SeqUsedQ, off_b, seqlen_q, VARLEN)
    k_first, seqlen_k = sequence(CuSeqlensK, SeqUsedK, off_b, seqlen_k, VARLEN)
    return start_m, off_bh, off_b, (off_bh % nheads).to(tl.int64), q_first, seqlen_q, k_first, seqlen_k


@triton.jit
def tile_aranges(start, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """A program's index vectors: its tile's rows from 0 and from start, a tile of the other axis, and
    the head dims of q and k and of v (and the output)."""
    rows = tl.arange(0, BLOCK)
    return rows, start + rows, tl.arange(0, BLOCK_OTHER), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)


@triton.jit
def query_tile(HEAVY_LAST: tl.constexpr):
    """The query tile of a program (grid axis 0). Under a causal diagonal (HEAVY_LAST) the last
    tiles see the most keys: they are handed out first, so that the light ones fill the tail."""
    if HEAVY_LAST:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile = tl.program_id(0)
    return tile


@triton.jit
def band(start, BLOCK: tl.constexpr, n_other, BLOCK_OTHER: tl.constexpr, c_lo, c_hi,
         HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """For a tile of indices x in [start, start + BLOCK) that sees the other axis' indices y with
    x + c_lo <= y <= x + c_hi (a bound applies only when HAS_LO / HAS_HI), splits [0, n_other)
    into tiles of BLOCK_OTHER: [lo, full_lo) and [full_hi, hi) need the mask (the band's edges
    and the ragged end), [full_lo, full_hi) is visible to the whole tile, the rest is skipped.
    (The masked ranges may reach a tile past the band, never past the masks. With a single bound
    the expressions are those of the causal-only kernels: clamping every bound against every other
    was slower, docs/tuning.md.)"""
    lo = 0
    full_lo = 0
    hi = n_other
    full_hi = n_other // BLOCK_OTHER * BLOCK_OTHER
    if HAS_LO:
        lo = tl.maximum(start + c_lo, 0) // BLOCK_OTHER * BLOCK_OTHER
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start + BLOCK - 1 + c_lo, 0), BLOCK_OTHER) * BLOCK_OTHER, n_other)
    if HAS_HI:
        hi = tl.minimum(tl.maximum(start + BLOCK + c_hi, 0), n_other)
        full_hi = tl.minimum(full_hi, tl.maximum(start + c_hi + 1, 0) // BLOCK_OTHER * BLOCK_OTHER)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def tanh(x, FAST: tl.constexpr = False):
    """tanh in fp32 (fp64 for fp64 x) from exp2 (the interpreter has no libdevice): an odd polynomial
    near 0, where (1 - e^-2|x|) / (1 + e^-2|x|) would lose digits to cancellation; with FAST (on the
    GPU) the hardware's tanh.approx.f32, one instruction for the three (exp2, a reciprocal, a select)
    of the other, its relative error under 2^-10.9: below a 16-bit input's rounding, so the mods take it
    for 16-bit inputs (variant.fast_math), as FlashAttention's softcap does. Integer and 16-bit x are
    taken to fp32 first."""
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        ax = tl.abs(x)
        e = tl.math.exp2(ax * (-2.0 * LOG2E))
        big = (1.0 - e) / (1.0 + e)
        x2 = ax * ax
        small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        t = tl.where(ax < 0.125, small, big)
        t = tl.where(x < 0, -t, t)
    return t


@triton.jit
def softmax_step(s, m_i, l_i, MAY_BE_EMPTY: tl.constexpr):
    """One tile of the online softmax over base-2 scores s (rows x keys): returns the new running
    max, the tile's unnormalized probabilities, alpha (rescales what was summed before) and the new
    running sum. MAY_BE_EMPTY: a row may have seen no visible key yet (its max is -inf); it is then
    shifted by 0 so that exp2 sees -inf, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def sink_state(Sink, heads, zeros):
    """The running max (base 2) and sum of rows that have seen one key, the learnable sink of their
    heads (Sink[heads], natural units, value 0; cuflash/sinks.py): (sink * LOG2E, 1), or for a sink of
    -inf (-inf, 0), the state of no key seen. zeros: 0 in the rows' shape (heads: one or a row's each)."""
    m_i = tl.load(Sink + heads).to(tl.float32) * LOG2E + zeros
    return m_i, tl.where(m_i == float("-inf"), zeros, zeros + 1.0)


@triton.jit
def score_tile(x, rows, cols, bounds, mask, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               MASK_KIND: tl.constexpr, mods=None, SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None):
    """Logits x (base 2; natural with a SCORE_MOD, whose result is taken to base 2: softcap and ALiBi
    are score_mods, builtin_mods.py) plus an additive mask, -inf where a key is not visible. rows and
    cols broadcast against each other (the dK/dV kernel passes them transposed).
    bounds = (seqlen_q, seqlen_k, (the head dims of q and k and of v), offset, window_left, window_right);
    mask = (attn_mask's pointer for this head, its row and column strides); mods = (batch, head, the
    score_mod's and the mask_mod's argument tuples), for SCORE_MOD and MASK_MOD (kernels/triton/mods.py;
    None: none, and for tiles a block mask marks full). Key j is visible to query row i when
    i + offset - window_left <= j <= i + offset + window_right (causal: window_right = 0) and the
    mask_mod says so; only MASKED tiles (the band's edges and ragged ends) check the bounds."""
    seqlen_q, seqlen_k, _, offset, window_left, window_right = bounds
    mask_ptrs, stride_mask_m, stride_mask_n = mask
    if SCORE_MOD is not None:
        s = SCORE_MOD(x, mods[0], mods[1], rows, cols, mods[2]) * LOG2E
    else:
        s = x
    if MASK_KIND != NO_MASK:
        in_range = (rows < seqlen_q) & (cols < seqlen_k)
        m = tl.load(mask_ptrs + rows.to(tl.int64) * stride_mask_m + cols.to(tl.int64) * stride_mask_n,
                    mask=in_range, other=0)
        if MASK_KIND == BOOL_MASK:
            s = tl.where(m != 0, s, float("-inf"))
        else:
            s += m.to(tl.float32) * LOG2E
    if MASK_MOD is not None:
        s = tl.where(MASK_MOD(mods[0], mods[1], rows, cols, mods[3]), s, float("-inf"))
    if MASKED:
        ok = cols < seqlen_k
        if HAS_RIGHT:
            ok = ok & (cols <= rows + offset + window_right)
        if HAS_LEFT:
            ok = ok & (cols >= rows + offset - window_left)
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def tile_start(it, listed, BLOCK: tl.constexpr, LISTED: tl.constexpr):
    """The first index of the tile of a loop's step `it` (it runs over [lo, hi) in steps of BLOCK): `it`
    itself in a contiguous loop (LISTED 0); in a loop over a block mask's list of LISTED-wide blocks
    (listed: its first index's pointer and stride), tile (it / BLOCK) % (LISTED / BLOCK) of block
    (it / BLOCK) / (LISTED / BLOCK) of the list. (One loop over every listed tile: the pipeliner
    overlaps tiles across blocks, which a loop per block, two tiles long, could not.)"""
    if LISTED:
        per_block: tl.constexpr = LISTED // BLOCK
        tile = it // BLOCK
        start = tl.load(listed[0] + (tile // per_block) * listed[1]) * LISTED + (tile % per_block) * BLOCK
    else:
        start = it
    return start


@triton.jit
def head_options(Mask, stride_mask, Rng, off_b, off_h, off_bh, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    """What a variant needs per (batch, head): the attn_mask's base pointer (its strides are
    (batch, head, row, column)) and the dropout key of head off_bh = batch * nheads + head."""
    mask_ptrs = 0  # (Mask is None without a mask: a function cannot return None)
    if MASK_KIND != NO_MASK:
        mask_ptrs = Mask + off_b * stride_mask[0] + off_h * stride_mask[1]
    drop_key = 0
    if DROPOUT:
        drop_key = dropout_key(Rng, off_bh)
    return mask_ptrs, drop_key


@triton.jit
def _mix32(x):
    # A bijective 32-bit integer hash (lowbias32): every output bit depends on every input bit.
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def dropout_key(rng, off_bh):
    """The dropout stream of one (batch, head): hashed from the two seed words drawn from torch's
    generator. cuflash.dropout.keep_mask computes the same bits with torch ops."""
    seed0 = tl.load(rng).to(tl.uint32)
    seed1 = tl.load(rng + 1).to(tl.uint32)
    return _mix32(seed0 ^ _mix32(seed1 + off_bh.to(tl.uint32)))


@triton.jit
def dropout_keep(drop, rows, cols):
    """True where element (row, col) is kept: a counter-based draw, so the backward regenerates
    the forward's mask from (key, row, col) and nothing N x N is stored. drop = (the head's key
    (dropout_key), threshold, ...): threshold is dropout_p * 2^31, compared with 31 bits of the hash."""
    u = _mix32(_mix32(drop[0] ^ rows.to(tl.uint32)) ^ cols.to(tl.uint32))
    return (u >> 1).to(tl.int32) >= drop[1]
