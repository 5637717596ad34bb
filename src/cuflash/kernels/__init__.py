"""Triton kernels. Import only where Triton is installed."""
from .backward import attention_backward
from .decode import decode_forward
from .forward import attention_forward

__all__ = ["attention_forward", "attention_backward", "decode_forward"]
