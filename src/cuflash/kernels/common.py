"""Helpers shared by the attention kernels: tile loads/stores and the attention mask."""
import triton
import triton.language as tl

# exp(x) == exp2(x * LOG2E): the kernels fold LOG2E into the softmax scale and use exp2.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


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
    cores would otherwise drop the 13 low mantissa bits, a bias that triples the error."""
    if INPUT_PRECISION == "tf32":
        a = ((a.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
        b = ((b.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def tile_ptrs(base, off_b, stride_b, off_h, stride_h, start, stride_row, rows, cols):
    """Pointers to rows start + rows, columns cols of one (batch, head) of a (B, N, H, D) tensor.
    off_b and off_h are int64 and start is widened, so offsets past 2^31 elements stay exact."""
    return (base + off_b * stride_b + off_h * stride_h + tl.cast(start, tl.int64) * stride_row
            + rows[:, None] * stride_row + cols[None, :])


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
    if CHECK_COLS:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
    else:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)


@triton.jit
def visible(offs_m, offs_n, seqlen_k, causal_offset, CAUSAL: tl.constexpr):
    """True where query row offs_m may attend to key offs_n (the arguments broadcast).
    Causal: row i sees keys j <= i + causal_offset (seqlen_k - seqlen_q aligns the diagonal to
    the bottom-right corner, as flash-attn does; 0 aligns it top-left, as torch SDPA does)."""
    ok = offs_n < seqlen_k
    if CAUSAL:
        ok = ok & (offs_n <= offs_m + causal_offset)
    return ok


@triton.jit
def key_range(start_m, seqlen_k, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr):
    """For the query tile starting at start_m: keys [0, full_end) are visible to every row of the
    tile (no mask needed), keys [full_end, end) need the mask, the rest is skipped."""
    if CAUSAL:
        end = tl.maximum(tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, start_m + causal_offset + 1), 0) // BLOCK_N * BLOCK_N
    else:
        end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    return full_end, end
