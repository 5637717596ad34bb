"""The exact fp32 attention on Hopper, forward and backward, on operands split once: each fp32
product as a few 16- or 19-bit tensor-core products of the parts, to about fp32's rounding.

Triton's own tf32x3 splits every tile it loads in registers and writes the parts back to shared
memory for the tensor cores: each operand's shared memory doubles beside the loaded tile, which forces
small tiles (docs/tuning.md). Here a split kernel writes each input once as its parts, whose tiles come
by TMA straight into the shared memory the products read; only the probabilities and dS split, in
registers.
- The forward: TF32 halves, x = hi + lo, x @ y = hi @ hi + hi @ lo + lo @ hi (lo @ lo is below fp32's
  rounding), v transposed: a TF32 product reads both shared-memory operands K-major.
- The backward reads q and dO (dK/dV) and k (dQ) both as a product's K-major operand and along their
  rows, which TF32 products cannot; 16-bit ones can. Its parts are three bf16, x = x0 + x1 + x2 exactly
  (8 significant bits each), and x @ y the six products x_i @ y_j with i + j <= 2 (bf16 products run at
  twice TF32's rate: six cost three TF32 ones).

Each tile's products go into a fresh accumulator, added to the running sum in fp32: the tensor cores'
own accumulation of a whole sequence's tiles into one sum lost 30x the exactness (an error of 3e-5
against float64, 1e-6 this way).
"""
import torch
import triton
import triton.language as tl

from ...params import AttentionParams
from ..constants import LN2, LOG2E, NO_MASK
from ..device import cdiv, scratch
from ..launch import workspace
from ..variant import Problem, logit_scale, lse_strides
from . import SplitOperands
from .common import band, query_tile, score_tile, sink_state, softmax_step, store_tile, tf32_round, tile_ptrs

# The split tensors' rows are padded to a multiple of this (the TMA's row strides want 16 bytes; rows
# past a sequence's end are zeros, so a tile reaching past them adds nothing).
ROW_PAD = 16
SPLIT_ROWS = 64  # rows per program of the split kernel


@triton.jit
def _split(X, stride_x, Out, nheads, seqlen, head_dim, rows, part_stride,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr, BF16: tl.constexpr):
    """Rows of one (batch, head) of X (batch, seqlen, nheads, head_dim) into its planes of Out, part i at
    Out + i * part_stride, each (batch * nheads, rows, BLOCK_D) or, TRANSPOSE, (batch * nheads, BLOCK_D,
    rows): the TF32 halves, or (BF16) the three bf16 parts; zeros past seqlen and head_dim."""
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(X + off_b * stride_x[0] + off_h * stride_x[2] + r[:, None].to(tl.int64) * stride_x[1] + d[None, :],
                mask=(r[:, None] < seqlen) & (d[None, :] < head_dim), other=0.0)
    plane = Out + off_bh * rows * BLOCK_D
    if TRANSPOSE:
        at = plane + d[None, :] * rows + r[:, None]
    else:
        at = plane + r[:, None] * BLOCK_D + d[None, :]
    keep = r[:, None] < rows
    if BF16:
        x0, x1, x2 = _bf16_parts(x)
        tl.store(at, x0, mask=keep)
        tl.store(at + part_stride, x1, mask=keep)
        tl.store(at + part_stride + part_stride, x2, mask=keep)  # (2 * part_stride may pass 2^31)
    else:
        hi = tf32_round(x)
        tl.store(at, hi, mask=keep)
        tl.store(at + part_stride, tf32_round(x - hi), mask=keep)


@triton.jit
def _bf16_parts(x):
    """fp32 x as three bf16 whose sum is x (each part rounds what the ones before leave)."""
    x0 = x.to(tl.bfloat16)
    r = x - x0.to(tl.float32)
    x1 = r.to(tl.bfloat16)
    return x0, x1, (r - x1.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot16(a, b, acc, INTERPRET: tl.constexpr):
    """a @ b + acc of bf16 tiles on the tensor cores; under Triton's interpreter, which has no bf16 dot,
    in fp32 (a product of two bf16 is exact in fp32 either way)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _mma6(a, b, INTERPRET: tl.constexpr):
    """a @ b of three-part bf16 operands (tuples) in a fresh fp32 accumulator, the small products first."""
    acc = _dot16(a[2], b[0], None, INTERPRET)
    acc = _dot16(a[0], b[2], acc, INTERPRET)
    acc = _dot16(a[1], b[1], acc, INTERPRET)
    acc = _dot16(a[1], b[0], acc, INTERPRET)
    acc = _dot16(a[0], b[1], acc, INTERPRET)
    return _dot16(a[0], b[0], acc, INTERPRET)


@triton.jit
def _descs(at, part_stride, rows, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Descriptors of BLOCK_ROWS x COLS tiles of the three bf16 parts of a plane of _split's (rows x COLS,
    part 0 at `at`)."""
    return (tl.make_tensor_descriptor(at, shape=[rows, COLS], strides=[COLS, 1], block_shape=[BLOCK_ROWS, COLS]),
            tl.make_tensor_descriptor(at + part_stride, shape=[rows, COLS], strides=[COLS, 1],
                                      block_shape=[BLOCK_ROWS, COLS]),
            tl.make_tensor_descriptor(at + part_stride + part_stride, shape=[rows, COLS], strides=[COLS, 1],
                                      block_shape=[BLOCK_ROWS, COLS]))


@triton.jit
def _load3(descs, row):
    """The three parts' tiles from row `row` (_descs)."""
    return descs[0].load([row, 0]), descs[1].load([row, 0]), descs[2].load([row, 0])


@triton.jit
def _trans3(x):
    return x[0].T, x[1].T, x[2].T


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
        p_hi = tf32_round(p)
        pv = _mma3(p_hi, tf32_round(p - p_hi), v_hi.load([0, start_n]).T, v_lo.load([0, start_n]).T)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _exact_fwd(QS, KS, VS, Out, Lse, Sink, stride_o, stride_l, nheads, nheads_k, seqlen_q, seqlen_k, head_dim,
               head_dim_v, rows_q, rows_k, part_q, part_k, part_v, bottom_right, window_left, window_right, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """A program per tile of BLOCK_M query rows of one (batch, head), on _split's planes: QS and KS
    (batch * heads, rows, BLOCK_D), VS (batch * nheads_k, BLOCK_DV, rows_k), each plane's lo part_*
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
    q_lo = tl.make_tensor_descriptor(q_at + part_q, shape=[rows_q, BLOCK_D], strides=[BLOCK_D, 1],
                                     block_shape=[BLOCK_M, BLOCK_D])
    kv = (tl.make_tensor_descriptor(k_at, shape=[rows_k, BLOCK_D], strides=[BLOCK_D, 1],
                                    block_shape=[BLOCK_N, BLOCK_D]),
          tl.make_tensor_descriptor(k_at + part_k, shape=[rows_k, BLOCK_D], strides=[BLOCK_D, 1],
                                    block_shape=[BLOCK_N, BLOCK_D]),
          tl.make_tensor_descriptor(v_at, shape=[BLOCK_DV, rows_k], strides=[rows_k, 1],
                                    block_shape=[BLOCK_DV, BLOCK_N]),
          tl.make_tensor_descriptor(v_at + part_v, shape=[BLOCK_DV, rows_k], strides=[rows_k, 1],
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
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
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


@triton.jit
def _exact_dkdv_inner(dk, dv, k, v, head, offs_n, offs_m, lo, hi, bounds, qk_scale, BLOCK_M: tl.constexpr,
                      MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """Query tiles [lo, hi) of one head into (dk, dv), on transposed scores (keys along rows) as
    triton/backward.py's _attn_bwd_dkdv_inner; MASKED: the band's edges and the queries' end."""
    q_descs, do_descs, first_row, lse_ptr, delta_ptr = head
    seqlen_q = bounds[0]
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = _load3(q_descs, first_row + start_m)
        do = _load3(do_descs, first_row + start_m)
        # Rows past seqlen_q read lse = +inf, so that their P is exactly 0.
        lse = tl.load(lse_ptr + rows, mask=rows < seqlen_q, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
        s_t = score_tile(_mma6(k, _trans3(q), INTERPRET) * qk_scale, rows[None, :], offs_n[:, None], bounds,
                         (0, 0, 0), MASKED, HAS_LEFT, HAS_RIGHT, NO_MASK)
        p_t = tl.math.exp2(s_t - lse[None, :] * LOG2E)  # 0 where s = -inf or lse = +inf
        dv += _mma6(_bf16_parts(p_t), do, INTERPRET)
        ds_t = p_t * (_mma6(v, _trans3(do), INTERPRET) - delta[None, :])
        dk += _mma6(_bf16_parts(ds_t), q, INTERPRET)
    return dk, dv


@triton.jit
def _exact_dkdv(QS, KS, VS, DOS, Lse, Delta, DK, DV, stride_dk, stride_dv, stride_l, nheads_k, group_size,
                seqlen_q, seqlen_k, head_dim, head_dim_v, rows_q, rows_k, part_q, part_k, part_v, part_do,
                bottom_right, window_left, window_right, softmax_scale, qk_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                INTERPRET: tl.constexpr):
    """dK, dV of BLOCK_N keys of one KV head, on _split's bf16 parts (QS, KS, DOS (batch * heads, rows,
    BLOCK_D or BLOCK_DV), part i of each part_* elements after part 0): streams the query tiles of every
    query head of the group, as triton/backward.py's _attn_bwd_dkdv."""
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1).to(tl.int64)
    off_b = off_bhk // nheads_k
    off_hk = off_bhk % nheads_k
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k = _load3(_descs(KS + off_bhk * rows_k * BLOCK_D, part_k, rows_k, BLOCK_D, BLOCK_N), start_n)
    v = _load3(_descs(VS + off_bhk * rows_k * BLOCK_DV, part_v, rows_k, BLOCK_DV, BLOCK_N), start_n)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    offset = bottom_right * (seqlen_k - seqlen_q)
    # Query row i sees key j when j - offset - window_right <= i <= j - offset + window_left.
    edges = band(start_n, BLOCK_N, seqlen_q, BLOCK_M, -offset - window_right, window_left - offset, HAS_RIGHT,
                 HAS_LEFT)
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
    # The group's query heads' planes, one after another, in one descriptor each (made here: Triton 3.6's
    # pipeliner fails on descriptors made in the heads' loop where seqlen_q is 1). A tile reaching past a
    # head's rows reads the next head's (or TMA's zeros), as rows past seqlen_q, whose P is 0.
    first_bh = off_b * nheads_k * group_size + off_hk * group_size
    q_descs = _descs(QS + first_bh * rows_q * BLOCK_D, part_q, group_size * rows_q, BLOCK_D, BLOCK_M)
    do_descs = _descs(DOS + first_bh * rows_q * BLOCK_DV, part_do, group_size * rows_q, BLOCK_DV, BLOCK_M)
    for g in range(0, group_size):
        off_h = off_hk * group_size + g
        row_first = off_b * stride_l[0] + off_h * stride_l[1]
        head = (q_descs, do_descs, g * rows_q, Lse + row_first, Delta + row_first)
        # One masked loop over the band's query tiles: 2-4% faster at D=128 than a loop per part of the band
        # with the whole tiles unmasked, as triton/backward.py's (docs/tuning.md).
        dk, dv = _exact_dkdv_inner(dk, dv, k, v, head, offs_n, offs_m, edges[0], edges[3], bounds, qk_scale,
                                   BLOCK_M, True, HAS_LEFT, HAS_RIGHT, INTERPRET)
    cols = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ptrs = tile_ptrs(DK, stride_dk, off_b, off_hk, start_n, cols, offs_d)
    dv_ptrs = tile_ptrs(DV, stride_dv, off_b, off_hk, start_n, cols, offs_dv)
    store_tile(dk_ptrs, dk * softmax_scale, offs_n, seqlen_k, offs_d, head_dim, not EVEN_D)
    store_tile(dv_ptrs, dv, offs_n, seqlen_k, offs_dv, head_dim_v, not EVEN_DV)


@triton.jit
def _exact_dq_inner(dq, q, do, lse, delta, kv, offs_m, offs_n, lo, hi, bounds, qk_scale, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, INTERPRET: tl.constexpr):
    """Key tiles [lo, hi) into dq; MASKED: the band's edges and the keys' end."""
    k_descs, v_descs = kv
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = _load3(k_descs, start_n)
        v = _load3(v_descs, start_n)
        s = score_tile(_mma6(q, _trans3(k), INTERPRET) * qk_scale, offs_m[:, None], (start_n + offs_n)[None, :],
                       bounds, (0, 0, 0), MASKED, HAS_LEFT, HAS_RIGHT, NO_MASK)
        p = tl.math.exp2(s - lse[:, None])
        ds = p * (_mma6(do, _trans3(v), INTERPRET) - delta[:, None])
        dq += _mma6(_bf16_parts(ds), k, INTERPRET)
    return dq


@triton.jit
def _exact_dq(QS, KS, VS, DOS, Lse, Delta, DQ, stride_dq, stride_l, nheads, nheads_k, seqlen_q, seqlen_k, head_dim,
              head_dim_v, rows_q, rows_k, part_q, part_k, part_v, part_do, bottom_right, window_left, window_right,
              softmax_scale, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              INTERPRET: tl.constexpr):
    """dQ of BLOCK_M query rows of one (batch, head), on _split's bf16 parts, as triton/backward.py's
    _attn_bwd_dq."""
    start_m = query_tile(HAS_RIGHT) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_bhk = off_b * nheads_k + off_h // (nheads // nheads_k)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load3(_descs(QS + off_bh * rows_q * BLOCK_D, part_q, rows_q, BLOCK_D, BLOCK_M), start_m)
    do = _load3(_descs(DOS + off_bh * rows_q * BLOCK_DV, part_do, rows_q, BLOCK_DV, BLOCK_M), start_m)
    row_ptr = off_b * stride_l[0] + off_h * stride_l[1] + offs_m
    lse = tl.load(Lse + row_ptr, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_ptr, mask=offs_m < seqlen_q, other=0.0)
    kv = (_descs(KS + off_bhk * rows_k * BLOCK_D, part_k, rows_k, BLOCK_D, BLOCK_N),
          _descs(VS + off_bhk * rows_k * BLOCK_DV, part_v, rows_k, BLOCK_DV, BLOCK_N))
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offset = bottom_right * (seqlen_k - seqlen_q)
    edges = band(start_m, BLOCK_M, seqlen_k, BLOCK_N, offset - window_left, offset + window_right, HAS_LEFT,
                 HAS_RIGHT)
    bounds = (seqlen_q, seqlen_k, (head_dim, head_dim_v), offset, window_left, window_right)
    dq = _exact_dq_inner(dq, q, do, lse, delta, kv, offs_m, tl.arange(0, BLOCK_N), edges[0], edges[3], bounds,
                         qk_scale, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, INTERPRET)  # (one masked loop, as dK/dV's)
    offs_d = tl.arange(0, BLOCK_D)
    dq_ptrs = tile_ptrs(DQ, stride_dq, off_b, off_h, start_m, tl.arange(0, BLOCK_M), offs_d)
    store_tile(dq_ptrs, dq * softmax_scale, offs_m, seqlen_q, offs_d, head_dim, not EVEN_D)


def _split_launch(x: torch.Tensor, prob: Problem, rows: int, block_d: int, name: str, t: dict, transpose: bool = False,
                  bf16: bool = False):
    """The split of x (batch, seqlen, heads, head_dim) into the new workspace t[name] (_split): its TF32
    halves' planes or (bf16) its three bf16 parts'."""
    batch, seqlen, heads, head_dim = x.shape
    shape = (3 if bf16 else 2, batch * heads, rows * block_d)
    t[name] = out = workspace(shape, torch.bfloat16 if bf16 else torch.float32, x.device, zeroed=False)
    return _split, (cdiv(rows, SPLIT_ROWS), batch * heads), dict(
        X=x, stride_x=prob.strides(x), Out=out, nheads=heads, seqlen=seqlen, head_dim=head_dim, rows=rows,
        part_stride=out[0].numel(), BLOCK_R=SPLIT_ROWS, BLOCK_D=block_d, TRANSPOSE=transpose, BF16=bf16,
        num_warps=4, num_stages=1)


def _rows(prob: Problem) -> tuple[int, int]:
    """The split planes' query and key rows."""
    return cdiv(prob.seqlen_q, ROW_PAD) * ROW_PAD, cdiv(prob.seqlen_k, ROW_PAD) * ROW_PAD


def _shared(prob: Problem, params: AttentionParams, tiles) -> dict:
    """The arguments every attention kernel here takes (the head dims' as every Triton kernel's:
    Problem.dims)."""
    if prob.q.is_cuda:
        triton.set_allocator(scratch)  # the kernels build their tensor descriptors in global scratch
    return dict(stride_l=lse_strides(prob, params), seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k,
                bottom_right=int(params.bottom_right), window_left=params.window_left,
                window_right=params.window_right, qk_scale=logit_scale(params), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages, **prob.dims())


def launches(t: dict, prob: Problem, params: AttentionParams, cfg: SplitOperands) -> list[tuple]:
    """The forward: the split of q, k and v into workspaces, then the attention kernel, a program per
    tile of cfg.tiles.block_m query rows of one (batch, head)."""
    tiles = cfg.tiles
    rows_q, rows_k = _rows(prob)
    splits = [_split_launch(prob.q, prob, rows_q, prob.block_d, "QS", t),
              _split_launch(prob.k, prob, rows_k, prob.block_d, "KS", t),
              _split_launch(prob.v, prob, rows_k, prob.block_dv, "VS", t, transpose=True)]
    grid = (cdiv(prob.seqlen_q, tiles.block_m), prob.batch * prob.nheads)
    return [*splits, (_exact_fwd, grid, dict(
        QS=t["QS"], KS=t["KS"], VS=t["VS"], Out=t["Out"], Lse=t["Lse"], Sink=t.get("Sink"),
        stride_o=prob.strides(t["Out"]), nheads=prob.nheads, nheads_k=prob.nheads_k, rows_q=rows_q, rows_k=rows_k,
        part_q=t["QS"][0].numel(), part_k=t["KS"][0].numel(), part_v=t["VS"][0].numel(),
        **_shared(prob, params, tiles)))]


def backward_launches(t: dict, prob: Problem, params: AttentionParams, dkdv: SplitOperands,
                      dq: SplitOperands) -> list[tuple]:
    """The backward after delta (t["Delta"]): the split of q, k, v and dO into workspaces of bf16 parts,
    then the dK/dV kernel (a program per dkdv.tiles.block_n keys of one KV head) and the dQ kernel (a
    program per dq.tiles.block_m query rows of one head)."""
    assert prob.dout is not None  # (a backward's problem)
    rows_q, rows_k = _rows(prob)
    launches = [_split_launch(prob.q, prob, rows_q, prob.block_d, "QS", t, bf16=True),
                _split_launch(prob.k, prob, rows_k, prob.block_d, "KS", t, bf16=True),
                _split_launch(prob.v, prob, rows_k, prob.block_dv, "VS", t, bf16=True),
                _split_launch(prob.dout, prob, rows_q, prob.block_dv, "DOS", t, bf16=True)]
    parts = dict(QS=t["QS"], KS=t["KS"], VS=t["VS"], DOS=t["DOS"], Lse=t["Lse"], Delta=t["Delta"],
                 rows_q=rows_q, rows_k=rows_k,
                 part_q=t["QS"][0].numel(), part_k=t["KS"][0].numel(), part_v=t["VS"][0].numel(),
                 part_do=t["DOS"][0].numel(), softmax_scale=params.softmax_scale,
                 INTERPRET=not isinstance(_exact_dq, triton.JITFunction))
    launches.append((_exact_dkdv, (cdiv(prob.seqlen_k, dkdv.tiles.block_n), prob.batch * prob.nheads_k), dict(
        DK=t["DK"], DV=t["DV"], stride_dk=prob.strides(t["DK"]), stride_dv=prob.strides(t["DV"]),
        nheads_k=prob.nheads_k, group_size=prob.nheads // prob.nheads_k, **parts, **_shared(prob, params, dkdv.tiles))))
    launches.append((_exact_dq, (cdiv(prob.seqlen_q, dq.tiles.block_m), prob.batch * prob.nheads), dict(
        DQ=t["DQ"], stride_dq=prob.strides(t["DQ"]), nheads=prob.nheads, nheads_k=prob.nheads_k,
        **parts, **_shared(prob, params, dq.tiles))))
    return launches
