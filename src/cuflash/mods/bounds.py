"""Whether a mod's reads of its captured tensors stay inside them, decided before any kernel runs.

Each node of a traced graph gets an interval of the values it can take: b, h, q_idx and kv_idx range
over the call's batch, heads and sequence lengths, captured numbers and constants are exact, and the
arithmetic on them (add, sub, mul, neg, abs, floor division and remainder, minimum/maximum, where,
casts) maps intervals to intervals. A load whose index interval leaves [-size, size) (torch's negative
indices count from the end) would read outside the tensor for some score: the call raises, naming the
mod, the tensor and the dimension. Indices the analysis cannot bound (values read from another
captured tensor, say) are not refused: the kernels read 0 for them where they fall outside (a masked
load), never other memory.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import ErrorCode, fail
from .graph import ModGraph, Node

UNKNOWN = (-math.inf, math.inf)


def check_indices(graph: ModGraph, tensors: tuple, scalars: tuple, batch: int, nheads: int, seqlen_q: int,
                  seqlen_k: int) -> None:
    """Raises FlashAttentionError where a load of `graph` may index a captured tensor out of range."""
    if not any(n.op == "load" for n in graph.nodes):
        return
    ranges = {"b": (0, batch - 1), "h": (0, nheads - 1), "q_idx": (0, seqlen_q - 1), "kv_idx": (0, seqlen_k - 1),
              "score": UNKNOWN}
    intervals: dict[int, tuple[float, float]] = {}
    for n in graph.nodes:
        intervals[id(n)] = _interval(n, intervals, graph, ranges, scalars)
        if n.op == "load":
            _check_load(n, intervals, graph, tensors)


def _interval(n: Node, intervals: dict, graph: ModGraph, ranges: dict, scalars: tuple) -> tuple[float, float]:
    def of(a):
        return intervals[id(a)] if isinstance(a, Node) else (a, a)
    if n.op == "input":
        return ranges[graph.inputs[n.args[0]]]
    if n.op in ("const", "scalar"):
        value = n.args[0] if n.op == "const" else scalars[n.args[0]]
        return (float(value), float(value)) if isinstance(value, (int, float)) else UNKNOWN
    if n.op == "cast":
        lo, hi = of(n.args[0])
        return (math.trunc(lo), math.trunc(hi)) if not n.dtype.is_floating_point and math.isfinite(lo + hi) \
            else (lo, hi)
    rule = _ARITHMETIC.get(n.op)
    return UNKNOWN if rule is None else rule(*(of(a) for a in n.args))


def _products(a, b) -> tuple[float, float]:
    values = [x * y for x in a for y in b if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
    return (min(values), max(values)) if values else UNKNOWN


def _floordiv(a, b) -> tuple[float, float]:
    if b[0] != b[1] or b[0] == 0 or not math.isfinite(b[0]) or not math.isfinite(a[0] + a[1]):
        return UNKNOWN
    ends = sorted((a[0] / b[0], a[1] / b[0]))
    return math.floor(ends[0]), math.floor(ends[1])


def _remainder(a, b) -> tuple[float, float]:
    if b[0] == b[1] and b[0] > 0 and math.isfinite(b[0]):
        if a[0] >= 0 and a[1] < b[0]:
            return a
        return 0, b[0] - 1
    return UNKNOWN


_ARITHMETIC: dict[str, Callable[..., tuple[float, float]]] = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": _products,
    "neg": lambda a: (-a[1], -a[0]),
    "abs": lambda a: (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])), max(abs(a[0]), abs(a[1]))),
    "floordiv": _floordiv,
    "remainder": _remainder,
    "maximum": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    "minimum": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    "where": lambda c, a, b: (min(a[0], b[0]), max(a[1], b[1])),
}


def _check_load(n: Node, intervals: dict, graph: ModGraph, tensors: tuple) -> None:
    tensor, *indices = n.args
    t: torch.Tensor = tensors[tensor.args[0]]
    for dim, index in enumerate(indices):
        lo, hi = intervals[id(index)] if isinstance(index, Node) else (index, index)
        size = t.shape[dim]
        if math.isinf(lo) or math.isinf(hi):
            continue  # (not bounded by the analysis: the kernels' masked loads read 0 outside)
        if lo < -size or hi >= size:
            fail(ErrorCode.INVALID_ARGUMENT,
                 f"{graph.kind}_mod {graph.name!r} indexes dimension {dim} of a captured tensor of shape "
                 f"{tuple(t.shape)} with values from {int(lo)} to {int(hi)} for this call's sizes; it has "
                 f"{size} entries there (negative indices count from the end, down to {-size})")
