"""What the kernels ask of the GPU and of the tensors they read: the architecture and SM count,
global scratch for tensor descriptors, what the copy engine can address, and small integer helpers."""
from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def arch(device: torch.device) -> int:
    """Compute capability as 10 * major + minor (90: Hopper); 0 for CPU tensors (Triton's interpreter)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if arch(device) == 0:
        return 4  # the interpreter: a few "SMs", so that the CPU tests see the decode kernel's splits
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use (what Triton checks a compiled kernel against);
    unbounded under the interpreter."""
    if arch(device) == 0:
        return 1 << 62
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"]


_HERE = contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """A context in which Triton launches on t's GPU. Triton loads a kernel onto, launches it on and
    allocates its scratch on the current CUDA device, which need not be the inputs' (a model split
    over GPUs in one process, as transformers' device_map="auto" places it, calls attention on each
    while the current device stays the first); flash-attn and torch switch to their inputs' device
    as this does. Nothing where t is on the current device or on the CPU."""
    index = t.get_device()
    if index < 0 or index == torch._C._cuda_getDevice():
        return _HERE
    return torch.cuda.device(index)


def on_inputs_device(fn):
    """fn(x, ...) run in on_device(x): for functions that launch Triton kernels of their own (the
    teaching methods)."""
    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        with on_device(x):
            return fn(x, *args, **kwargs)
    return run


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator: global memory where kernels write their tensor descriptors (128 bytes
    each, per program), from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_addressable(*tensors: torch.Tensor) -> bool:
    """16-byte aligned bases and strides, rows at positive strides: what a descriptor can read."""
    for t in tensors:
        unit = 16 // t.element_size()
        if t.data_ptr() % 16 or any(stride % unit or (stride <= 0 and n > 1)
                                    for n, stride in zip(t.shape[:-1], t.stride()[:-1])):
            return False
    return True


def tf32(q: torch.Tensor) -> bool:
    """fp32 stays exact unless the user opted into TF32 for matmuls, as torch does."""
    return q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (triton.cdiv is a JIT-callable costing microseconds per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The kernels' BLOCK_D: the head dim rounded up to a power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))
