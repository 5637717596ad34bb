"""Error codes and the one exception cuflash raises for bad input (validate.py's checks raise it
through fail, naming the argument, what it got and what is accepted)."""
from __future__ import annotations

import enum
from typing import NoReturn


class ErrorCode(enum.IntEnum):
    """Error codes (FlashAttentionError.code). Their numbers are kept as they are: code that
    compares them as ints keeps working."""

    SUCCESS = 0
    INVALID_DIMENSION = 1
    NULL_POINTER = 2
    UNSUPPORTED_HEAD_DIM = 3
    CUDA_ERROR = 4
    OUT_OF_MEMORY = 5
    UNSUPPORTED_DTYPE = 6
    DTYPE_MISMATCH = 7
    DEVICE_MISMATCH = 8
    SHAPE_MISMATCH = 9
    INVALID_ARGUMENT = 10
    NOT_CONTIGUOUS = 11
    EMPTY_TENSOR = 12
    UNSUPPORTED_FEATURE = 13
    UNSUPPORTED_DEVICE = 14


class FlashAttentionError(ValueError, RuntimeError):
    """Raised for any input cuflash cannot compute; ``.code`` is an :class:`ErrorCode`. Both a
    ValueError and a RuntimeError: flash-attn raises RuntimeError from its C++ checks, and code
    written for it catches that."""

    def __init__(self, code: ErrorCode, message: str):
        # args set, not passed to super().__init__: torch.compile traces this (a bad argument in a compiled
        # call), and Dynamo cannot trace the builtin __init__ of ValueError or RuntimeError.
        self.args = (f"[{code.name}] {message}",)
        self.code = code
        self.message = message


def fail(code: ErrorCode, message: str) -> NoReturn:
    raise FlashAttentionError(code, message)
