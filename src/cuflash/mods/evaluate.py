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
    tensor at the broadcast indices (negative ones from the end, as torch indexes).

    The graph was traced on a float32 score. With a float64 one (the CPU path's float64 inputs), what
    is computed from it in float32 is computed in float64, and Python numbers are held in float64, as
    torch's promotion does on a float64 score (a number then rounds to float32 only where an op
    computes in float32)."""
    values: dict[int, torch.Tensor] = {}
    device = inputs[-1].device
    wide = graph.kind == "score" and inputs[0].dtype == torch.float64
    from_score: set[int] = set()  # with a float64 score, the nodes computed from it in float64

    def get(a):
        return values[id(a)] if isinstance(a, Node) else a

    def wider(d, n: Node):  # float64 for float32 where computed from the score, and Python numbers
        return torch.float64 if wide and d == torch.float32 and (id(n) in from_score or n.weak) else d

    for n in graph.nodes:
        if wide and (n.op == "input" and n.args[0] == 0 or n.op not in ("cast", "load") and any(
                id(a) in from_score for a in n.args if isinstance(a, Node))):
            from_score.add(id(n))
        if n.op == "input":
            v = inputs[n.args[0]]
        elif n.op == "tensor":
            v = tensors[n.args[0]]
        elif n.op in ("scalar", "const"):
            value = scalars[n.args[0]] if n.op == "scalar" else n.args[0]
            v = torch.tensor(value, dtype=wider(n.dtype, n), device=device)
        elif n.op == "load":
            t = values[id(n.args[0])]
            v = t[tuple(values[id(i)].long() for i in n.args[1:])] if len(n.args) > 1 else t
        elif n.op == "cast":
            v = get(n.args[0]).to(n.dtype)
        else:
            args = [get(a) for a in n.args]
            if n.compute is not None:
                first = 1 if n.op == "where" else 0
                args[first:] = [a.to(wider(n.compute, n)) for a in args[first:]]
            v = TORCH_OPS[n.op](*args).to(wider(n.dtype, n))
        values[id(n)] = v
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return values[id(graph.output)].expand(shape)
