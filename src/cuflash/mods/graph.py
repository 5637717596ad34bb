"""A traced mod: the elementwise computation a score_mod or mask_mod performs on one score, as a list
of nodes in the order they are computed. The Triton kernels compile it (kernels/triton/mods.py), the CPU path
evaluates it with torch ops (mods/evaluate.py); both read the same graph, so both take the same mods.

A node's op is one of:
  input    args (i,): the mod's i-th argument (score, b, h, q_idx, kv_idx; a mask_mod has no score)
  tensor   args (i,): captured tensor i (a bias table, document ids): only ever read by `load`
  scalar   args (i,): captured Python number i, passed to the kernels at run time
  const    args (value,): a number baked into the code
  load     args (tensor, index...): one element of a captured tensor, one index per dimension
  an operation of OPS, whose args are nodes (and, for `cast`, the dtype)
Every node has the dtype torch gives the same computation on 0-dim tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# op -> arity. Arithmetic and comparisons compute in torch's promoted dtype of their operands.
UNARY = ("neg", "abs", "exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sigmoid", "sqrt", "rsqrt", "sin",
         "cos", "floor", "ceil", "trunc", "round", "sign", "reciprocal", "relu", "not", "invert")
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "truncdiv", "remainder", "fmod", "pow", "maximum", "minimum",
          "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "lshift", "rshift")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
OPS = {**{op: 1 for op in UNARY}, **{op: 2 for op in BINARY}, "where": 3, "cast": 1}


@dataclass(frozen=True, eq=False)
class Node:
    op: str
    args: tuple
    dtype: torch.dtype
    # The dtype operands are converted to before the op (torch's promotion; None: as they are).
    compute: torch.dtype | None = None
    weak: bool = False  # a Python number: weak in torch's type promotion

    def __repr__(self) -> str:
        return f"{self.op}{self.args}:{str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class TensorSpec:
    """What the compiled code assumes of a captured tensor: its dtype and number of dimensions (its
    sizes and strides are run-time arguments)."""
    dtype: torch.dtype
    ndim: int


@dataclass(eq=False)
class ModGraph:
    """The nodes of one mod in computing order; `output` among them. `tensors` and `scalars`: what the
    captured tensors and numbers are (their values are bound per call, mods/trace.py)."""
    kind: str  # "score" or "mask"
    name: str  # the mod's __qualname__, for messages
    nodes: list[Node]
    output: Node
    tensors: tuple[TensorSpec, ...]
    scalars: tuple[torch.dtype, ...]
    key: str = field(default="")  # what the graph computes, as text: equal keys compute the same

    def __post_init__(self) -> None:
        if not self.key:
            self.key = describe(self)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("score", "b", "h", "q_idx", "kv_idx") if self.kind == "score" else ("b", "h", "q_idx", "kv_idx")

    def uses(self, name: str) -> bool:
        position = self.inputs.index(name)
        return any(n.op == "input" and n.args[0] == position for n in self.nodes)

    @property
    def gathers(self) -> bool:
        """Whether it loads a captured tensor at an index computed from q_idx or kv_idx (an element per
        score: a bias table by distance, document ids), not one value per program (a slope per head)."""
        positions = {self.inputs.index("q_idx"), self.inputs.index("kv_idx")}
        varying: set[int] = set()
        for n in self.nodes:
            if n.op == "input" and n.args[0] in positions or any(
                    id(a) in varying for a in n.args[1 if n.op == "load" else 0:] if isinstance(a, Node)):
                if n.op == "load":
                    return True
                varying.add(id(n))
        return False


def describe(g: ModGraph) -> str:
    """The graph as text, one line per node, with nodes named by position: two mods with equal texts
    compute the same thing (the compiled kernels are cached by it)."""
    names = {id(n): f"v{i}" for i, n in enumerate(g.nodes)}
    lines = [g.kind, ",".join(f"{t.dtype}/{t.ndim}" for t in g.tensors), ",".join(map(str, g.scalars))]
    for n in g.nodes:
        args = ",".join(names[id(a)] if isinstance(a, Node) else repr(a) for a in n.args)
        lines.append(f"{names[id(n)]}={n.op}({args}):{n.dtype}:{n.compute}")
    lines.append(f"out={names[id(g.output)]}")
    return "\n".join(lines)


def compose(first: ModGraph, second: ModGraph) -> ModGraph:
    """The score_mod computing second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx): second's
    nodes after first's, its score input replaced by first's output, its captured tensors and numbers
    numbered after first's (a Mod of it captures first's, then second's)."""
    assert first.kind == second.kind == "score"
    tensors, scalars = len(first.tensors), len(first.scalars)
    remap: dict[int, Node] = {}
    nodes = list(first.nodes)
    for n in second.nodes:
        if n.op == "input" and n.args[0] == 0:
            remap[id(n)] = first.output
            continue
        args = tuple(remap.get(id(a), a) if isinstance(a, Node) else a for a in n.args)
        if n.op == "tensor":
            args = (n.args[0] + tensors, *args[1:])
        elif n.op == "scalar":
            args = (n.args[0] + scalars,)
        remap[id(n)] = m = Node(n.op, args, n.dtype, n.compute, n.weak)
        nodes.append(m)
    return ModGraph("score", f"{first.name}, then {second.name}", nodes, remap[id(second.output)],
                    first.tensors + second.tensors, first.scalars + second.scalars)
