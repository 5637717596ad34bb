"""Kernel launches whose host work is done once per call signature.

A signature (the launcher's key: its scalar options and configuration; and every tensor
argument's shape, strides, dtype, device and 16-byte alignment, which is all Triton specializes a
pointer on) fixes every argument of a launch but the tensors' addresses. The first call of a
signature builds the arguments, launches through Triton's JIT (compiling if needed) and keeps the
compiled kernel with its arguments in the kernel's order; later calls put the new tensors in
their places and launch the compiled kernel directly, skipping our argument building and Triton's
binding and specialization of ~45 arguments, each about half of a short forward's host time
(scripts/overhead.py). The compiled kernel is launched through its launcher directly
(compat.compiled_launcher: the arguments of Triton's own runner, the same in Triton 3.6 and 3.9).

Under Triton's interpreter (the CPU tests) there is no compiled kernel: plans launch the
interpreted kernel with the stored arguments, the same order and tensor slots as on the GPU.
Every launch but a compiled kernel's through its launcher goes through run_kernel, which runs
interpreted launches one at a time.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
import triton

from ..memo import remember
from .compat import compiled_launcher
from .device import on_device, scratch, tf32

# One plan per signature; a workload with endlessly new shapes (varlen batches with a new longest
# sequence each step) drops the oldest plans past this many.
MAX_PLANS = 4096
PLANS: dict[tuple, LaunchPlan] = {}  # (launch()'s key, the tensors' names, their signature) -> its plan
_uninitialized: set[int] = set()  # ids of the workspaces build() asked for uninitialized
# Triton's interpreter keeps the running program's grid index and its patches of triton.language in
# globals: two interpreted launches at once (from two threads) read each other's.
_interpreting = threading.Lock()


def run_kernel(kernel, grid, *args, **options):
    """kernel[grid](*args, **options), the launch of every kernel not launched by a plan's compiled
    launcher: a kernel compiled for the GPU (a JITFunction) at once, an interpreted one
    (TRITON_INTERPRET=1) while no other interpreted launch runs."""
    if isinstance(kernel, triton.JITFunction):
        return kernel[grid](*args, **options)
    with _interpreting:
        return kernel[grid](*args, **options)


def workspace(shape: tuple, dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> torch.Tensor:
    """A workspace for build() to add to launch()'s tensors: zero-filled, or with zeroed=False
    uninitialized (for kernels that write all of it before reading any), and made the same way anew
    for every later call of the plan."""
    if zeroed:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    _uninitialized.add(id(t))
    return t


class LaunchPlan:
    """The launches of one signature, and the workspaces they need, made anew on every call:
    (shape, dtype, device, zero-filled) by name."""
    __slots__ = ("workspaces", "launches")

    def __init__(self, workspaces: dict[str, tuple], launches: list[_Launch]):
        self.workspaces, self.launches = workspaces, launches

    def __call__(self, tensors: dict[str, torch.Tensor | int]) -> None:
        """Launches on `tensors`, the same names in the same order as when the plan was made, the
        first a tensor on the launches' device (its workspaces are added)."""
        for name, (shape, dtype, device, zeroed) in self.workspaces.items():
            tensors[name] = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
        values = tuple(tensors.values())
        with on_device(values[0]):  # type: ignore[arg-type]
            for one in self.launches:
                one(values)


class _Launch:
    """One kernel launch of a plan: the compiled kernel's launcher for its grid and its arguments,
    with the tensors' places left empty (a plan holds no tensor)."""
    __slots__ = ("run", "args", "slots", "tuples", "scratch")

    def __init__(self, kernel, grid: tuple, kwargs: dict, tensors: dict[str, torch.Tensor | int]):
        options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in kwargs}
        args = [kwargs.pop(name) for name in kernel.arg_names]
        if kwargs:
            raise TypeError(f"{kernel.fn.__name__}: not kernel arguments: {sorted(kwargs)}")
        compiled = run_kernel(kernel, grid, *args, **options)  # this call's launch (compiles a new variant)
        # A tensor argument takes the place of the same tensor among `tensors`, an int the place of its name;
        # a tuple argument (a mod's captures) is made anew with its tensors' places filled.
        places = {id(t): j for j, t in enumerate(tensors.values()) if isinstance(t, torch.Tensor)}
        names = tuple(tensors)
        slots: list[tuple] = []
        tuples: list[tuple] = []
        for i, (name, arg) in enumerate(zip(kernel.arg_names, args)):
            if isinstance(arg, torch.Tensor) or isinstance(arg, tuple) and any(isinstance(a, torch.Tensor)
                                                                                for a in arg):
                held = (arg,) if isinstance(arg, torch.Tensor) else arg
                missing = [k for k, a in enumerate(held) if isinstance(a, torch.Tensor) and id(a) not in places]
                if missing:
                    what = "is" if isinstance(arg, torch.Tensor) else "holds a tensor that is"
                    raise TypeError(f"{kernel.fn.__name__}: {name} {what} not one of the launch's tensors and would "
                                    "be frozen into its plan")
                if isinstance(arg, torch.Tensor):
                    slots.append((i, places[id(arg)]))
                else:
                    tuples.append((i, arg, tuple((k, places[id(a)]) for k, a in enumerate(arg)
                                                 if isinstance(a, torch.Tensor))))
            elif isinstance(arg, int) and name in tensors:  # (not a None standing for an absent tensor)
                if name not in _unspecialized(kernel):
                    raise TypeError(f"{kernel.fn.__name__}: {name} may change between calls of a plan, but the "
                                    "kernel specializes on its value (do_not_specialize)")
                slots.append((i, names.index(name)))
        for i, _ in slots:
            args[i] = None
        self.slots = tuple(slots)
        # (a plan holds no tensor: the tuples' tensor places are filled on every call)
        self.tuples = tuple((i, [None if isinstance(a, torch.Tensor) else a for a in arg], places)
                            for i, arg, places in tuples)
        self.args = args
        if compiled is None:  # the interpreter
            self.run, self.scratch = lambda *a: run_kernel(kernel, grid, *a, **options), False
        else:
            self.run = compiled_launcher(compiled, (*grid, 1, 1)[:3])
            # Descriptors built in the kernel need global scratch; Triton's allocator is per thread
            # (a context variable) and autograd runs the backward in its own thread.
            self.scratch = getattr(compiled.metadata, "global_scratch_size", 0) > 0

    def __call__(self, tensors: tuple[torch.Tensor | int, ...]) -> None:
        args = self.args.copy()
        for i, j in self.slots:
            args[i] = tensors[j]
        for i, held, places in self.tuples:
            filled = held.copy()
            for k, j in places:
                filled[k] = tensors[j]
            args[i] = tuple(filled)
        if self.scratch:
            triton.set_allocator(scratch)
        self.run(*args)


def _unspecialized(kernel) -> set[str]:
    """The arguments a kernel compiles without specializing on their value (do_not_specialize). The
    interpreter's functions keep only the decorator's list, of names or indices."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in kernel.kwargs.get("do_not_specialize") or ()}


def tensor_signature(values) -> tuple:
    """What Triton compiles a launch's arguments into (memo.signature is a public call's): each tensor's
    shape, strides, dtype, device and 16-byte alignment; of an int, whether it fits 32 bits (an
    unspecialized argument compiles from its width alone)."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor)
                 else -2**31 <= t < 2**31 for t in values)


def launch(key: tuple, tensors: dict[str, torch.Tensor | int], build: Callable[[], list[tuple]]) -> LaunchPlan:
    """Runs the launches build() describes, [(kernel, grid, keyword arguments with num_warps,
    num_stages or maxnreg)], on `tensors`: every tensor argument of those kernels (found there by
    identity, under any name; the first value is a tensor on the launches' device), and by argument
    name any int argument that every kernel taking it leaves unspecialized (do_not_specialize),
    whose value may change between calls of a plan. build() runs for a new signature only; key must
    hold the launcher (its first element) and everything else the arguments depend on. build() may
    add workspaces (workspace()) to `tensors`; later calls of the signature get fresh ones. Returns
    the plan, which a caller that finds it again by what a call signature leaves open (open_key) may
    call directly."""
    full_key = (key, tuple(tensors), tensor_signature(tensors.values()))
    plan = PLANS.get(full_key)
    if plan is None:
        given = set(tensors)
        with on_device(next(iter(tensors.values()))):  # type: ignore[arg-type]
            _uninitialized.clear()  # (no stale id of a freed workspace may match a new one)
            described = build()
            workspaces = {name: (t.shape, t.dtype, t.device, id(t) not in _uninitialized)
                          for name, t in tensors.items() if name not in given and isinstance(t, torch.Tensor)}
            _uninitialized.clear()
            plan = LaunchPlan(workspaces, [_Launch(kernel, grid, kwargs, tensors)
                                           for kernel, grid, kwargs in described])
        return remember(PLANS, full_key, plan, MAX_PLANS)
    plan(tensors)
    return plan


def open_key(plans: dict | None, pass_: str, inputs: tuple[torch.Tensor, ...], *extra) -> tuple | None:
    """The key of a plan in `plans`, a dict that a public function keeps per checked call signature
    (memo.remembered), which fixes the inputs' shapes, strides, dtypes and devices and the options:
    what a launch plan depends on beyond them, TF32 (fp32 inputs), each input's 16-byte alignment
    (Triton specializes a pointer on it, the Gluon kernels need it) and `extra`. None without plans.
    A later call of the signature finds its plan there, skipping launch()'s lookup (its dict of every
    argument, key and signature) and the work of choosing the launches."""
    if plans is None:
        return None
    return pass_, tf32(inputs[0]), *(t.data_ptr() % 16 == 0 for t in inputs), *extra


def kept(plans: dict | None, key: tuple | None) -> LaunchPlan | None:
    """The plan keep() put in `plans` under `key`, if any."""
    return None if key is None or plans is None else plans.get(key)


def keep(plans: dict | None, key: tuple | None, plan: LaunchPlan) -> None:
    # A handful of plans per signature at most (a backward's dO strides vary only by caller).
    if key is not None and plans is not None and len(plans) < 16:
        plans[key] = plan
