"""The Triton kernels: every input the API accepts, on every GPU from Ampere on and, through
Triton's interpreter, on the CPU. Their launch configuration is `Tiles`; the Triton family takes
every call, so a table entry's candidates end with Tiles (kernels/plan.py). The decode kernel's is
`DecodeLaunch` (plan.select_decode)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from ..device import scratch, tma_addressable

if TYPE_CHECKING:
    from ...params import AttentionParams
    from ..variant import Problem


@dataclass(frozen=True)
class Tiles:
    """A Triton kernel's launch: block_m x block_n tiles (query rows x keys), warps, pipeline depth."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    input_precision: str = "ieee"  # of fp32 dots: ieee, tf32x3 (both exact) or tf32 (allow_tf32)
    tma: bool = False  # stream the loop's tiles through tensor descriptors (Hopper and later)
    warp_specialize: bool = False  # (with tma) the unmasked loop split into producer and consumer warps

    def on(self, seqlens: tuple[int, int], *streamed: torch.Tensor) -> Tiles:
        """These tiles as they run where the loop streams the tensors `streamed` (none: read through
        pointers, as paged keys are): tensor descriptors where asked for, neither sequence length is 1
        and the copy engine can address each tensor; warp specialization only with them (Triton 3.6
        cannot compile it for pointer loads on Hopper). Installs the allocator descriptors need.
        Length 1: Triton specializes an argument equal to 1 into a constant, and with it Triton 3.6
        fails to compile descriptor loops (the dK/dV pipeliner for seqlen_q 1 with GQA, ptxas crashing
        on the D=256 causal forward for 1 x 1)."""
        if self.tma and streamed and min(seqlens) > 1 and tma_addressable(*streamed):
            if streamed[0].is_cuda:
                triton.set_allocator(scratch)
            return self
        return dataclasses.replace(self, tma=False, warp_specialize=False)


@dataclass(frozen=True)
class OneLaunch:
    """A dK/dV candidate: the Triton dK/dV kernel on `tiles` computing delta and dQ as well, the whole
    backward in one launch (no atomics: deterministic). Taken where the key tile holds every key and
    the kernel's programs (one per batch and KV head, each through its query heads one after another)
    come to at most MAX_HEADS_PER_SM heads per SM: there a short backward costs its launches more than
    its arithmetic. Beyond that the three-launch backward's parallel dQ pass wins (up to 128 keys,
    docs/tuning.md). A program also runs all of its heads' query tiles: the GPU table lists this
    candidate only where the queries are short too (its length class bounds both; the interpreter's,
    for the tests, at every length)."""
    tiles: Tiles
    MAX_HEADS_PER_SM = 4

    def takes(self, seqlen_k: int, batch: int, nheads: int, nheads_k: int, sms: int) -> bool:
        waves = -(-batch * nheads_k // sms)
        return seqlen_k <= self.tiles.block_n and nheads // nheads_k * waves <= self.MAX_HEADS_PER_SM


@dataclass(frozen=True)
class SplitOperands:
    """A candidate of each pass: exact fp32 on operands split once (kernels/triton/exact.py; the
    forward's in TF32 halves, the backward's in three bf16 parts, its dK/dV and dQ candidates listed
    together), on `tiles` (block_m x block_n, warps, the pipeline's stages). It takes fp32 calls up to
    head dim 256 without attn_mask, dropout, mods (softcap's and ALiBi's among them), varlen, seqused or
    pages: causal or not, windows, GQA, a learnable sink; the rest take Triton tiles."""
    tiles: Tiles

    @staticmethod
    def accepts(prob: Problem, params: AttentionParams) -> bool:
        return (prob.q.dtype == torch.float32 and not prob.varlen and params.attn_mask is None
                and params.dropout_p == 0 and params.mods is None and params.block_table is None
                and params.seqused_q is None and params.seqused_k is None and max(prob.block_d, prob.block_dv) <= 256)


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's launch (kernels/triton/decode.py): `tiles`, of which a program takes
    block_m query rows (tokens x the query heads of one KV head), m_tiles programs covering them;
    each sequence's keys in `splits` splits, merged by the combine kernel where more than one, a
    split's keys spanning at most share_pages page-table entries (0: no page table); prefetch_pages:
    the page of each key read a tile ahead."""
    tiles: Tiles
    block_m: int
    m_tiles: int
    splits: int
    share_pages: int
    prefetch_pages: bool
