"""The three attention methods side by side, for comparison and teaching (`cuflash run`,
`cuflash experiment`, the bench's providers naive and fa1):

  naive  materializes the (seqlen_q x seqlen_k) scores and probabilities, forward and backward;
  fa1    FlashAttention-1's loop order: the outer loop runs over K/V tiles, the inner one over
         query tiles, and the output, row max and row sum live in memory, rescaled at each K/V tile;
  fa2    cuflash itself (FlashAttention-2: the outer loop over query tiles keeps them in registers).

Each takes q, k, v in flash layout (batch, seqlen, nheads, headdim), the same number of heads for
q and k, causal aligned to the bottom-right corner, and returns out and softmax_lse (batch, nheads,
seqlen_q) in fp32, then dq, dk, dv from backward. CUDA tensors run Triton kernels (fa1_triton.py,
naive_triton.py beside the PyTorch fa1.py, naive.py), CPU tensors PyTorch loops of the same structure.
"""
from __future__ import annotations

import torch

from .. import ops
from ..backend import backend_name
from ..errors import ErrorCode, fail
from ..params import AttentionParams
from ..validate import check_attention_inputs, check_blocks, resolve_scale

METHODS = ("naive", "fa1", "fa2")


def _implementation(method: str, device: torch.device):
    if method not in METHODS:
        fail(ErrorCode.INVALID_ARGUMENT, f"method {method!r} is unknown; choose from {', '.join(METHODS)}")
    if method == "fa2":
        return None
    if backend_name(device, torch.float32) == "triton":
        from . import fa1_triton, naive_triton
        return {"naive": naive_triton, "fa1": fa1_triton}[method]
    from . import fa1, naive
    return {"naive": naive, "fa1": fa1}[method]


def _check(method, q, k, v, block_m, block_n) -> tuple[int, int]:
    """Checks the inputs; returns the blocks asked for (fa2 only: (0, 0) for the tuned ones)."""
    check_attention_inputs(q, k, v, value_dim=False)
    if method != "fa2" and q.shape[2] != k.shape[2]:
        fail(ErrorCode.SHAPE_MISMATCH, f"the {method} method takes as many heads in k as in q "
             f"(got {q.shape[2]} and {k.shape[2]}); fa2 handles MQA/GQA")
    if method != "fa2" and (block_m is not None or block_n is not None):
        fail(ErrorCode.INVALID_ARGUMENT, f"block_m and block_n choose fa2's tiles; the {method} method has its own")
    return check_blocks(block_m, block_n)


def _params(scale: float, causal: bool, blocks: tuple[int, int]) -> AttentionParams:
    return AttentionParams(scale, window_right=0 if causal else -1, block_m=blocks[0], block_n=blocks[1])


def forward(method: str, q, k, v, causal: bool = False, softmax_scale=None, block_m=None, block_n=None):
    """(out, softmax_lse) by `method`, without autograd; fa2 takes block sizes as cuflash.forward."""
    blocks = _check(method, q, k, v, block_m, block_n)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    impl = _implementation(method, q.device)
    with torch.no_grad():
        if impl is None:
            return ops.forward(q, k, v, _params(scale, causal, blocks))
        return impl.attention_forward(q, k, v, scale, causal)


def backward(method: str, dout, q, k, v, out, lse, causal: bool = False, softmax_scale=None, block_m=None,
             block_n=None):
    """(dq, dk, dv) by `method`, from the forward's out and softmax_lse."""
    blocks = _check(method, q, k, v, block_m, block_n)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    impl = _implementation(method, q.device)
    with torch.no_grad():
        if impl is None:
            return ops.backward(dout, q, k, v, out, lse, _params(scale, causal, blocks))
        return impl.attention_backward(dout, q, k, v, out, lse, scale, causal)


class _Attention(torch.autograd.Function):
    """Autograd for any of the methods (the benchmark times them forward and backward)."""

    @staticmethod
    def forward(ctx, method, q, k, v, causal, softmax_scale):
        out, lse = forward(method, q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.method, ctx.causal, ctx.softmax_scale = method, causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(ctx.method, dout.contiguous(), q, k, v, out, lse, ctx.causal, ctx.softmax_scale)
        return None, dq, dk, dv, None, None


def attention(method: str, q, k, v, causal: bool = False, softmax_scale=None):
    """Differentiable out (batch, seqlen_q, nheads, headdim) by `method`."""
    return _Attention.apply(method, q, k, v, causal, softmax_scale)
