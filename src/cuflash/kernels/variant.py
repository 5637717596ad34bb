"""What the three kernels share at launch: the problem's sizes and the arguments that select and
feed a variant (varlen, window, softcap, ALiBi, attn_mask, dropout). Each option is a constexpr,
so the plain path compiles to the same code it had before the options existed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import AttentionParams
from .constants import ADDITIVE_MASK, BOOL_MASK, LOG2E, NO_MASK
from .device import padded_head_dim


@dataclass(frozen=True)
class Problem:
    """q, k, v as 4-D (batch, seqlen, nheads, headdim) views. A varlen batch is one long row of
    sequences (batch stride 0), seqlen_q / seqlen_k are then the longest sequence's. dout: the
    output's gradient, shaped like q, in a backward (None in a forward)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    batch: int
    seqlen_q: int
    seqlen_k: int
    varlen: bool
    dout: torch.Tensor | None = None

    @property
    def nheads(self) -> int:
        return self.q.shape[2]

    @property
    def nheads_k(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.head_dim)

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """The (batch, row, head) strides of t, shaped like q or k (3-D when varlen, with batch stride
        0: the batch is one row of sequences)."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)


def problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams,
            dout: torch.Tensor | None = None) -> Problem:
    if p.cu_seqlens_q is not None:  # varlen
        if p.block_table is not None:  # pages (num_blocks, page, Hk, D): one page's rows stand for the keys
            k, v = k[0], v[0]
        return Problem(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), p.cu_seqlens_q.numel() - 1,
                       p.max_seqlen_q, p.max_seqlen_k, True, None if dout is None else dout.unsqueeze(0))
    return Problem(q, k, v, q.shape[0], q.shape[1], k.shape[1], False, dout)


def lse_strides(prob: Problem, p: AttentionParams) -> tuple[int, int]:
    """The (batch, head) strides of softmax_lse: (batch, nheads, seqlen_q), or (nheads, total_q) for
    varlen."""
    if p.varlen:
        return 0, prob.q.shape[1]
    return prob.nheads * prob.seqlen_q, prob.seqlen_q


def logit_scales(p: AttentionParams) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels' logits() takes them: logits in base 2; with softcap,
    tanh takes scale / softcap and its result is scaled back by softcap * LOG2E."""
    if p.softcap > 0:
        return p.softmax_scale / p.softcap, p.softcap * LOG2E.value
    return p.softmax_scale * LOG2E.value, 0.0


def _tensor_fields(p: AttentionParams) -> dict:
    return dict(CuSeqlensQ=p.cu_seqlens_q, CuSeqlensK=p.cu_seqlens_k, Slopes=p.alibi_slopes, Mask=p.attn_mask,
                Rng=p.rng_seed)


def variant_tensors(p: AttentionParams) -> dict:
    """The variant's tensors that this call has (varlen offsets, ALiBi slopes, attn_mask, dropout
    seed), by their argument names in every kernel."""
    return {name: t for name, t in _tensor_fields(p).items() if t is not None}


def variant_args(p: AttentionParams) -> dict:
    """The variant's other arguments (strides, scalars, constexpr flags, and None for the tensors
    the call does not have: Triton makes None a constant, and the flags compile their reads away),
    named as in every kernel."""
    mask = p.attn_mask
    mask_strides: tuple[int, ...] = (0, 0, 0, 0)
    if mask is None:
        mask_kind = NO_MASK.value
    else:
        mask_kind = BOOL_MASK.value if mask.dtype == torch.bool else ADDITIVE_MASK.value
        mask_strides = mask.stride()
    slopes = p.alibi_slopes
    qk_scale, softcap = logit_scales(p)
    return dict(
        **{name: None for name, t in _tensor_fields(p).items() if t is None},
        stride_slope_b=0 if slopes is None or slopes.dim() == 1 else slopes.stride(0),
        stride_mask=mask_strides,
        bottom_right=int(p.bottom_right), window_left=p.window_left, window_right=p.window_right,
        qk_scale=qk_scale, softcap=softcap,
        drop_threshold=int(p.dropout_p * 2**31), drop_scale=1.0 / (1.0 - p.dropout_p),
        VARLEN=p.varlen, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
        SOFTCAP=p.softcap > 0, ALIBI=slopes is not None, MASK_KIND=mask_kind, DROPOUT=p.dropout_p > 0,
    )
