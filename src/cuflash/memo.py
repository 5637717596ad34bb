"""Bounded memo tables that several threads fill at once (autograd runs the backward in a thread of
its own while the caller's thread goes on to the next forward): the launch plans
(kernels/launch.py) and the checked calls of the public functions.

A public function's checks of shapes, dtypes, devices, strides, options and the backend read
nothing but the tensors' shapes, strides, dtypes and devices, the options and the backend
settings, so a call signature that passed them once passes again: `checked(signature(...), build)`
runs them once per signature. Only eager calls whose options are plain Python values are
remembered (no ALiBi slopes or mask, which are tensors; no dropout, whose seed is drawn per call);
checks of tensor values (flash_attn_with_kvcache's index tensors) run every call."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from .backend import backend_settings

V = TypeVar("V")

CHECKED: dict[tuple, object] = {}  # signature -> what its checks built
MAX_CHECKED = 1024  # signatures remembered; the oldest go first


def remember(table: dict, key, value: V, limit: int) -> V:
    """table[key] = value, first dropping the oldest entries while the table holds `limit` or more.
    Another thread may drop the same entry meanwhile: pop tolerates that, where `del` would raise
    KeyError."""
    while len(table) >= limit:
        try:
            table.pop(next(iter(table)), None)
        except (StopIteration, RuntimeError):  # emptied, or resized during next(), by another thread
            break
    table[key] = value
    return value


def signature(tensors: tuple, *options) -> tuple | None:
    """The key of a call on plain tensors (or None in their place) with plain options; None under
    torch.compile (the memo would be a guard on every entry; the traced graph holds no checks anyway)
    or for tensor subclasses."""
    if torch.compiler.is_compiling() or any(t is not None and type(t) is not torch.Tensor for t in tensors):
        return None
    return (*(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors), *options,
            backend_settings())


def number(x) -> bool:
    """A plain Python number (not a bool, a tensor or a numpy scalar)."""
    return type(x) is float or type(x) is int


def plain_flash_options(softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink) -> bool:
    """Whether flash-attn's common options of a call are plain Python values that a signature may
    hold: no ALiBi slopes or sink (tensors), a float or default scale, a bool causal, a window of two
    ints."""
    return (alibi_slopes is None and learnable_sink is None and (softmax_scale is None or type(softmax_scale) is float)
            and type(causal) is bool and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int and number(softcap))


def checked(key: tuple | None, build: Callable[[], V]) -> V:
    """build()'s result, run once per key (every time without one)."""
    value = CHECKED.get(key) if key is not None else None
    if value is None:
        value = build()
        if key is not None:
            remember(CHECKED, key, value, MAX_CHECKED)
    return value  # type: ignore[return-value]


def remembered(key: tuple | None, build: Callable[[], V]) -> tuple[V, dict | None]:
    """(checked(key, build), the dict in which the backend keeps the launch plans of the key's calls
    (ops.forward)); without a key (build() made anew every call) no dict."""
    if key is None:
        return build(), None
    return checked(key, lambda: (build(), {}))
