"""The Triton backend: kernels/triton/ (every input, every GPU, the interpreter), kernels/gluon/
(Hopper), chosen per call by kernels/plan.py. Import only where Triton is installed."""
from .attention import attention_backward, attention_forward, attention_forward_kept, decode_forward

__all__ = ["attention_forward", "attention_forward_kept", "attention_backward", "decode_forward"]
