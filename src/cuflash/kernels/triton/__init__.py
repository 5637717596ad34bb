"""The Triton kernels: every input the API accepts, on every GPU from Ampere on and, through
Triton's interpreter, on the CPU. Their launch configuration is `Tiles`; the Triton family takes
every call, so a table entry's candidates end with Tiles (kernels/plan.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from ..device import scratch, tma_addressable


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
