"""What the three kernels share at launch: the problem's sizes and the arguments that select and
feed a variant (varlen, window, attn_mask, dropout, and the mods, softcap's and ALiBi's among them).
Each option is a constexpr, so the plain path compiles to the same code it had before the options
existed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import AttentionParams
from .constants import ADDITIVE_MASK, BOOL_MASK, LOG2E, NO_MASK
from .device import padded_head_dim
from .triton import mods as mod_code


@dataclass(frozen=True)
class Problem:
    """q, k, v as 4-D (batch, seqlen, nheads, headdim) views, v's head dim head_dim_v (which may differ
    from q's and k's head_dim). A varlen batch is one long row of sequences (batch stride 0), seqlen_q /
    seqlen_k are then the longest sequence's. dout: the output's gradient, shaped like the output (q's
    shape with v's head dim), in a backward (None in a forward)."""
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
    def head_dim_v(self) -> int:
        return self.v.shape[3]

    @property
    def block_d(self) -> int:
        """q's and k's head dim as the kernels' tiles hold it (BLOCK_D)."""
        return padded_head_dim(self.head_dim)

    @property
    def block_dv(self) -> int:
        """v's, the output's and dO's (BLOCK_DV)."""
        return padded_head_dim(self.head_dim_v)

    def dims(self) -> dict:
        """The head-dim arguments every Triton kernel takes: head_dim, head_dim_v, their tiles BLOCK_D,
        BLOCK_DV, and EVEN_D, EVEN_DV where a tile is the head dim exactly (no column masks)."""
        return dict(head_dim=self.head_dim, head_dim_v=self.head_dim_v, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
                    EVEN_D=self.head_dim == self.block_d, EVEN_DV=self.head_dim_v == self.block_dv)

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


def logit_scale(p: AttentionParams) -> float:
    """The scale of q.k in the kernels: to base-2 logits (exp2 in the softmax), or with a score_mod to
    natural ones (the mod sees scale * q.k, as FlexAttention's; score_tile turns its result into base 2)."""
    if p.mods is not None and p.mods.score is not None:
        return p.softmax_scale
    return p.softmax_scale * LOG2E.value


def _tensor_fields(p: AttentionParams) -> dict:
    return dict(CuSeqlensQ=p.cu_seqlens_q, CuSeqlensK=p.cu_seqlens_k, SeqUsedQ=p.seqused_q, SeqUsedK=p.seqused_k,
                Mask=p.attn_mask, Rng=p.rng_seed)


def variant_tensors(p: AttentionParams) -> dict:
    """The variant's tensors that this call has (varlen offsets and used lengths, attn_mask, dropout seed;
    a block mask's tile lists), by their argument names in every kernel, the learnable sink (Sink: the
    forward kernels' only; the backward's run without it, kernels/attention.py), and the tensors its
    mods capture (under names starting with MOD_TENSOR, which no kernel has: they reach the kernels
    inside the mods' argument tuples, mod_args)."""
    tensors = {name: t for name, t in _tensor_fields(p).items() if t is not None}
    if p.learnable_sink is not None:
        tensors["Sink"] = p.learnable_sink
    mods = p.mods
    if mods is None:
        return tensors
    for part, mod in (("score", mods.score), ("mask", mods.mask)):
        if mod is not None:
            tensors.update({f"{MOD_TENSOR}{part} {i}": t for i, t in enumerate(mod.tensors)})
    tensors.update({f"{MOD_TENSOR}grad {i}": t for i, t in enumerate(mods.grads or ())})
    if mods.blocks is not None:
        tensors.update({f"{MOD_TENSOR}{field}": getattr(mods.blocks, field) for field in _BLOCK_FIELDS.values()
                        if getattr(mods.blocks, field) is not None})
    return tensors


MOD_TENSOR = "mod "
_BLOCK_FIELDS = dict(KvNum="kv_num", KvIdx="kv_idx", FullKvNum="full_kv_num", FullKvIdx="full_kv_idx",
                     QNum="q_num", QIdx="q_idx", FullQNum="full_q_num", FullQIdx="full_q_idx")


def kernel_tensors(t: dict) -> dict:
    """The tensors of a launch's `t` that are kernel arguments by name (not a mod's captures)."""
    return {name: x for name, x in t.items() if not name.startswith(MOD_TENSOR)}


def mod_args(p: AttentionParams, prob: Problem, pass_: str) -> dict:
    """The arguments of the mods and the block mask, by their names in the kernel of `pass_` ("fwd",
    "dkdv", "dq"): SCORE_MOD / MASK_MOD (the mods' Triton functions, or None), their argument tuples,
    in the backward SCORE_MOD_GRAD (the score_mod's gradient; in dkdv adding the captured tensors'
    gradients into mods.grads, in dq without: each is added once), and the block mask: SPARSE, its
    block sizes, its tile lists (by key block for dkdv, by query block otherwise) and their strides."""
    mods = p.mods
    score = None if mods is None else mods.score
    mask = None if mods is None else mods.mask
    blocks = None if mods is None else mods.blocks
    fast = fast_math(prob.q)
    args: dict = dict(
        SCORE_MOD=None if score is None else mod_code.forward_function(score.graph, fast),
        MASK_MOD=None if mask is None else mod_code.forward_function(mask.graph, fast),
        score_args=(0,) if score is None else mod_code.kernel_args(list(score.tensors), list(score.scalars)),
        mask_args=(0,) if mask is None else mod_code.kernel_args(list(mask.tensors), list(mask.scalars)),
    )
    if pass_ != "fwd":
        grads = pass_ == "dkdv" and mods is not None and mods.grads is not None
        needed = () if score is None else score.requires_grad if grads else (False,) * len(score.tensors)
        args["SCORE_MOD_GRAD"] = None if score is None else mod_code.backward_function(score.graph, needed, fast)
        args["score_grads"] = mod_code.grad_args(list(mods.grads) if grads and mods is not None and mods.grads
                                                 else [])
    by_key = pass_ == "dkdv"
    names = ("QNum", "QIdx", "FullQNum", "FullQIdx") if by_key else ("KvNum", "KvIdx", "FullKvNum", "FullKvIdx")
    lists = [None if blocks is None else getattr(blocks, _BLOCK_FIELDS[n]) for n in names]
    args.update(dict(zip(("BlockNum", "BlockIdx", "FullNum", "FullIdx"), lists)))
    args.update(
        stride_blocks=tuple((0,) * (3 + i % 2) if t is None else t.stride() for i, t in enumerate(lists)),
        SPARSE=blocks is not None, HAS_FULL=lists[2] is not None,
        SPARSE_Q=0 if blocks is None else blocks.q_block, SPARSE_KV=0 if blocks is None else blocks.kv_block,
        EVEN_BLOCKS=blocks is not None and prob.seqlen_q % blocks.q_block == 0 and prob.seqlen_k % blocks.kv_block == 0,
    )
    return args


def fast_math(q: torch.Tensor) -> bool:
    """Whether the mods may compute tanh by the GPU's approximation (triton/common.tanh's FAST): 16-bit
    queries on the GPU."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"


def variant_args(p: AttentionParams, prob: Problem) -> dict:
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
    return dict(
        **{name: None for name, t in _tensor_fields(p).items() if t is None},
        stride_mask=mask_strides,
        bottom_right=int(p.bottom_right), window_left=p.window_left, window_right=p.window_right,
        qk_scale=logit_scale(p),
        drop_threshold=int(p.dropout_p * 2**31), drop_scale=1.0 / (1.0 - p.dropout_p),
        VARLEN=p.varlen, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
        MASK_KIND=mask_kind, DROPOUT=p.dropout_p > 0,
    )
