"""A traced mod (cuflash/mods/graph.py) as Triton code: a @triton.jit function that the attention kernels call
where a tile of scores is formed (a constexpr argument, so the kernels compile with the mod inlined,
and without it, when None, to the code they had before mods existed).

    score_mod:  fn(score, b, h, q_idx, kv_idx, args) -> score        (fp32 tile)
    mask_mod:   fn(b, h, q_idx, kv_idx, args) -> bool tile
    backward:   fn(score, b, h, q_idx, kv_idx, args, grad, grads) -> d score
                (and grad's share of each captured tensor that requires grad, added atomically to its
                fp32 gradient buffer)

The tiles broadcast: q_idx a column and kv_idx a row (or the transpose, as the dK/dV kernel has
them), b and h scalars. `args` is a tuple: per captured tensor its pointer, sizes and strides, then the
captured numbers; `grads` per tensor that requires grad its gradient buffer's pointer and strides.
Loads read 0 outside a captured tensor (indices past its end would otherwise read other memory); a
negative index counts from the end, as torch's indexing does.

The functions are cached by their source, which is made from the graph's key: two mods that compute
the same thing share one function, and so Triton's compiled kernels.
"""
from __future__ import annotations

import hashlib
import linecache
import math
import threading

import torch
import triton
import triton.language as tl

from ...errors import ErrorCode, fail
from ...mods.graph import ModGraph, Node
from .common import tanh

_TL_DTYPES = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
              torch.bfloat16: "tl.bfloat16", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
              torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}

_INFIX = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}
_UNARY = {"neg": "-{0}", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})",
          "log2": "tl.log2({0})", "log1p": "tl.log(1.0 + {0})", "expm1": "(tl.exp({0}) - 1.0)",
          "tanh": "tanh({0}, {fast})",
          "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))", "sqrt": "tl.sqrt_rn({0})", "rsqrt": "(1.0 / tl.sqrt_rn({0}))",
          "sin": "tl.sin({0})", "cos": "tl.cos({0})", "floor": "tl.floor({0})", "ceil": "tl.ceil({0})",
          "trunc": "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))", "round": "round_half_even({0})",
          "sign": "(({0} > 0).to({d}) - ({0} < 0).to({d}))", "reciprocal": "(1.0 / {0})",
          "relu": "tl.maximum({0}, 0)", "not": "({0} == 0)", "invert": "~{0}"}
_BINARY = {"truediv": "{0} / {1}", "floordiv": "floordiv({0}, {1})", "truncdiv": "truncdiv({0}, {1})",
           "remainder": "remainder({0}, {1})", "fmod": "fmod({0}, {1})", "maximum": "extremum({0}, {1}, True)",
           "minimum": "extremum({0}, {1}, False)"}


@triton.jit
def round_half_even(x):
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)


@triton.jit
def fmod(a, b):
    return a % b  # C's remainder: the dividend's sign (torch.fmod)


@triton.jit
def remainder(a, b):
    """Python's remainder (the divisor's sign), as torch.remainder."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def truncdiv(a, b):
    if a.dtype.is_floating():
        q = a / b
        q = tl.where(q < 0, tl.ceil(q), tl.floor(q))
    else:
        q = a // b  # Triton's integer division truncates
    return q


@triton.jit
def floordiv(a, b):
    if a.dtype.is_floating():
        q = tl.floor(a / b)
    else:
        q = a // b
        q = q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)
    return q


@triton.jit
def extremum(a, b, LARGER: tl.constexpr):
    """torch.maximum (LARGER) or torch.minimum: a NaN in either float operand gives NaN."""
    if LARGER:
        if a.dtype.is_floating():
            m = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
        else:
            m = tl.maximum(a, b)
    else:
        if a.dtype.is_floating():
            m = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
        else:
            m = tl.minimum(a, b)
    return m


@triton.jit
def offset(ptr, index, size, stride):
    """ptr moved by one dimension's index (negative: from the end), and whether the index is in range."""
    i = index.to(tl.int64)
    i = tl.where(i < 0, i + size, i)
    return ptr + i * stride, (i >= 0) & (i < size)


_HELPERS = {"tl": tl, "tanh": tanh, "round_half_even": round_half_even, "fmod": fmod, "remainder": remainder,
            "truncdiv": truncdiv, "floordiv": floordiv, "extremum": extremum, "offset": offset,
            "math": math}
_functions: dict[str, triton.JITFunction] = {}
_lock = threading.Lock()


def _literal(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    return repr(value)


class _Writer:
    """Python source of one function, one line per node."""

    def __init__(self, graph: ModGraph, fast: bool):
        self.graph, self.fast = graph, fast
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.args = _ArgLayout(graph)

    def name(self, a) -> str:
        return self.names[id(a)] if isinstance(a, Node) else _literal(a)

    def operand(self, a: Node, dtype: torch.dtype | None) -> str:
        if dtype is None or a.dtype == dtype and not a.weak:
            return self.name(a)
        return f"{self.name(a)}.to({_TL_DTYPES[dtype]})"

    def emit(self, n: Node, index: int) -> None:
        v = f"v{index}"
        self.names[id(n)] = v
        d = _TL_DTYPES.get(n.dtype)
        if d is None:
            fail(ErrorCode.UNSUPPORTED_DTYPE, f"{self.graph.kind}_mod {self.graph.name!r} computes in {n.dtype}, "
                                              "which the kernels do not take")
        if n.op == "input":
            self.names[id(n)] = self.graph.inputs[n.args[0]]
            return
        if n.op == "tensor":
            self.names[id(n)] = self.args.tensor(n.args[0], n.args[1])[0]
            return
        if n.op == "const":
            expr = f"tl.cast({_literal(n.args[0])}, {d})"
        elif n.op == "scalar":
            expr = f"tl.cast(args[{self.args.scalar(n.args[0])}], {d})"
        elif n.op == "load":
            lines, mask = self.pointer(n, v, self.args.tensor(*n.args[0].args))
            self.lines += lines
            expr = f"tl.load({v}_p, mask={mask}, other=0)" if mask else f"tl.load({v}_p)"
        elif n.op == "cast":
            expr = f"{self.name(n.args[0])}.to({d})"
        elif n.op == "where":
            c, a, b = n.args
            expr = f"tl.where({self.name(c)}, {self.operand(a, n.compute)}, {self.operand(b, n.compute)})"
        elif n.op in _INFIX:
            a, b = (self.operand(x, n.compute) for x in n.args)
            expr = f"({a} {_INFIX[n.op]} {b})"
        elif n.op in _BINARY:
            compute = n.dtype if n.op == "truediv" else n.compute
            expr = _BINARY[n.op].format(*(self.operand(x, compute) for x in n.args))
        elif n.op == "pow":
            expr = self.pow(n)
        else:
            # (the fast tanh computes in fp32: not for a node in fp64)
            expr = _UNARY[n.op].format(self.name(n.args[0]), d=d, fast=self.fast and n.dtype != torch.float64)
        self.lines.append(f"    {v} = ({expr}).to({d})")

    def pointer(self, n: Node, prefix: str, where: tuple, ok: str | None = None) -> tuple[list[str], str]:
        """The lines computing the pointer `{prefix}_p` of load n's element in a tensor given as
        (pointer, sizes, strides), and the mask (in range, and `ok`) as an expression."""
        ptr, sizes, strides = where
        p, m = f"{prefix}_p", f"{prefix}_ok"
        lines = [f"    {p} = {ptr}"]
        masks = [] if ok is None else [f"({ok})"]
        for d, (i, size, stride) in enumerate(zip(n.args[1:], sizes, strides)):
            lines.append(f"    {p}, {m}{d} = offset({p}, {self.name(i)}, {size}, {stride})")
            masks.append(f"{m}{d}")
        # (!= 0 after each &: Triton 3.9's interpreter gives a scalar bool & a bool tile int64 data, which
        # loads and the next & refuse)
        mask = masks[0] if masks else ""
        for other in masks[1:]:
            mask = f"(({mask} & {other}) != 0)"
        return lines, mask

    def pow(self, n: Node) -> str:
        base, exponent = n.args
        e = exponent.args[0] if exponent.op == "const" else None
        b = self.operand(base, n.compute)
        if e == 0.5:
            return f"tl.sqrt_rn({b})"
        if isinstance(e, (int, float)) and float(e).is_integer() and abs(e) <= 8:
            k = int(abs(e))
            expr = " * ".join([f"{b}"] * k) if k else f"({b} * 0 + 1)"
            return f"(1.0 / ({expr}))" if e < 0 else f"({expr})"
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"{self.graph.kind}_mod {self.graph.name!r} raises to the power "
                                            f"{exponent!r}: the kernels compile pow with a constant integer "
                                            "exponent up to 8 in magnitude or 0.5")
        raise AssertionError


class _ArgLayout:
    """Where each captured tensor's pointer, sizes and strides and each captured number sit in `args`."""

    def __init__(self, graph: ModGraph):
        self.offsets: list[int] = []
        at = 0
        for spec in graph.tensors:
            self.offsets.append(at)
            at += 1 + 2 * spec.ndim
        self.scalar_base = at

    def tensor(self, slot: int, ndim: int):
        at = self.offsets[slot]
        return (f"args[{at}]", [f"args[{at + 1 + d}]" for d in range(ndim)],
                [f"args[{at + 1 + ndim + d}]" for d in range(ndim)])

    def scalar(self, slot: int) -> int:
        return self.scalar_base + slot


def kernel_args(tensors: list[torch.Tensor], scalars: list) -> tuple:
    """The `args` tuple of a mod's function for these captures (see the module's doc)."""
    out: list = []
    for t in tensors:
        out += [t, *t.shape, *t.stride()]
    return (*out, *scalars) if out or scalars else (0,)


def grad_args(grads: list[torch.Tensor]) -> tuple:
    """The `grads` tuple: each gradient buffer's pointer and strides."""
    out: list = []
    for g in grads:
        out += [g, *g.stride()]
    return tuple(out) if out else (0,)


def forward_function(graph: ModGraph, fast: bool = False) -> triton.JITFunction:
    """The mod as a @triton.jit function (see the module's doc); fast: tanh by the GPU's approximation
    (common.tanh's FAST, for 16-bit inputs on the GPU)."""
    w = _Writer(graph, fast)
    for i, n in enumerate(graph.nodes):
        w.emit(n, i)
    params = ", ".join((*graph.inputs, "args"))
    body = w.lines + [f"    return {w.name(graph.output)}"]
    return _compile(graph, "fwd" + "fast" * fast, f"def {{name}}({params}):\n" + "\n".join(body) + "\n")


def backward_function(graph: ModGraph, requires_grad: tuple[bool, ...], fast: bool = False) -> triton.JITFunction:
    """The score_mod's backward (see the module's doc): the gradient of the score from `grad`, the
    gradient of its output, and atomic additions into the buffers of the captured tensors whose flag
    in requires_grad is set; fast as forward_function's (the forward's values recomputed alike)."""
    w = _Writer(graph, fast)
    for i, n in enumerate(graph.nodes):
        w.emit(n, i)
    body = w.lines + _adjoints(graph, w, requires_grad)
    params = ", ".join((*graph.inputs, "args", "grad", "grads"))
    flags = "".join("1" if r else "0" for r in requires_grad)
    return _compile(graph, f"bwd{flags}" + "fast" * fast, f"def {{name}}({params}):\n" + "\n".join(body) + "\n")


def _differentiable(graph: ModGraph, requires_grad: tuple[bool, ...]) -> set[int]:
    """The float nodes whose value depends on the score or on a captured tensor that requires grad."""
    live: set[int] = set()
    for n in graph.nodes:
        if not n.dtype.is_floating_point:
            continue
        if (n.op == "input" and n.args[0] == 0) or (n.op == "load" and requires_grad[n.args[0].args[0]]):
            live.add(id(n))
        elif n.op not in ("load", "input", "tensor", "const", "scalar") and any(
                id(a) in live for a in n.args if isinstance(a, Node)):
            live.add(id(n))
    return live


def _adjoints(graph: ModGraph, w: _Writer, requires_grad: tuple[bool, ...]) -> list[str]:
    """Reverse-mode lines: the adjoint of every differentiable node, from the output's (grad), the
    score's returned and the loads' added to their gradient buffers."""
    live = _differentiable(graph, requires_grad)
    adj: dict[int, str] = {id(graph.output): "grad"}
    lines: list[str] = []
    counter = [0]

    def add(node, expr: str) -> None:
        if not isinstance(node, Node) or id(node) not in live:
            return
        counter[0] += 1
        name = f"g{counter[0]}"
        d = _TL_DTYPES[node.dtype]
        lines.append(f"    {name} = ({expr}).to({d})" if id(node) not in adj else
                     f"    {name} = {adj[id(node)]} + ({expr}).to({d})")
        adj[id(node)] = name

    for n in reversed(graph.nodes):
        if id(n) not in adj or id(n) not in live:
            continue
        g = adj[id(n)]
        x = [w.name(a) if isinstance(a, Node) else _literal(a) for a in n.args]
        out = w.name(n)
        if n.op == "load":
            lines += _scatter(w, n, g, graph, requires_grad)
        elif n.op == "cast":
            add(n.args[0], g)
        elif n.op == "add":
            add(n.args[0], g)
            add(n.args[1], g)
        elif n.op == "sub":
            add(n.args[0], g)
            add(n.args[1], f"-{g}")
        elif n.op == "mul":
            add(n.args[0], f"{g} * {x[1]}")
            add(n.args[1], f"{g} * {x[0]}")
        elif n.op == "truediv":
            add(n.args[0], f"{g} / {x[1]}")
            add(n.args[1], f"-{g} * {x[0]} / ({x[1]} * {x[1]})")
        elif n.op in ("remainder", "fmod"):
            add(n.args[0], g)
            rounding = "floordiv" if n.op == "remainder" else "truncdiv"
            add(n.args[1], f"-{g} * {rounding}({x[0]}, {x[1]})")
        elif n.op in ("maximum", "minimum"):
            first = ">" if n.op == "maximum" else "<"
            add(n.args[0], f"tl.where({x[0]} {first} {x[1]}, {g}, tl.where({x[0]} == {x[1]}, {g} * 0.5, 0.0))")
            add(n.args[1], f"tl.where({x[1]} {first} {x[0]}, {g}, tl.where({x[0]} == {x[1]}, {g} * 0.5, 0.0))")
        elif n.op == "where":
            add(n.args[1], f"tl.where({x[0]}, {g}, 0.0)")
            add(n.args[2], f"tl.where({x[0]}, 0.0, {g})")
        elif n.op == "pow":
            e = n.args[1].args[0]
            add(n.args[0], f"{g} * {_literal(float(e))} * {out} / {x[0]}" if e != 0 else "0.0")
        else:
            derivative = _DERIVATIVES.get(n.op)
            if derivative is None:  # floor, ceil, round, sign, trunc: zero almost everywhere
                continue
            add(n.args[0], derivative.format(g=g, x=x[0], y=out))
    inputs = [n for n in graph.nodes if n.op == "input" and n.args[0] == 0]
    result = adj.get(id(inputs[0])) if inputs else None
    return lines + [f"    return {result}" if result else "    return grad * 0.0"]


_DERIVATIVES = {
    "neg": "-{g}", "abs": "tl.where({x} < 0, -{g}, tl.where({x} > 0, {g}, 0.0))", "exp": "{g} * {y}",
    "exp2": "{g} * {y} * 0.6931471805599453", "log": "{g} / {x}", "log2": "{g} / ({x} * 0.6931471805599453)",
    "log1p": "{g} / (1.0 + {x})", "expm1": "{g} * ({y} + 1.0)", "tanh": "{g} * (1.0 - {y} * {y})",
    "sigmoid": "{g} * {y} * (1.0 - {y})", "sqrt": "{g} * 0.5 / {y}", "rsqrt": "{g} * -0.5 * {y} * {y} * {y}",
    "sin": "{g} * tl.cos({x})", "cos": "-{g} * tl.sin({x})", "reciprocal": "-{g} * {y} * {y}",
    "relu": "tl.where({x} > 0, {g}, 0.0)",
}


def _scatter(w: _Writer, n: Node, g: str, graph: ModGraph, requires_grad: tuple[bool, ...]) -> list[str]:
    """The lines adding g, the adjoint of load n, to the captured tensor's fp32 gradient buffer
    (`grads`) where g is not 0 (most of a tile under a mask)."""
    tensor = n.args[0]
    slot, ndim = tensor.args
    _, sizes, _ = w.args.tensor(slot, ndim)
    at = _grad_offsets(graph, requires_grad)[slot]
    prefix = f"d{w.name(n)}"
    lines, mask = w.pointer(n, prefix, (f"grads[{at}]", sizes, [f"grads[{at + 1 + d}]" for d in range(ndim)]),
                            ok=f"{g} != 0")
    p = f"{prefix}_p"
    return lines + [f"    {p}, {prefix}_g = tl.broadcast({p}, {g}.to(tl.float32))",
                    f"    {p}, {prefix}_m = tl.broadcast({p}, {mask})",
                    f"    tl.atomic_add({p}, {prefix}_g, mask={prefix}_m)"]


def _grad_offsets(graph: ModGraph, requires_grad: tuple[bool, ...]) -> dict[int, int]:
    """Where each captured tensor that requires grad has its buffer's pointer in `grads` (its strides
    follow it)."""
    at, offsets = 0, {}
    for slot, (spec, needed) in enumerate(zip(graph.tensors, requires_grad)):
        if needed:
            offsets[slot] = at
            at += 1 + spec.ndim
    return offsets


def _compile(graph: ModGraph, part: str, template: str) -> triton.JITFunction:
    digest = hashlib.sha1(f"{graph.key}\n{part}".encode()).hexdigest()[:16]
    name = f"{graph.kind}_mod_{part}_{digest}"
    source = template.format(name=name)
    with _lock:
        fn = _functions.get(source)
        if fn is None:
            filename = f"<cuflash {name}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            namespace = dict(_HELPERS)
            exec(compile(source, filename, "exec"), namespace)  # noqa: S102 -- source made from a traced graph
            fn = _functions[source] = triton.jit(namespace[name])
    return fn
