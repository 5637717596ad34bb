"""Every difference between the Triton versions cuflash runs on, in one module: 3.6 (the GPU
machine's, which runs the kernels) and 3.9 (the CPU machine's, whose interpreter runs the Triton
kernels and whose compiler builds the Gluon ones offline). Older Tritons have no Gluon dialect:
there the Triton kernels take every input.

Gluon's names that changed after 3.6: the TMA load and store and the thread barrier were renamed;
the TMA reduction into global memory (the fused backward's dQ) has a Gluon function only after
3.6, whose IR builder has the operation. compiled_launcher is the one use of Triton's launch
internals (a compiled kernel's launcher and its arguments), the same in both.
"""
import importlib
from typing import Any, Callable

import torch
import triton
from triton import knobs

TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
# The Gluon kernels were written against 3.6 and 3.9; Gluon's API changed between the releases
# that have it, so older ones take the Triton kernels.
GLUON_TRITON = TRITON_VERSION >= (3, 6)


def compiled_launcher(compiled, grid: tuple[int, int, int]) -> Callable[..., None]:
    """A function launching the compiled kernel `compiled` on `grid` with its arguments in signature
    order, on the current device's current torch stream, through the launcher the kernel's own runner
    (`compiled[grid]`) calls, with the same arguments but without the runner's Python per launch: the
    current device through torch.cuda, and, in Triton 3.6 and 3.9 (whose launch hooks are chains that
    are never None), launch metadata built and two empty hook chains called from C. While a hook is
    set (a profiler such as proton), launches go through the runner."""
    runner = compiled[grid]  # (loads the kernel onto the device)
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    stream_of, current_device, hooks = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice, knobs.runtime

    def launch(*args) -> None:
        if _no_hook(hooks.launch_enter_hook) and _no_hook(hooks.launch_exit_hook):
            run(*grid, stream_of(current_device()), function, metadata, None, None, None, *args)
        else:
            runner(*args)
    return launch


def _no_hook(hook) -> bool:
    return hook is None or (type(hook) is knobs.HookChain and not hook.calls)


def gluon_kernels(name: str):
    """The Gluon kernel module kernels.gluon.<name> where this Triton runs it, else None."""
    return importlib.import_module(f"{__package__}.gluon.{name}") if GLUON_TRITON else None


if GLUON_TRITON:
    from triton._C.libtriton import ir
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import tma

    tma_load: Any = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    tma_store: Any = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
    barrier: Any = getattr(gl, "barrier", None) or gl.thread_barrier

    @builtin
    def _tma_add_36(desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

    tma_add: Any = getattr(tma, "async_atomic_add", None) or _tma_add_36
