"""Rotary embedding in one pass (cuflash.rotary's GPU path): each program rotates BLOCK_R tokens of
one head in place, cos and sin read at each token's position and the rotation done in fp32. The
dims past rotary_dim are never touched."""
import torch
import triton
import triton.language as tl

from ..device import cdiv, next_power_of_2, on_device
from ..launch import run_kernel

BLOCK_R = 16  # tokens per program


@triton.jit
def _rotary_inplace(X, Cos, Sin, Positions, stride_xb, stride_xn, stride_xh, stride_cos, stride_sin,
                    rows, seqlen, seqlen_ro, half, sign, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    INTERLEAVED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # token b * seqlen + n
    off_h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    row_ok = r < rows
    pos = tl.load(Positions + r, mask=row_ok, other=0)
    inside = row_ok & (pos >= 0) & (pos < seqlen_ro)  # outside the table: cos 1, sin 0 (left as it is)
    ok = inside[:, None] & (i[None, :] < half)
    c = tl.load(Cos + pos[:, None] * stride_cos + i[None, :], mask=ok, other=1.0).to(tl.float32)
    s = tl.load(Sin + pos[:, None] * stride_sin + i[None, :], mask=ok, other=0.0).to(tl.float32) * sign
    base = X + (r // seqlen).to(tl.int64)[:, None] * stride_xb + (r % seqlen).to(tl.int64)[:, None] * stride_xn \
        + off_h * stride_xh
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + half
    x1 = tl.load(base + first[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(base + first[None, :], (x1 * c - x2 * s).to(X.dtype.element_ty), mask=ok)
    tl.store(base + second[None, :], (x1 * s + x2 * c).to(X.dtype.element_ty), mask=ok)


def rotate_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   interleaved: bool, inverse: bool = False) -> torch.Tensor:
    """x (B, N, H, D) or (N, H, D), last dim contiguous, rotated in place at positions (long,
    shaped like x.shape[:-2]); inverse: by the opposite angles (the gradient). Returns x."""
    x4 = x if x.dim() == 4 else x[None]
    batch, seqlen, nheads, _ = x4.shape
    half = cos.shape[1]
    positions = positions.reshape(-1).contiguous()
    grid = (cdiv(batch * seqlen, BLOCK_R), nheads)
    with on_device(x):
        run_kernel(_rotary_inplace, grid, x4, cos, sin, positions, x4.stride(0), x4.stride(1), x4.stride(2),
                   cos.stride(0), sin.stride(0), batch * seqlen, seqlen, cos.shape[0], half, -1.0 if inverse else 1.0,
                   BLOCK_R=BLOCK_R, BLOCK_HALF=max(16, next_power_of_2(half)), INTERLEAVED=interleaved, num_warps=4)
    return x
