"""Programmable attention: score_mod and mask_mod, as FlexAttention writes them, and block sparsity.

A mod is traced once into a graph of elementwise operations (trace.py, graph.py); the Triton kernels
compile that graph into their score tiles (kernels/triton/mods.py) and the CPU path computes it with torch ops
(evaluate.py). A call's mods travel in AttentionParams.mods as `Mods`: the traced graphs with the
tensors and numbers they capture, the block mask's tile lists, and the gradient buffers of captured
tensors that require grad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .bounds import check_indices
from .graph import ModGraph, compose
from .trace import trace


@dataclass(frozen=True, eq=False)
class Mod:
    """One traced mod and what it captures at this call."""
    graph: ModGraph
    tensors: tuple[torch.Tensor, ...]
    scalars: tuple

    @classmethod
    def of(cls, fn, kind: str) -> Mod:
        traced, tensors, scalars = trace(fn, kind)
        return cls(traced.graph, tuple(tensors), tuple(scalars))

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per captured tensor, whether its gradient is asked for (score_mod only)."""
        return tuple(t.requires_grad and t.dtype.is_floating_point for t in self.tensors)

    def key(self) -> tuple:
        """What the kernels compile from and take by value: the graph, the captured numbers (launch
        arguments that a launch plan fixes) and which captured tensors need a gradient."""
        return self.graph.key, self.scalars, self.requires_grad

    def then(self, after: Mod) -> Mod:
        """The score_mod computing `after` on this one's result (graph.compose), with both's captures."""
        key = (self.graph.key, after.graph.key)
        graph = _composed.get(key)
        if graph is None:
            if len(_composed) >= _COMPOSED_LIMIT:
                _composed.pop(next(iter(_composed)))
            graph = _composed[key] = compose(self.graph, after.graph)
        return Mod(graph, self.tensors + after.tensors, self.scalars + after.scalars)


# Composed graphs by their parts' keys: one graph object (and compiled kernel) per composition, made once.
_composed: dict[tuple[str, str], ModGraph] = {}
_COMPOSED_LIMIT = 256


@dataclass(frozen=True, eq=False)
class BlockSparsity:
    """A block mask's tile lists (torch's BlockMask fields), each broadcast to (batch, nheads, ...):
    for each block of q_block query rows, the kv_block-key blocks it partly sees (kv_num of them,
    listed first in kv_idx: their scores go through mask_mod) and those it wholly sees (full_*: no
    mask_mod); q_* the same per key block, for the backward's dK/dV. Blocks listed in neither are
    skipped. full_* None: every listed block is partial."""
    q_block: int
    kv_block: int
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_kv_num: torch.Tensor | None
    full_kv_idx: torch.Tensor | None
    q_num: torch.Tensor | None = None
    q_idx: torch.Tensor | None = None
    full_q_num: torch.Tensor | None = None
    full_q_idx: torch.Tensor | None = None

    def key(self) -> tuple:
        return self.q_block, self.kv_block, self.full_kv_num is not None, self.q_num is not None


@dataclass(frozen=True, eq=False)
class Mods:
    """A call's mods (AttentionParams.mods). score: applied to every score (natural log units, after
    the softmax scale); mask: hides the keys it returns False for, in the blocks `blocks` lists as
    partial (without blocks: everywhere); grads: fp32 buffers (fp64 for fp64 tensors), one per
    captured tensor of score whose gradient is asked for, that a backward adds those gradients into
    (None in a forward)."""
    score: Mod | None = None
    mask: Mod | None = None
    blocks: BlockSparsity | None = None
    grads: tuple[torch.Tensor, ...] | None = None

    def key(self) -> tuple:
        return (None if self.score is None else self.score.key(), None if self.mask is None else self.mask.key(),
                None if self.blocks is None else self.blocks.key(), self.grads is not None)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other) -> bool:
        return isinstance(other, Mods) and self.key() == other.key()

    def check(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> None:
        """Raises FlashAttentionError where a mod may read a captured tensor out of range at these sizes
        (bounds.py)."""
        for mod in (self.score, self.mask):
            if mod is not None:
                check_indices(mod.graph, mod.tensors, mod.scalars, batch, nheads, seqlen_q, seqlen_k)

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        """The captured tensors of score_mod whose gradient is asked for, in requires_grad's order."""
        if self.score is None:
            return ()
        return tuple(t for t, needed in zip(self.score.tensors, self.score.requires_grad) if needed)


__all__ = ["BlockSparsity", "Mod", "ModGraph", "Mods", "trace"]
