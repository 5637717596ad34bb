"""The Gluon kernels for Hopper (warp-specialized, TMA and wgmma): the plain forward of 16-bit inputs
at head dims 64, 128 and 256 and at DeepSeek's (192, 128) (q and k 192, v 128), and its backward (at 256
the dK/dV pass only). This module holds what
kernels/plan.py needs without importing Gluon: each kernel's configuration type and `accepts`, which
calls they compute; the kernels are forward.py and backward.py, their shared building blocks
common.py (GPU only: Triton's interpreter does not run Gluon)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...params import AttentionParams
from ..compat import GLUON_TRITON
from ..device import tma_addressable
from ..variant import Problem


ROWS = 64  # query rows per consumer warpgroup: one wgmma M (common.ROWS)


@dataclass(frozen=True)
class Forward:
    """consumers: warpgroups of 64 query rows each (2, or 3 where their registers hold D=64);
    block_n: the key tile (128; 64: fewer keys past a short sequence's end and less of a causal
    diagonal computed, at twice the tiles; 64 or 32 at D=256); stages: the ring of K/V buffers;
    early_k: each K buffer goes back to the loader once every S product has read it, before its V's
    products are done (not where O leaves through the item's last K tile: one Q buffer, and key tiles
    as tall as the item's query rows, as D=128 with 128-key tiles); turns: the consumers issue their
    matrix products in turn, round-robin on hardware barriers (common.take_turn)."""
    consumers: int = 2
    block_n: int = 128
    stages: int = 3
    early_k: bool = False
    turns: bool = False

    def __post_init__(self):
        if self.consumers not in (2, 3) or self.block_n not in (32, 64, 128):
            raise ValueError(f"the Gluon forward runs 2 or 3 consumer warpgroups and 32-, 64- or 128-key tiles, not "
                             f"{self.consumers} and {self.block_n}")


@dataclass(frozen=True)
class Dkdv:
    """fuse_dq: also add dQ to an fp32 workspace by TMA reductions, replacing the dQ pass (up to
    D=128; not in a deterministic backward: the additions' order varies); stages: the ring of Q/dO
    buffers."""
    fuse_dq: bool = False
    stages: int = 2


@dataclass(frozen=True)
class Dq:
    """block_n: the key tile (2 x 64: dQ leaves through a V tile; at (192, 128) 64, dQ leaving through
    the Q tiles, which hold its two parts); stages: the ring of K/V buffers."""
    block_n: int = 128
    stages: int = 2


def accepts(prob: Problem, params: AttentionParams) -> bool:
    """Whether the Gluon kernels compute the call: the plain attention (causal or not, GQA, a positive
    softmax_scale; mods, softcap's and ALiBi's among them, where plan.py's _within_blocks keeps a Gluon
    candidate: the forward, and dK/dV up to head dim 128, their tiles fitted to a block mask's blocks)
    of 16-bit inputs with head dims (q's and k's, v's) in HEAD_DIMS (a backward at 256: dK/dV unfused,
    the dQ pass Triton's; at (192, 128) dK/dV unfused), that the tensor memory accelerator can address (with dO in a
    backward), under a Triton whose Gluon they were written against (3.6 run, 3.9 compiled; Gluon changed
    its API between the releases that have it, so older ones take the Triton kernels)."""
    plain = (params.window_left < 0 and params.window_right in (-1, 0) and params.attn_mask is None
             and params.dropout_p == 0 and params.softmax_scale > 0)
    streamed: tuple[torch.Tensor, ...] = (prob.q, prob.k, prob.v)
    if prob.dout is not None:
        streamed = (*streamed, prob.dout)
    return (GLUON_TRITON and plain and not prob.varlen and (prob.head_dim, prob.head_dim_v) in HEAD_DIMS
            and prob.q.dtype in (torch.float16, torch.bfloat16) and tma_addressable(*streamed))


# (q's and k's head dim, v's) the Gluon kernels take (DeepSeek's MLA: (192, 128)).
HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
