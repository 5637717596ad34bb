"""Tracing a mod: the user's score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx),
written for one score (0-dim tensors, as FlexAttention calls it under vmap), is called once on symbolic
values (Sym) that record every torch operation into a ModGraph (mods/graph.py).

What a mod captures is found by walking its closure and the globals it names: tensors become kernel
arguments (read anew on every call, so a new bias table of the same dtype and rank needs no new
kernel), Python numbers too (a new slope or window needs none either; a number the mod branches on is
baked into the code instead). Traces are cached by the mod's code and what its captures are, so a
mod defined anew in every step (a closure over this step's document ids) is traced once.

Anything the kernels cannot compute fails here, before a kernel runs, with FlashAttentionError naming
the mod and the operation: an unsupported op, Python control flow on a traced value, a captured
tensor used without indexing every dimension, an index that may leave the tensor (checked per call by
mods/bounds.py), a result of the wrong dtype.
"""
from __future__ import annotations

import builtins
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ErrorCode, FlashAttentionError, fail
from .graph import BINARY, COMPARISONS, OPS, ModGraph, Node, TensorSpec

INDEX_DTYPE = torch.int32  # b, h, q_idx and kv_idx, as FlexAttention passes them
_CACHE_LIMIT = 1024


class Sym:
    """A traced value: a node of the graph being built. Python operators, torch functions and tensor
    methods called on it are recorded; anything that needs its value (bool(), int(), .item()) fails."""
    __slots__ = ("node", "tracer")

    def __init__(self, node: Node, tracer: _Tracer):
        self.node, self.tracer = node, tracer

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        tracer = next(a.tracer for a in _flatten((args, kwargs)) if isinstance(a, (Sym, Indexed)))
        return tracer.call(getattr(func, "__name__", str(func)), args, kwargs or {})

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.tracer.call(name, (self, *args), kwargs, method=True)

    def _value(self, *_):
        if self.tracer.scalars:
            raise _NeedsValues
        self.tracer.refuse("uses a traced value in Python control flow (if, and/or, int(), an index of a Python "
                           "list): the kernels compute every score the same way; use torch.where instead")

    __bool__ = __index__ = __int__ = __float__ = __len__ = __iter__ = _value

    def __neg__(self):
        return self.tracer.call("neg", (self,), {})

    def __abs__(self):
        return self.tracer.call("abs", (self,), {})

    def __invert__(self):
        return self.tracer.call("bitwise_not", (self,), {})

    __hash__ = object.__hash__

    @property
    def dtype(self) -> torch.dtype:
        return self.node.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    @property
    def shape(self) -> torch.Size:
        return torch.Size()

    def dim(self) -> int:
        return 0


def _operator(name: str, reverse: bool = False):
    def op(self, other):
        return self.tracer.call(name, (other, self) if reverse else (self, other), {})
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    setattr(Sym, f"__{_name}__", _operator(_name))
    setattr(Sym, f"__r{_name}__", _operator(_name, reverse=True))
for _name in COMPARISONS:
    setattr(Sym, f"__{_name}__", _operator(_name))


class Indexed:
    """A captured tensor with fewer indices than dimensions so far (bias[h] before [q_idx - kv_idx])."""
    __slots__ = ("tensor", "indices", "tracer")

    def __init__(self, tensor: Node, indices: tuple, tracer: _Tracer):
        self.tensor, self.indices, self.tracer = tensor, indices, tracer

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return Sym.__torch_function__(func, types_, args, kwargs)

    def __getitem__(self, index):
        return self.tracer.index(self, index)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.tracer.call(name, (self, *args), kwargs, method=True)


def _flatten(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


# torch's names (functions, methods, Python operators) -> the graph's ops. Reflected names (rsub,
# __radd__) have their operands swapped by _Tracer.call first.
_NAMES = {
    **{n: n for n in ("add", "sub", "mul", "pow", "remainder", "fmod", "maximum", "minimum", "where", "neg", "abs",
                      "exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
                      "floor", "ceil", "trunc", "round", "sign", "reciprocal", "relu", *COMPARISONS)},
    "subtract": "sub", "rsub": "sub", "multiply": "mul", "div": "truediv", "divide": "truediv",
    "true_divide": "truediv", "truediv": "truediv", "floor_divide": "floordiv", "floordiv": "floordiv",
    "mod": "remainder", "negative": "neg", "absolute": "abs", "max": "maximum", "min": "minimum",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
    "bitwise_and": "and", "and": "and", "logical_and": "and", "bitwise_or": "or", "or": "or", "logical_or": "or",
    "bitwise_xor": "xor", "xor": "xor", "logical_xor": "xor", "bitwise_not": "invert", "logical_not": "not",
    "bitwise_left_shift": "lshift", "lshift": "lshift", "bitwise_right_shift": "rshift", "rshift": "rshift",
    "square": "square", "clamp": "clamp", "clip": "clamp", "clamp_min": "clamp", "clamp_max": "clamp",
    "to": "cast", "type": "cast", "float": "cast", "double": "cast", "half": "cast", "bfloat16": "cast",
    "int": "cast", "long": "cast", "bool": "cast", "type_as": "cast",
    "new_ones": "full", "new_zeros": "full", "new_full": "full", "full_like": "full", "ones_like": "full",
    "zeros_like": "full", "new_tensor": "full", "scalar_tensor": "full",
    "detach": "same", "clone": "same", "contiguous": "same", "__getitem__": "getitem",
}
_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "int": torch.int32, "long": torch.int64, "bool": torch.bool}
_FILL = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}


class _Tracer:
    def __init__(self, kind: str, name: str, captured: set[int]):
        self.kind, self.name = kind, name
        self.nodes: list[Node] = []
        self.captured = captured  # ids of the tensors the mod's closure and globals hold
        self.tensors: list[torch.Tensor] = []  # every captured tensor, by slot (others: pinned)
        self.scalars: list[torch.dtype] = []
        self.consts: dict[tuple, Node] = {}

    def refuse(self, what: str) -> None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"{self.kind}_mod {self.name!r} {what}")

    def add(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def sym(self, node: Node) -> Sym:
        return Sym(self.node_of(node), self)

    def node_of(self, x) -> Node:
        """x as a node: a Sym's own, a number as a constant, a 0-dim captured tensor as its load."""
        if isinstance(x, Sym):
            return x.node
        if isinstance(x, Node):
            return x
        if isinstance(x, Indexed):
            self.refuse(f"uses a captured tensor of {x.tensor.args[1]} dimensions with {len(x.indices)} indices: "
                        "index every dimension (bias[h, q_idx - kv_idx])")
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 and id(x) not in self.captured:  # made by the mod itself: torch.tensor(2.0)
                return self.add(Node("const", (x.item(),), x.dtype))
            return self.load(self.tensor(x), ())
        if isinstance(x, (bool, int, float)):
            key = (type(x), x)
            if key not in self.consts:
                dtype = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float32
                self.consts[key] = self.add(Node("const", (x,), dtype, weak=True))
            return self.consts[key]
        self.refuse(f"computes with a {type(x).__name__}, which the kernels cannot take")
        raise AssertionError  # (refuse raises)

    def tensor(self, t: torch.Tensor) -> Node:
        """The node of a captured tensor: its slot where the mod's closure or globals hold it, else a new
        slot pinned to this very tensor (a tensor inside a helper the mod calls)."""
        if t.is_complex() or t.layout != torch.strided:
            self.refuse(f"captures a {t.dtype} {t.layout} tensor; the kernels read strided real tensors")
        for node in self.nodes:
            if node.op == "tensor" and self.tensors[node.args[0]] is t:
                return node
        self.tensors.append(t)
        return self.add(Node("tensor", (len(self.tensors) - 1, t.dim()), t.dtype))

    def load(self, tensor: Node, indices: tuple) -> Node:
        ndim = tensor.args[1]
        if len(indices) != ndim:
            self.refuse(f"indexes a captured tensor of {ndim} dimensions with {len(indices)} indices")
        nodes = []
        for i in indices:
            integral = isinstance(i, int) or isinstance(i, Sym) and not (i.dtype.is_floating_point
                                                                         or i.dtype == torch.bool)
            if isinstance(i, bool) or not integral:
                self.refuse(f"indexes a captured tensor with {i!r}: indices are integers (slices, masks and lists "
                            "are not compiled)")
            nodes.append(self.node_of(i))
        return self.add(Node("load", (tensor, *nodes), tensor.dtype))

    def index(self, base, index) -> Sym | Indexed:
        index = index if isinstance(index, tuple) else (index,)
        if isinstance(base, torch.Tensor):
            base = Indexed(self.tensor(base), (), self)
        indices = base.indices + index
        if len(indices) < base.tensor.args[1]:
            return Indexed(base.tensor, indices, self)
        return Sym(self.load(base.tensor, indices), self)

    def call(self, name: str, args: tuple, kwargs: dict, method: bool = False) -> Any:
        name = name.removeprefix("__").removesuffix("__") if name != "__getitem__" else name
        reverse = name.startswith("r") and name[1:] in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                         "and", "or", "xor", "lshift", "rshift")
        if reverse:
            name, args = name[1:], (args[1], args[0], *args[2:])
        found = _NAMES.get(name)
        if found is None:
            self.refuse(f"calls {name}, which cuflash cannot compile into its kernels (supported: arithmetic, "
                        "comparisons, logic, where, clamp, exp/log/tanh/sigmoid/sqrt-style math, casts, and indexing "
                        "captured tensors)")
        op: str = found  # type: ignore[assignment]
        if op == "getitem":
            return self.index(args[0], args[1])
        if op == "same":
            return args[0]
        if op == "full":
            return self.full(name, args, kwargs)
        if op == "cast":
            return self.cast(name, args, kwargs)
        if op == "clamp":
            return self.clamp(name, args, kwargs)
        if op == "square":
            return self.record("mul", (args[0], args[0]), name)
        if name in ("div", "divide") and kwargs.get("rounding_mode") is not None:
            op = {"floor": "floordiv", "trunc": "truncdiv"}[kwargs.pop("rounding_mode")]
        kwargs.pop("rounding_mode", None)
        alpha = kwargs.pop("alpha", None)
        if alpha is not None and op in ("add", "sub"):
            args = (args[0], self.record("mul", (args[1], alpha), name))
        if op in ("maximum", "minimum") and len(args) != 2:
            self.refuse(f"calls {name} with {len(args)} argument(s): only the elementwise two-argument form compiles")
        if name == "where" and method:  # x.where(cond, y) is torch.where(cond, x, y)
            args = (args[1], args[0], *args[2:], *([kwargs.pop("other")] if "other" in kwargs else []))
        if kwargs:
            self.refuse(f"calls {name} with {sorted(kwargs)}, which cuflash cannot compile")
        if len(args) != OPS[op]:
            self.refuse(f"calls {name} with {len(args)} arguments")
        return self.record(op, args, name)

    def record(self, op: str, args: tuple, name: str) -> Sym:
        nodes = tuple(self.node_of(a) for a in args)
        examples = [_example(n) for n in nodes]
        weak = all(n.weak for n in nodes)  # Python numbers only (slope * 2): a Python number again
        if weak:
            examples = [torch.empty((), dtype=n.dtype, device="meta") for n in nodes]
        if name.startswith("logical"):  # logical_and/or/xor/not: on the operands' truth values
            nodes = tuple(n if n.dtype == torch.bool else self.add(Node("ne", (n, self.node_of(0)), torch.bool,
                                                                        n.dtype)) for n in nodes)
            examples = [torch.empty((), dtype=torch.bool, device="meta")] * len(nodes)
        if op == "where" and nodes[0].dtype != torch.bool:
            self.refuse(f"calls where with a {nodes[0].dtype} condition: torch.where takes a bool one")
        try:
            compute = None
            if op in BINARY or op == "where":
                first = 1 if op == "where" else 0
                compute = torch.result_type(*examples[first:])
                # (some ops take no Python number: theirs become tensors of the promoted dtype)
                examples[first:] = [x if isinstance(x, torch.Tensor) else torch.empty((), dtype=compute,
                                                                                       device="meta")
                                    for x in examples[first:]]
            dtype = _TORCH[op](*examples).dtype
        except (RuntimeError, TypeError) as e:
            self.refuse(f"calls {name} on {[_describe(n) for n in nodes]}, which torch refuses: {e}")
        return Sym(self.add(Node(op, nodes, dtype, compute, weak)), self)

    def full(self, name: str, args: tuple, kwargs: dict) -> Sym:
        like = args[0]
        value = _FILL.get(name)
        rest = list(args[1:])
        if name in ("new_ones", "new_zeros") and rest:
            kwargs.setdefault("size", rest.pop(0))
        if value is None:  # new_full(size, v), full_like(x, v), new_tensor(v), scalar_tensor(v)
            if name == "new_full":
                kwargs.setdefault("size", rest.pop(0))
            value = rest.pop(0) if rest else kwargs.pop("fill_value", kwargs.pop("data", None))
        size = kwargs.pop("size", ())
        if tuple(size) != ():
            self.refuse(f"calls {name} with size {tuple(size)}: a mod computes one score (size ())")
        dtype = kwargs.pop("dtype", None) or (like.dtype if isinstance(like, (Sym, torch.Tensor)) else torch.float32)
        for k in ("device", "layout", "requires_grad", "pin_memory", "memory_format"):
            kwargs.pop(k, None)
        if kwargs or rest or not isinstance(value, (bool, int, float)):
            self.refuse(f"calls {name} with {value!r}: a constant number is compiled, nothing else")
        return self.cast_node(self.node_of(value), dtype)

    def cast(self, name: str, args: tuple, kwargs: dict) -> Sym:
        x = args[0]
        if name in _CAST_METHODS:
            dtype = _CAST_METHODS[name]
        elif name == "type_as":
            dtype = args[1].dtype
        else:
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            dtype = target.dtype if isinstance(target, (Sym, torch.Tensor)) else target  # type: ignore[assignment]
            if not isinstance(dtype, torch.dtype):
                self.refuse(f"calls {name}({target!r}): only a dtype (or a tensor of the dtype) is compiled")
        if dtype.is_complex:
            self.refuse(f"casts to {dtype}")
        return self.cast_node(self.node_of(x), dtype)

    def cast_node(self, node: Node, dtype: torch.dtype) -> Sym:
        return Sym(node if node.dtype == dtype and not node.weak else self.add(Node("cast", (node,), dtype)), self)

    def clamp(self, name: str, args: tuple, kwargs: dict) -> Sym:
        x = args[0]
        lo = args[1] if len(args) > 1 else kwargs.pop("min", None)
        hi = args[2] if len(args) > 2 else kwargs.pop("max", None)
        if name == "clamp_max":
            lo, hi = None, lo
        if lo is not None:
            x = self.record("maximum", (x, lo), name)
        if hi is not None:
            x = self.record("minimum", (x, hi), name)
        return x


def _example(n: Node):
    """A stand-in with n's type for torch to infer dtypes from: a Python number for a weak node (as
    torch promotes them), else a 0-dim meta tensor."""
    if n.weak:
        return {torch.bool: True, torch.int64: 1, torch.float32: 1.0}.get(n.dtype, 1.0)
    return torch.empty((), dtype=n.dtype, device="meta")


def _describe(n: Node) -> str:
    return f"{'Python ' if n.weak else ''}{str(n.dtype).removeprefix('torch.')}"


_TORCH: dict[str, Callable] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "truncdiv": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": torch.remainder, "fmod": torch.fmod, "pow": torch.pow, "maximum": torch.maximum,
    "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
    "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift, "where": torch.where,
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "log1p": torch.log1p, "expm1": torch.expm1, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil,
    "trunc": torch.trunc, "round": torch.round, "sign": torch.sign, "reciprocal": torch.reciprocal,
    "relu": torch.relu, "not": torch.logical_not, "invert": torch.bitwise_not,
}
assert set(_TORCH) == set(OPS) - {"cast"}, "every op has its torch function"
TORCH_OPS = _TORCH  # mods/evaluate.py computes the graph with these


# ---------------------------------------------------------------------------------------------------
# Captures: what a mod's closure and the globals it names hold, found the same way at every call.

@dataclass(frozen=True)
class Traced:
    """A traced mod and where its captures are (paths, as _at follows them): `paths` of the tensors
    (slots in graph order; None: a tensor pinned at trace time, kept in `pinned`), `scalar_paths` of the
    lifted numbers, `pins` of everything else the trace depends on (numbers baked in, other values,
    captured functions, tuples and lists, other objects: what a compiled graph guards, mods/compiled.py)."""
    graph: ModGraph
    paths: tuple
    pinned: tuple
    scalar_paths: tuple
    pins: tuple = ()
    keep: tuple = ()  # what the cache key names by identity, kept alive so that no other object takes its id


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _leaves(fn, lift: bool):
    """(path, value) of every tensor and, with lift, every number among fn's top-level captures (its
    closure cells, then the globals its code names), recursing into captured functions, tuples and
    lists (and_masks' list of mods); `key` describes the rest (functions by code, numbers not lifted by
    value, other objects by identity); `pins`: the paths of what the key describes but modules."""
    leaves: list[tuple[tuple, Any]] = []
    key: list = []
    pins: list[tuple] = []

    def walk(value, path, top: bool, depth: int = 0):
        if isinstance(value, torch.Tensor):
            leaves.append((path, value))
            key.append(("t", value.dtype, value.dim()))
            return
        if isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
            key.append(("m", id(value)))
            return
        if _is_number(value) and top and lift:
            leaves.append((path, value))
            key.append(("n", type(value)))
            return
        pins.append(path)
        if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
            key.append(("v", type(value), value))
        elif isinstance(value, types.FunctionType) and depth < 8:
            key.append(("f", value.__code__))
            for step, item in _captures(value):
                walk(item, path + (step,), False, depth + 1)
        elif isinstance(value, (tuple, list)) and depth < 8:
            key.append(("s", len(value)))
            for i, item in enumerate(value):
                walk(item, path + (i,), False, depth + 1)
        else:
            key.append(("o", id(value)))
            leaves.append((path, value))  # (kept alive with the trace; not a tensor)

    for step, value in _captures(fn):
        walk(value, (step,), True)
    return leaves, tuple(key), tuple(pins)


def _captures(fn) -> list[tuple[tuple[str, str], Any]]:
    """fn's closure cells, then the non-builtin globals its code (and the code of functions nested in
    it) names, as (step, value): step ("cell", name) or ("global", name), as _at follows it."""
    code = fn.__code__
    out = [(("cell", name), cell.cell_contents) for name, cell in zip(code.co_freevars, fn.__closure__ or ())]
    names: list[str] = []
    stack = [code]
    while stack:
        c = stack.pop()
        names += [n for n in c.co_names if n not in names]
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    out += [(("global", n), fn.__globals__[n]) for n in names if n in fn.__globals__ and not hasattr(builtins, n)]
    return out


def at(fn, path):
    """The capture of mod fn at `path`, whose steps are ("cell", name): that closure cell of the function
    reached so far; ("global", name): that global of it; an int: that item of the tuple or list reached
    so far. fn may also be a dict of a function's captures by name (mods/compiled.py: a built-in mod
    under torch.compile). Plain attribute reads, so that torch.compile traces them (and guards what
    they read)."""
    value = fn
    for step in path:
        if isinstance(step, int):
            value = value[step]
        elif isinstance(value, dict):
            value = value[step[1]]
        elif step[0] == "cell":
            value = value.__closure__[value.__code__.co_freevars.index(step[1])].cell_contents
        else:
            value = value.__globals__[step[1]]
    return value


def _rebuilt(fn, values: dict[str, Any]):
    """fn with some of its closure cells and globals replaced by `values` (by name)."""
    code = fn.__code__
    cells = tuple(types.CellType(values[name]) if name in values else cell
                  for name, cell in zip(code.co_freevars, fn.__closure__ or ()))
    glob = fn.__globals__
    if any(name in glob and name not in code.co_freevars for name in values):
        glob = dict(glob)
        glob.update({k: v for k, v in values.items() if k not in code.co_freevars})
    return types.FunctionType(code, glob, fn.__name__, fn.__defaults__, cells or None)


_traces: dict[tuple, Traced | None] = {}  # None: the mod branches on a captured number (_NeedsValues)
_lock = threading.Lock()


def trace(fn, kind: str) -> tuple[Traced, list[torch.Tensor], list[float | int]]:
    """The traced graph of mod fn (kind "score" or "mask"), with the tensors and numbers it captures now,
    in the order of the graph's tensor and scalar slots."""
    traced = traced_graph(fn, kind)
    tensors = [at(fn, p) if p is not None else t for p, t in zip(traced.paths, traced.pinned)]
    return traced, tensors, [at(fn, p) for p in traced.scalar_paths]


def traced_graph(fn, kind: str) -> Traced:
    """Mod fn traced (kind "score" or "mask"), from the cache where a mod of its code with captures of the
    same kinds was traced before."""
    if not callable(fn):
        fail(ErrorCode.INVALID_ARGUMENT, f"{kind}_mod must be a function, got {type(fn).__name__}")
    if not isinstance(fn, types.FunctionType):  # a partial or callable object: traced once per object
        key: tuple = (kind, "object", id(fn))
        traced = _traces.get(key)
        return traced or _remember(key, _trace(fn, kind, [(None, fn)], (), lift=False))
    leaves, shape, pins = _leaves(fn, lift=True)
    key = (kind, fn.__code__, shape)
    if key in _traces:
        traced = _traces[key]
    else:
        try:
            traced = _remember(key, _trace(fn, kind, leaves, pins, lift=True))
        except _NeedsValues:
            traced = _remember(key, None)
    if traced is None:  # numbers baked in: one trace per value
        leaves, shape, pins = _leaves(fn, lift=False)
        key = (kind, "baked", fn.__code__, shape)
        traced = _traces.get(key) or _remember(key, _trace(fn, kind, leaves, pins, lift=False))
    assert traced is not None
    return traced


def _remember(key: tuple, traced):
    with _lock:
        if len(_traces) >= _CACHE_LIMIT:
            _traces.pop(next(iter(_traces)))
        _traces[key] = traced
    return traced


class _NeedsValues(Exception):
    """A lifted number was used in Python control flow: trace again with the numbers baked in."""


def _trace(fn, kind: str, leaves, pins: tuple, lift: bool) -> Traced:
    name = getattr(fn, "__qualname__", type(fn).__name__)
    tensor_paths = {id(v): p for p, v in leaves if isinstance(v, torch.Tensor) and p is not None}
    tracer = _Tracer(kind, name, set(tensor_paths))
    scalar_paths: list[tuple] = []
    replace: dict[str, Any] = {}
    if lift:
        for path, value in leaves:
            if _is_number(value) and len(path) == 1:
                dtype = torch.float32 if isinstance(value, float) else torch.int64
                if isinstance(value, int) and not -2**31 <= value < 2**31:
                    continue
                node = tracer.add(Node("scalar", (len(scalar_paths),), dtype, weak=True))
                scalar_paths.append(path)
                tracer.scalars.append(dtype)
                replace[path[0][1]] = Sym(node, tracer)
    traced_fn = _rebuilt(fn, replace) if replace else fn
    inputs = [Sym(tracer.add(Node("input", (i,), torch.float32 if (kind == "score" and i == 0) else INDEX_DTYPE)),
                  tracer) for i in range(5 if kind == "score" else 4)]
    try:
        with torch.no_grad():
            result = traced_fn(*inputs)
    except (FlashAttentionError, _NeedsValues):
        raise
    except Exception as e:  # noqa: BLE001 -- every failure of the user's code becomes a FlashAttentionError
        tracer.refuse(f"failed while traced on symbolic scores: {type(e).__name__}: {e}")
    output = _result(tracer, result)
    used = _used(tracer.nodes, output)
    nodes = [n for n in tracer.nodes if id(n) in used]
    slots = [n.args[0] for n in nodes if n.op == "tensor"]
    graph = ModGraph(kind, name, nodes, output,
                     tuple(TensorSpec(tracer.tensors[i].dtype, tracer.tensors[i].dim()) for i in slots),
                     tuple(tracer.scalars))
    _renumber(graph, slots)
    paths = tuple(tensor_paths.get(id(tracer.tensors[i])) for i in slots)
    pinned = tuple(tracer.tensors[i] if p is None else None for i, p in zip(slots, paths))
    keep = tuple(v for p, v in leaves if not isinstance(v, torch.Tensor))
    return Traced(graph, paths, pinned, tuple(scalar_paths), pins, keep)


def _result(tracer: _Tracer, result) -> Node:
    if tracer.kind == "mask":
        if isinstance(result, bool):
            return tracer.node_of(result)
        if not isinstance(result, Sym) or result.dtype != torch.bool:
            tracer.refuse(f"returns {_what(result)}; a mask_mod returns a bool (True: the key is seen)")
        return result.node
    if not isinstance(result, Sym) or not result.dtype.is_floating_point:
        tracer.refuse(f"returns {_what(result)}; a score_mod returns the score, a floating-point 0-dim tensor")
    return result.node


def _what(x) -> str:
    if isinstance(x, Sym):
        return f"a {x.dtype} value"
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} (not computed from its arguments)"
    return f"{type(x).__name__} {x!r}"


def _used(nodes: list[Node], output: Node) -> set[int]:
    used = {id(output)}
    for n in reversed(nodes):
        if id(n) in used:
            used.update(id(a) for a in n.args if isinstance(a, Node))
    return used


def _renumber(graph: ModGraph, slots: list[int]) -> None:
    """Tensor nodes numbered 0.. in graph order (unused captures dropped); the key recomputed."""
    order = {s: i for i, s in enumerate(slots)}
    remap: dict[int, Node] = {}
    new_nodes = []
    for n in graph.nodes:
        args = tuple(remap.get(id(a), a) if isinstance(a, Node) else a for a in n.args)
        if n.op == "tensor":
            args = (order[n.args[0]], n.args[1])
        m = Node(n.op, args, n.dtype, n.compute, n.weak)
        remap[id(n)] = m
        new_nodes.append(m)
    graph.nodes = new_nodes
    graph.output = remap[id(graph.output)]
    graph.key = ""
    graph.__post_init__()
