"""A traced mod computed with torch ops on whole blocks of scores: the CPU path's score_mod and
mask_mod, and what create_block_mask evaluates. Inputs broadcast against each other (b and h 0-dim or
(B, 1, 1, 1)-style, q_idx a column, kv_idx a row), so each node is one torch op on the block; torch's
autograd through them gives the gradients of the score and of captured tensors that require grad."""
from __future__ import annotations

import torch

from .graph import ModGraph, Node
from .trace import TORCH_OPS


def evaluate(graph: ModGraph, inputs: tuple, tensors: list[torch.Tensor], scalars: list) -> torch.Tensor:
    """The mod's value at every element of the broadcast `inputs` (score, b, h, q_idx, kv_idx; a
    mask_mod's without score). Index inputs are int32 as FlexAttention's; a load reads the captured
    tensor at the broadcast indices (negative ones from the end, as torch indexes)."""
    values: dict[int, torch.Tensor] = {}
    device = inputs[-1].device

    def get(a):
        return values[id(a)] if isinstance(a, Node) else a

    for n in graph.nodes:
        if n.op == "input":
            v = inputs[n.args[0]]
        elif n.op == "tensor":
            v = tensors[n.args[0]]
        elif n.op in ("scalar", "const"):
            value = scalars[n.args[0]] if n.op == "scalar" else n.args[0]
            v = torch.tensor(value, dtype=n.dtype, device=device)
        elif n.op == "load":
            t = values[id(n.args[0])]
            v = t[tuple(values[id(i)].long() for i in n.args[1:])] if len(n.args) > 1 else t
        elif n.op == "cast":
            v = get(n.args[0]).to(n.dtype)
        else:
            args = [get(a) for a in n.args]
            if n.compute is not None:
                first = 1 if n.op == "where" else 0
                args[first:] = [a.to(n.compute) for a in args[first:]]
            v = TORCH_OPS[n.op](*args).to(n.dtype)
        values[id(n)] = v
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return values[id(graph.output)].expand(shape)
