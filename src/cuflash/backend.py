"""Which backend runs a call: the Triton kernels (kernels/: CUDA tensors, and CPU tensors under
TRITON_INTERPRET=1) or the blocked PyTorch implementation (cpu.py: CPU tensors), from the tensors'
device and dtype and what the environment says: CUFLASH_BACKEND=auto|triton|cpu (auto: Triton on
CUDA tensors, cpu.py on CPU ones), TRITON_INTERPRET, the installed Triton. The validation of every
entry point asks here whether any backend runs a call; ops.py dispatches to the one named."""
from __future__ import annotations

import os

import torch

from .errors import ErrorCode, fail

BACKENDS = ("auto", "triton", "cpu")


def triton_version() -> str | None:
    """The installed Triton's version, or None without Triton."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def backend_settings() -> tuple[str, str | None]:
    """What the environment says of the backend: CUFLASH_BACKEND (default auto) and TRITON_INTERPRET."""
    return os.environ.get("CUFLASH_BACKEND", "auto"), os.environ.get("TRITON_INTERPRET")


_BACKEND_NAMES: dict[tuple, str] = {}  # (backend settings, device, dtype) -> backend_name's answer


def backend_name(device: torch.device, dtype: torch.dtype) -> str:
    """The backend that will run for tensors on `device`; raises FlashAttentionError when none can.
    Answers are kept (the choice queries the driver), errors are not. torch.compile traces the choice
    itself, not the table: the graph holds no check, and a table read in it would be guarded on the
    table's entries, recompiling when eager calls add one (a functools.lru_cache, Dynamo ignores,
    warning that this may be silently wrong)."""
    key = (*backend_settings(), device, dtype)
    if torch.compiler.is_compiling():
        return _choose_backend(*key)
    name = _BACKEND_NAMES.get(key)
    if name is None:
        name = _BACKEND_NAMES[key] = _choose_backend(*key)
    return name


def _choose_backend(choice: str, interpret: str | None, device: torch.device, dtype: torch.dtype) -> str:
    choice = choice.lower()
    if choice not in BACKENDS:
        fail(ErrorCode.INVALID_ARGUMENT, f"CUFLASH_BACKEND={choice!r}; accepted: {', '.join(BACKENDS)}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "cpu"
    if choice == "triton":
        if dtype == torch.float64:
            fail(ErrorCode.UNSUPPORTED_DTYPE, "the Triton kernels take float16, bfloat16 and float32, got float64")
        if triton_version() is None:
            fail(ErrorCode.UNSUPPORTED_DEVICE, "the Triton kernels need the `triton` package, which is not installed")
        if device.type == "cuda":
            if interpret == "1":
                fail(ErrorCode.UNSUPPORTED_DEVICE,
                     "TRITON_INTERPRET=1 runs the kernels on CPU tensors only; got tensors on cuda")
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                fail(ErrorCode.UNSUPPORTED_DEVICE,
                     f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; "
                     f"the kernels need 8.0 (Ampere) or newer")
        elif device.type == "cpu" and interpret != "1":
            fail(ErrorCode.UNSUPPORTED_DEVICE,
                 "CUFLASH_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before cuflash is imported")
        elif device.type not in ("cuda", "cpu"):
            fail(ErrorCode.UNSUPPORTED_DEVICE, f"no kernel runs on {device.type} tensors; accepted: cuda, cpu")
    return choice
