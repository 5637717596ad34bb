"""The one description of an attention call that every entry point builds and every backend
consumes: which keys each query sees (causal, sliding window, varlen, attn_mask), how the logits
are shaped (scale, softcap, ALiBi), a learnable sink and dropout."""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .mods import Mods


@dataclass(frozen=True)
class AttentionParams:
    """Query row i (counted within its sequence) sees key j when
    i + offset - window_left <= j <= i + offset + window_right, a bound of -1 being no bound,
    where offset = seqlen_k - seqlen_q with bottom_right (flash-attn) and 0 without (torch SDPA).
    Causal attention is window_right = 0.

    Varlen: q, k, v are (total, nheads, headdim) and the sequences of the batch are the row
    ranges given by the int32 prefix sums cu_seqlens_q / cu_seqlens_k (batch + 1 entries), the
    longest being max_seqlen_q / max_seqlen_k; softmax_lse is then (nheads, total_q).
    Otherwise q, k, v are (batch, seqlen, nheads, headdim) and softmax_lse (batch, nheads, seqlen_q).
    seqused_q / seqused_k (FlashAttention-3's), (batch,) int32, varlen only: sequence b uses only the
    first seqused_q[b] of its query rows and seqused_k[b] of its keys, and is attention over those
    alone (causal's offset is seqused_k[b] - seqused_q[b]); the other rows are not read, their out is
    0 and their softmax_lse +inf (as a row that sees no key), and their dq, dk, dv are 0.

    softcap > 0 replaces the logit x = scale * q.k by softcap * tanh(x / softcap); ALiBi then adds
    -slope * |i + offset - j| with alibi_slopes of shape (nheads,) or (batch, nheads), fp32;
    attn_mask, a (batch, nheads, seqlen_q, seqlen_k) view (broadcast dims have stride 0), either
    hides keys (bool, True = attend) or is added to the logits (float). Dropout zeroes each
    probability with probability dropout_p, drawn by a counter-based hash keyed by rng_seed
    (two int64 words in [0, 2^31), on the device of q), and scales the rest by 1 / (1 - dropout_p).
    learnable_sink (nheads,) (fp32, fp16 or bf16, fp64 on the CPU path; gpt-oss's attention sinks,
    FlashAttention-4's learnable_sink): one more logit per query head in every row's softmax, compared
    with the scaled logits as it is (no scale, softcap, ALiBi or mod applies to it), with no value: it
    takes its share of each row's probability and adds nothing to the output, and softmax_lse counts
    it (a row that sees no key has out 0 and lse = sink). Dropout drops key probabilities only.
    deterministic asks for a backward that is bitwise reproducible run to run (otherwise the
    fastest one, which may add dQ in a varying order).

    Paged varlen (forward only): with block_table (batch, max_blocks_per_seq) int32, k and v are
    caches of pages (num_blocks, page_block_size, nheads_k, headdim); key j of sequence b is row
    j % page_block_size of page block_table[b, j // page_block_size], and cu_seqlens_k gives each
    sequence's key count (it indexes no rows of k).

    block_m, block_n: the tiles of query rows and keys (Br and Bc in the FlashAttention papers) the
    call asks for, honoured by the CPU path and the Triton kernels; 0: the tuned table's.

    mods: a score_mod, a mask_mod and a block mask (cuflash.mods.Mods), on top of the rest; the score
    the score_mod sees is scale * q.k (after softcap, before ALiBi and attn_mask), as FlexAttention's.
    The backends compute softcap and ALiBi as score_mods too (builtin_mods.resolved).
    """

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    learnable_sink: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng_seed: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    deterministic: bool = False
    block_table: torch.Tensor | None = None
    block_m: int = 0
    block_n: int = 0
    mods: Mods | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def banded(self) -> bool:
        """Causal or a sliding window: each query sees a band of keys near the diagonal."""
        return self.window_left >= 0 or self.window_right >= 0

    def sequence(self) -> AttentionParams:
        """The dense params of one sequence of a varlen batch (whose index the backends pass on: ALiBi's
        (batch, nheads) slopes and the mods read it)."""
        return dataclasses.replace(self, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                                   block_table=None)

    def seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's query and key counts of a varlen batch as the backends use them, (batch,)
        tensors on the device: seqused_q / seqused_k where given, else the prefix sums' differences."""
        assert self.cu_seqlens_q is not None and self.cu_seqlens_k is not None
        return used_lengths(self.cu_seqlens_q, self.seqused_q), used_lengths(self.cu_seqlens_k, self.seqused_k)

    def spans(self) -> list[tuple[int, slice, slice]]:
        """(b, its query rows, its key rows) for each sequence of a varlen batch: the rows its prefix sums
        give it, the first seqused_q[b] / seqused_k[b] of them where given (a host copy of the values;
        with block_table the key rows only count its keys: sequence_keys)."""
        assert self.cu_seqlens_q is not None and self.cu_seqlens_k is not None
        cu_q, cu_k = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        used_q = cu_q[1:] if self.seqused_q is None else [a + n for a, n in zip(cu_q, self.seqused_q.tolist())]
        used_k = cu_k[1:] if self.seqused_k is None else [a + n for a, n in zip(cu_k, self.seqused_k.tolist())]
        return [(b, slice(cu_q[b], used_q[b]), slice(cu_k[b], used_k[b])) for b in range(len(cu_q) - 1)]

    def sequence_keys(self, t: torch.Tensor, b: int, start: int, end: int) -> torch.Tensor:
        """The keys (or values) of sequence b of a varlen batch, whose prefix sums put them at rows
        start:end: those rows of t, or with block_table the first end - start rows of its pages
        (a gather, for the CPU path and return_attn_probs; the kernels read pages in place)."""
        if self.block_table is None:
            return t[start:end]
        page = t.shape[1]
        pages = self.block_table[b, :-(-(end - start) // page)].long()
        return t[pages].flatten(0, 1)[:end - start]

    def lse_shape(self, q: torch.Tensor) -> tuple:
        """softmax_lse's shape for q: (batch, nheads, seqlen_q), varlen (nheads, total_q)."""
        return (q.shape[1], q.shape[0]) if self.varlen else (q.shape[0], q.shape[2], q.shape[1])

    def key(self) -> tuple:
        """The scalar fields and which tensor fields are given: with the tensors' shapes, strides
        and dtypes, all a kernel launch's arguments depend on but the tensors' addresses."""
        return _SCALARS(self) + tuple(t is None for t in _TENSORS(self))

    def as_args(self) -> tuple:
        """The fields of OP_FIELD_NAMES in order: the custom ops' arguments after q, k, v (and before the
        mods, which they take packed: ops.op_args)."""
        return tuple(getattr(self, name) for name in OP_FIELD_NAMES)  # (traced by torch.compile)

    def tensors(self) -> tuple:
        """The tensor fields (None where not given), in a fixed order (with_tensors')."""
        return _TENSORS(self)

    @property
    def holds_tensors(self) -> bool:
        """Whether any tensor field is given."""
        return _TENSORS(self).count(None) != len(_TENSOR_NAMES)

    def with_tensors(self, tensors: tuple) -> AttentionParams:
        """These params with the tensor fields `tensors`, in tensors()' order."""
        return dataclasses.replace(self, **dict(zip(_TENSOR_NAMES, tensors)))


def used_lengths(cu_seqlens: torch.Tensor, seqused: torch.Tensor | None) -> torch.Tensor:
    """The rows each sequence uses: seqused where given, else the lengths its prefix sums cu_seqlens give."""
    return cu_seqlens.diff() if seqused is None else seqused


def per_sequence(x: torch.Tensor | int, batch: int, device: torch.device) -> torch.Tensor:
    """A (batch,) long tensor of x, given per sequence or as one int for all."""
    return x.long() if isinstance(x, torch.Tensor) else torch.full((batch,), x, dtype=torch.long, device=device)


def empty_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous output of attention: q's shape with v's head dim (the two may differ),
    q's dtype and device (empty_like where the head dims agree: the cheaper call, on every forward)."""
    if q.shape[-1] == v.shape[-1]:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AttentionParams))
# The custom ops' arguments, which rebuild the params positionally (AttentionParams(*args)): the fields
# before mods, the last one (the ops take it packed, ops.op_args).
OP_FIELD_NAMES = FIELD_NAMES[:FIELD_NAMES.index("mods")]
_TENSOR_NAMES = ("alibi_slopes", "learnable_sink", "attn_mask", "rng_seed", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                 "seqused_k", "block_table")
# key()'s field getters, in C (a Python loop over the fields costs microseconds per launch).
_SCALARS = operator.attrgetter(*(name for name in FIELD_NAMES if name not in _TENSOR_NAMES))
_TENSORS = operator.attrgetter(*_TENSOR_NAMES)
