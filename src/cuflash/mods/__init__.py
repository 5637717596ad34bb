"""Programmable attention: score_mod and mask_mod, as FlexAttention writes them, and block sparsity.

A mod is traced once into a graph of elementwise operations (trace.py, graph.py); the Triton kernels
compile that graph into their score tiles (kernels/triton/mods.py) and the CPU path computes it with torch ops
(evaluate.py). A call's mods travel in AttentionParams.mods as `Mods`: the traced graphs with the
tensors and numbers they capture, the block mask's tile lists, and the gradient buffers of captured
tensors that require grad. The custom ops (ops.py) take them packed (`Packed`): a string naming the
graphs, which this module keeps by that name, and the tensors and numbers as lists.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import ErrorCode, fail
from .bounds import check_indices
from .graph import ModGraph, compose
from .trace import trace


@dataclass(frozen=True, eq=False)
class Mod:
    """One traced mod and what it captures at this call. requires_grad: per captured tensor, whether
    its gradient is asked for (score_mod only), fixed when the Mod is made: the custom ops' tensors
    ask for none."""
    graph: ModGraph
    tensors: tuple[torch.Tensor, ...]
    scalars: tuple
    requires_grad: tuple[bool, ...]

    @classmethod
    def of(cls, fn, kind: str) -> Mod:
        traced, tensors, scalars = trace(fn, kind)
        return cls(traced.graph, tuple(tensors), tuple(scalars), needs_grad(tensors))

    def key(self) -> tuple:
        """What the kernels compile from and take by value: the graph, the captured numbers (launch
        arguments that a launch plan fixes) and which captured tensors need a gradient."""
        return self.graph.key, self.scalars, self.requires_grad

    def then(self, after: Mod) -> Mod:
        """The score_mod computing `after` on this one's result (graph.compose), with both's captures."""
        key = (self.graph.key, after.graph.key)
        graph = _composed.get(key)
        if graph is None:
            graph = compose(self.graph, after.graph)
            with _composing:  # (threads composing at once: one evicts, each keeps its graph)
                if len(_composed) >= _COMPOSED_LIMIT:
                    _composed.pop(next(iter(_composed)))
                graph = _composed.setdefault(key, graph)
        return Mod(graph, self.tensors + after.tensors, self.scalars + after.scalars,
                   self.requires_grad + after.requires_grad)


# Composed graphs by their parts' keys: one graph object (and compiled kernel) per composition, made once.
_composed: dict[tuple[str, str], ModGraph] = {}
_COMPOSED_LIMIT = 256
_composing = threading.Lock()


def needs_grad(tensors) -> tuple[bool, ...]:
    """Per captured tensor, whether its gradient is asked for (Mod.requires_grad)."""
    return tuple(t.requires_grad and t.dtype.is_floating_point for t in tensors)


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

    def lists(self) -> tuple[torch.Tensor | None, ...]:
        """The tile lists, in field order (None where not given)."""
        return tuple(getattr(self, name) for name in LIST_NAMES)


LIST_NAMES = tuple(f.name for f in dataclasses.fields(BlockSparsity))[2:]


@dataclass(frozen=True, eq=False)
class Mods:
    """A call's mods (AttentionParams.mods). score: applied to every score (natural log units, after
    the softmax scale); mask: hides the keys it returns False for, in the blocks `blocks` lists as
    partial (without blocks: everywhere); grads: fp32 buffers (fp64 for fp64 tensors), one per
    captured tensor of score whose gradient is asked for, that a backward adds those gradients into
    (None in a forward). packed: the mods of a call traced by torch.compile, which cannot trace a mod
    into a Mod: as the custom ops take them (mods/compiled.py), the other fields None."""
    score: Mod | None = None
    mask: Mod | None = None
    blocks: BlockSparsity | None = None
    grads: tuple[torch.Tensor, ...] | None = None
    packed: Packed | None = None

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

    def pack(self) -> Packed:
        """These mods as the custom ops take them."""
        if self.packed is not None:
            return self.packed
        score, mask = self.score, self.mask
        return packed(None if score is None else (registered(score.graph), score.tensors, score.scalars,
                                                  score.requires_grad),
                      None if mask is None else (registered(mask.graph), mask.tensors, mask.scalars),
                      self.blocks)


class Packed(NamedTuple):
    """A call's mods as the custom ops take them (their last three arguments): `layout` says what the
    mods are without their tensors and numbers (the graphs by the names registered() gave them, which
    of score_mod's tensors need a gradient, the block mask's block sizes and which of its lists are
    given), `tensors` lists the tensors they read (score_mod's captures, mask_mod's, the block mask's
    lists given), `scalars` the numbers they capture (score_mod's, then mask_mod's)."""
    layout: str
    tensors: list[torch.Tensor]
    scalars: list[float]

    def unpack(self) -> Mods:
        """The Mods these describe (the graphs registered in this process)."""
        score, needed, mask, blocks = _parsed(self.layout)
        tensors, scalars = iter(self.tensors), iter(self.scalars)

        def mod(graph: ModGraph, requires_grad: tuple | None = None) -> Mod:
            captured = tuple(next(tensors) for _ in graph.tensors)
            numbers = tuple(int(next(scalars)) if d == torch.int64 else next(scalars) for d in graph.scalars)
            return Mod(graph, captured, numbers, requires_grad or (False,) * len(captured))

        score_mod = None if score is None else mod(score, needed)
        mask_mod = None if mask is None else mod(mask)
        sparsity = None
        if blocks is not None:
            q_block, kv_block, given = blocks
            sparsity = BlockSparsity(q_block, kv_block, *(next(tensors) if g else None for g in given))  # type: ignore[arg-type]
        return Mods(score=score_mod, mask=mask_mod, blocks=sparsity)

    def input_grads(self, grads: list) -> list[torch.Tensor | None]:
        """Per tensor of `tensors`, its gradient: grads' in order for score_mod's tensors that need one
        (the backward op's), None for the others."""
        needed = _parsed(self.layout)[1] or ()
        found = iter(grads)
        return [next(found) if i < len(needed) and needed[i] else None for i in range(len(self.tensors))]


def packed(score: tuple | None, mask: tuple | None, blocks: BlockSparsity | None) -> Packed:
    """Packed of a score_mod (name, tensors, scalars, requires_grad), a mask_mod (name, tensors,
    scalars) and a block mask, each None where absent; the names are registered()'s."""
    lists = () if blocks is None else blocks.lists()
    # (operator.index: under torch.compile, block sizes that Dynamo made symbolic become constants, guarded)
    layout = ";".join((
        "" if score is None else score[0], "".join("1" if r else "0" for r in (() if score is None else score[3])),
        "" if mask is None else mask[0],
        "" if blocks is None else f"{operator.index(blocks.q_block)},{operator.index(blocks.kv_block)}," + "".join(
            "0" if t is None else "1" for t in lists)))
    tensors = [*(score[1] if score else ()), *(mask[1] if mask else ()), *(t for t in lists if t is not None)]
    scalars = [float(s) for s in (*(score[2] if score else ()), *(mask[2] if mask else ()))]
    return Packed(layout, tensors, scalars)


# Traced graphs by name (registered()), for the custom ops to find from a layout; names by graph key.
_GRAPHS: dict[str, ModGraph] = {}
_NAMES: dict[str, str] = {}
_LAYOUTS: dict[str, tuple] = {}  # _parsed's answers


def registered(graph: ModGraph) -> str:
    """The name under which the custom ops find `graph` (or a graph computing the same: equal keys):
    a digest of its key, the same in every process."""
    name = _NAMES.get(graph.key)
    if name is None:
        name = f"{graph.kind}-{hashlib.sha256(graph.key.encode()).hexdigest()[:24]}"
        _GRAPHS[name] = graph
        _NAMES[graph.key] = name
    return name


def _parsed(layout: str) -> tuple:
    """(score graph, its tensors' requires_grad, mask graph, (q_block, kv_block, which lists are given))
    of a layout, each None where absent."""
    found = _LAYOUTS.get(layout)
    if found is None:
        score, needed, mask, blocks = layout.split(";")
        for name in (score, mask):
            if name and name not in _GRAPHS:
                fail(ErrorCode.INVALID_ARGUMENT, f"no mod graph {name!r} was traced in this process: a graph "
                     "compiled elsewhere with mods needs the mods traced here first (call it again through "
                     "torch.compile, which traces them)")
        block_layout = None
        if blocks:
            q_block, kv_block, given = blocks.split(",")
            block_layout = (int(q_block), int(kv_block), tuple(g == "1" for g in given))
        found = _LAYOUTS[layout] = (_GRAPHS[score] if score else None, tuple(n == "1" for n in needed) or None,
                                    _GRAPHS[mask] if mask else None, block_layout)
    return found


__all__ = ["BlockSparsity", "Mod", "ModGraph", "Mods", "Packed", "trace"]
