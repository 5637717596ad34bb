"""A block mask's tile lists (mods.BlockSparsity) as every kernel family reads them: written in
triton.language, so that the Triton kernels and the Gluon kernels (which compile a called
@triton.jit function in their own dialect) share one reader."""
import triton
import triton.language as tl


@triton.jit
def listed_blocks(Num, Idx, strides, full: tl.constexpr, off_b, off_h, row):
    """A block mask's list for block `row` of one (batch, head): (how many blocks, a pointer to the
    first one's index, the indices' stride); the full blocks' list where full (strides: those of the
    tile lists BlockNum, BlockIdx, FullNum, FullIdx in turn)."""
    num_strides = strides[2 * full]
    idx_strides = strides[2 * full + 1]
    count = tl.load(Num + off_b * num_strides[0] + off_h * num_strides[1] + row * num_strides[2])
    first = Idx + off_b * idx_strides[0] + off_h * idx_strides[1] + row * idx_strides[2]
    return count, first, idx_strides[3]
