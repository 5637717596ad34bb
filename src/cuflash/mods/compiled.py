"""Mods under torch.compile. Dynamo cannot trace our tracer (trace.py), so a compiled call's mods reach
the custom ops packed (Mods.packed, mods.Packed) without a Mod ever being made in the graph:

- `_traced` runs once per graph, at compile time (torch.compiler.assume_constant_result: the real
  function in, a constant out): it traces the mod (from trace.py's cache), registers its graph and
  returns the graph's name with the paths of what the mod captures;
- the graph then reads the captured tensors and numbers along those paths (trace.at: closure cells,
  globals, items), so that Dynamo guards them as it guards any input: a new bias table of the same
  kind compiles nothing, a new captured number compiles the graph again (its value is a constant of
  the graph), and `_pin` guards the rest the trace depends on (numbers baked in, captured functions
  by their code, the lengths of tuples and lists, other objects by identity).

What cannot enter a graph runs eagerly, through a torch.compiler.disable'd call (a graph break, which
torch.compile(fullgraph=True) reports with the reason): a mod made inside the compiled function (Dynamo
gives no access to its closure), one that is not a plain function (functools.partial, a bound method,
a callable object), and one that reads a tensor reached through another object (self.bias of a
captured module). A mod the kernels cannot compute raises FlashAttentionError in the graph, as eagerly.
"""
from __future__ import annotations

import types

import torch

from ..builtin_mods import chunked_local, chunked_local_captures
from ..errors import ErrorCode, FlashAttentionError, fail
from . import needs_grad, registered
from .trace import at, traced_graph

EAGER_REASON = ("cuflash: a call with a score_mod or mask_mod that cannot enter a compiled graph runs eagerly here: "
                "one made inside the compiled function, a functools.partial, bound method or callable object, or one "
                "reading a tensor through another object; define it as a plain function outside the compiled "
                "function, capturing its tensors directly (docs/programmable.md). (flash_attn_func's "
                "return_attn_probs=True with mods runs eagerly too.)")


def runs_eagerly(score_mod, mask_mod) -> bool:
    """Under torch.compile: whether a call with these mods (None: none) runs eagerly, because one of
    them cannot enter the graph (the module's doc)."""
    return any(fn is not None and (not _in_graph(fn) or _traced(fn, kind)[0] == "eager")
               for fn, kind in ((score_mod, "score"), (mask_mod, "mask")))


def _in_graph(fn) -> bool:
    """Whether Dynamo can read mod fn's captures: a plain function from outside the compiled function
    (for one made inside it, Dynamo raises AttributeError at __closure__ and __globals__)."""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        fn.__closure__, fn.__globals__
    except AttributeError:
        return False
    return True


@torch.compiler.assume_constant_result
def _traced(fn, kind: str, chunked: bool | None = None) -> tuple:
    """Mod fn (kind "score" or "mask") traced at compile time: ("graph", its graph's registered name,
    the paths of its captured tensors, of its captured numbers, of what else the trace depends on);
    ("eager",) where it reads a tensor no path reaches; ("error", code, message) where it is bad.
    chunked: trace builtin_mods.chunked_local of mask_mod fn instead (graph_chunked_local), its offset
    per sequence (True) or not."""
    if chunked is not None:  # a stand-in: captures of the kinds the call's, whose values the trace does not read
        fn = chunked_local(1, torch.zeros(1, dtype=torch.int32) if chunked else 0, fn)
    try:
        traced = traced_graph(fn, kind)
    except FlashAttentionError as error:
        return ("error", error.code, error.message)
    if None in traced.paths:
        return ("eager",)
    return ("graph", registered(traced.graph), traced.paths, traced.scalar_paths, traced.pins)


def graph_mod(fn, kind: str, device: torch.device) -> tuple:
    """Under torch.compile: mod fn as mods.packed() takes it, (name, tensors, scalars) and for a score_mod
    requires_grad too, its captures read in the graph. fn must enter the graph (runs_eagerly)."""
    return _read(_traced(fn, kind), fn, kind, device)


def graph_chunked_local(chunk: int, offset: int | torch.Tensor, mask_mod, device: torch.device) -> tuple:
    """Under torch.compile: builtin_mods.chunked_local(chunk, offset, mask_mod) as graph_mod gives it.
    The function chunked_local makes would be made in the graph, whose captures Dynamo cannot read: a
    stand-in made at compile time is traced instead (the same code, captures of the same kinds), and
    the call's captures are read from chunked_local_captures, by name."""
    traced = _traced(mask_mod, "mask", isinstance(offset, torch.Tensor))
    return _read(traced, chunked_local_captures(chunk, offset, mask_mod), "mask", device)


def _read(traced: tuple, root, kind: str, device: torch.device) -> tuple:
    """graph_mod's answer from _traced's, the captures read from root (the mod, or its captures by name)."""
    if traced[0] == "error":
        fail(traced[1], traced[2])
    _, name, tensor_paths, scalar_paths, pins = traced
    tensors = [at(root, path) for path in tensor_paths]
    for t in tensors:
        if t.device != device:
            fail(ErrorCode.DEVICE_MISMATCH, f"a {kind}_mod captures a tensor on {t.device} but the attention runs "
                 f"on {device}")
    for path in pins:
        _pin(at(root, path))
    scalars = [at(root, path) for path in scalar_paths]
    return (name, tensors, scalars, needs_grad(tensors)) if kind == "score" else (name, tensors, scalars)


def _pin(value) -> None:
    """Has Dynamo guard `value`, a capture the trace depends on: a function by its code, a tuple or list
    by its length, a number, string, bool, None or dtype by its value (a symbolic number gets its value
    fixed by hash()), another object by identity."""
    if isinstance(value, types.FunctionType):
        hash(value.__code__)
    elif isinstance(value, (tuple, list)):
        len(value)
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        hash(value)
    else:
        id(value)
