"""The exact fp32 forward on Hopper: each fp32 product as three TF32 tensor-core products of operands
split once into TF32 halves, x = hi + lo, x @ y = hi_x @ hi_y + hi_x @ lo_y + lo_x @ hi_y (to about
fp32's rounding: the lo @ lo term is below it).

Triton's own tf32x3 splits every tile it loads in registers and writes the halves back to shared
memory for the tensor cores: each operand's shared memory doubles beside the loaded tile, which forces
small tiles (docs/tuning.md). Here a split kernel writes q, k and v once as their halves, v transposed
(a TF32 product reads both shared-memory operands K-major), so that the attention kernel's tiles come by
TMA straight into the shared memory the products read; only the probabilities split, in registers.

Each key tile's products go into a fresh accumulator, added to the output in fp32: the tensor cores'
own accumulation of a whole sequence's tiles into one running sum lost 30x the exactness (an error of
3e-5 against float64, 1e-6 this way).
"""
import torch
import triton
import triton.language as tl

from ...params import AttentionParams
from ..constants import LN2, NO_MASK
from ..device import cdiv, scratch
from ..launch import workspace
from ..variant import Problem, logit_scale, lse_strides
from . import SplitOperands
from .common import band, query_tile, score_tile, sink_state, softmax_step, store_tile, tile_ptrs

# The split tensors' rows are padded to a multiple of this (the TMA's row strides want 16 bytes; rows
# past a sequence's end are zeros, so a tile reaching past them adds nothing).
ROW_PAD = 16
SPLIT_ROWS = 64  # rows per program of the split kernel


@triton.jit
def _tf32(x):
    """x rounded to the nearest TF32 (the tensor cores would truncate it)."""
    return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _split(X, stride_x, Out, nheads, seqlen, head_dim, rows, half,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows of one (batch, head) of X (batch, seqlen, nheads, head_dim) into its planes of Out: the TF32
    halves hi at Out, lo at Out + half, each (batch * nheads, rows, BLOCK_D) or, TRANSPOSE, (batch *
    nheads, BLOCK_D, rows); zeros past seqlen and head_dim."""
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(X + off_b * stride_x[0] + off_h * stride_x[2] + r[:, None].to(tl.int64) * stride_x[1] + d[None, :],
                mask=(r[:, None] < seqlen) & (d[None, :] < head_dim), other=0.0)
    hi = _tf32(x)
    lo = _tf32(x - hi)
    plane = Out + off_bh * rows * BLOCK_D
    if TRANSPOSE:
        at = plane + d[None, :] * rows + r[:, None]
    else:
        at = plane + r[:, None] * BLOCK_D + d[None, :]
    keep = r[:, None] < rows
    tl.store(at, hi, mask=keep)
    tl.store(at + half, lo, mask=keep)


@triton.jit
def _mma3(a_hi, a_lo, b_hi, b_lo):
    """a @ b of split operands in a fresh fp32 accumulator, the small products first."""
    acc = tl.dot(a_lo, b_hi, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def _exact_fwd_inner(acc, m_i, l_i, q, kv, offs_m, offs_n, lo, hi, bounds, qk_scale, BLOCK_N: tl.constexpr,
                     MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles [lo, hi) into the running (acc, m_i, l_i); MASKED: the band's edges and the keys' end."""
    q_hi, q_lo = q
    k_hi, k_lo, v_hi, v_lo = kv
    for start_n in tl.range(lo, hi, BLOCK_N):
        x = _mma3(q_hi, q_lo, k_hi.load([start_n, 0]).T, k_lo.load([start_n, 0]).T) * qk_scale
        s = score_tile(x, offs_m[:, None], (start_n + offs_n)[None, :], bounds, (0, 0, 0), MASKED, HAS_LEFT,
                       HAS_RIGHT, NO_MASK)
        m_new, p, alpha, l_i = softmax_step(s, m_i, l_i, MASKED)
        p_hi = _tf32(p)
        acc = acc * alpha[:, None] + _mma3(p_hi, _tf32(p - p_hi), v_hi.load([0, start_n]).T, v_lo.load([0, start_n]).T)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _exact_fwd(QS, KS, VS, Out, Lse, Sink, stride_o, stride_l, nheads, nheads_k, seqlen_q, seqlen_k, head_dim_v,
               rows_q, rows_k, half_q, half_k, half_v, bottom_right, window_left, window_right, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               EVEN_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """A program per tile of BLOCK_M query rows of one (batch, head), on _split's planes: QS and KS
    (batch * heads, rows, BLOCK_D), VS (batch * nheads_k, BLOCK_DV, rows_k), each plane's lo half_*
    elements after its hi. The loop, the masks and the epilogue are triton/forward.py's."""
    start_m = query_tile(HAS_RIGHT) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_bhk = off_b * nheads_k + off_h // (nheads // nheads_k)
    q_at = QS + off_bh * rows_q * BLOCK_D
    k_at = KS + off_bhk * rows_k * BLOCK_D
    v_at = VS + off_bhk * BLOCK_DV * rows_k
    q_hi = tl.make_tensor_descriptor(q_at, shape=[rows_q, BLOCK_D], strides=[BLOCK_D, 1],
                                     block_shape=[BLOCK_M, BLOCK_D])
    q_lo = tl.make_tensor_descriptor(q_at + half_q, shape=[rows_q, BLOCK_D], strides=[BLOCK_D, 1],
                                     block_shape=[BLOCK_M, BLOCK_D])
    kv = (tl.make_tensor_descriptor(k_at, shape=[rows_k, BLOCK_D], strides=[BLOCK_D, 1],
                                    block_shape=[BLOCK_N, BLOCK_D]),
          tl.make_tensor_descriptor(k_at + half_k, shape=[rows_k, BLOCK_D], strides=[BLOCK_D, 1],
                                    block_shape=[BLOCK_N, BLOCK_D]),
          tl.make_tensor_descriptor(v_at, shape=[BLOCK_DV, rows_k], strides=[rows_k, 1],
                                    block_shape=[BLOCK_DV, BLOCK_N]),
          tl.make_tensor_descriptor(v_at + half_v, shape=[BLOCK_DV, rows_k], strides=[rows_k, 1],
                                    block_shape=[BLOCK_DV, BLOCK_N]))
    q = (q_hi.load([start_m, 0]), q_lo.load([start_m, 0]))
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if Sink is not None:
        m_i, l_i = sink_state(Sink, off_h, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    offset = bottom_right * (seqlen_k - seqlen_q)
    bounds = (seqlen_q, seqlen_k, (0, head_dim_v), offset, window_left, window_right)
    edges = band(start_m, BLOCK_M, seqlen_k, BLOCK_N, offset - window_left, offset + window_right, HAS_LEFT,
                 HAS_RIGHT)
    for edge in tl.static_range(1 - HAS_LEFT, 3):  # (the band's masked and whole tiles: triton/forward.py)
        acc, m_i, l_i = _exact_fwd_inner(acc, m_i, l_i, q, kv, offs_m, offs_n, edges[edge], edges[edge + 1], bounds,
                                         qk_scale, BLOCK_N, edge != 1, HAS_LEFT, HAS_RIGHT)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(Lse + off_b * stride_l[0] + off_h * stride_l[1] + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = tile_ptrs(Out, stride_o, off_b, off_h, start_m, tl.arange(0, BLOCK_M), offs_dv)
    store_tile(o_ptrs, acc / l_safe[:, None], offs_m, seqlen_q, offs_dv, head_dim_v, not EVEN_DV)


def _split_launch(x: torch.Tensor, prob: Problem, rows: int, block_d: int, name: str, t: dict, transpose: bool):
    """The split of x (batch, seqlen, heads, head_dim) into the new workspace t[name]: its hi planes,
    then its lo planes (_split)."""
    batch, seqlen, heads, head_dim = x.shape
    t[name] = out = workspace((2, batch * heads, rows * block_d), torch.float32, x.device, zeroed=False)
    return _split, (cdiv(rows, SPLIT_ROWS), batch * heads), dict(
        X=x, stride_x=prob.strides(x), Out=out, nheads=heads, seqlen=seqlen, head_dim=head_dim, rows=rows,
        half=out[1].numel(), BLOCK_R=SPLIT_ROWS, BLOCK_D=block_d, TRANSPOSE=transpose, num_warps=4, num_stages=1)


def launches(t: dict, prob: Problem, params: AttentionParams, cfg: SplitOperands) -> list[tuple]:
    """The split of q, k and v into workspaces, then the attention kernel: a program per tile of
    cfg.tiles.block_m query rows of one (batch, head)."""
    tiles = cfg.tiles
    rows_q, rows_k = (cdiv(n, ROW_PAD) * ROW_PAD for n in (prob.seqlen_q, prob.seqlen_k))
    splits = [_split_launch(prob.q, prob, rows_q, prob.block_d, "QS", t, False),
              _split_launch(prob.k, prob, rows_k, prob.block_d, "KS", t, False),
              _split_launch(prob.v, prob, rows_k, prob.block_dv, "VS", t, True)]
    if prob.q.is_cuda:
        triton.set_allocator(scratch)  # the kernel builds its tensor descriptors in global scratch
    grid = (cdiv(prob.seqlen_q, tiles.block_m), prob.batch * prob.nheads)
    return [*splits, (_exact_fwd, grid, dict(
        QS=t["QS"], KS=t["KS"], VS=t["VS"], Out=t["Out"], Lse=t["Lse"], Sink=t.get("Sink"),
        stride_o=prob.strides(t["Out"]), stride_l=lse_strides(prob, params), nheads=prob.nheads,
        nheads_k=prob.nheads_k, seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, rows_q=rows_q, rows_k=rows_k,
        half_q=t["QS"][1].numel(), half_k=t["KS"][1].numel(), half_v=t["VS"][1].numel(),
        bottom_right=int(params.bottom_right), window_left=params.window_left, window_right=params.window_right,
        qk_scale=logit_scale(params), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=prob.block_d, BLOCK_DV=prob.block_dv, EVEN_DV=prob.head_dim_v == prob.block_dv,
        HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0, head_dim_v=prob.head_dim_v,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages))]
