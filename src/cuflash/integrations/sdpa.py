"""cuflash as a provider of torch's SDPA flash backend (torch 2.10 and later).

    import cuflash                        # registers the provider "cuflash"; activates nothing
    cuflash.activate_sdpa_provider()      # = torch.nn.attention.activate_flash_attention_impl("cuflash")
    ...                                   # F.scaled_dot_product_attention's flash backend runs cuflash
    torch.nn.attention.restore_flash_attention_impl()

Activation also puts the flash backend first in torch's SDPA priority order (restoring gives back the
order it found, unless the order was changed since): torch 2.11 on Hopper otherwise prefers cuDNN for
the calls flash takes, and an unmodified model's F.scaled_dot_product_attention would never reach the
provider. Calls flash cannot take (an attn_mask, say) still go to the next backend in torch's order.

torch's providers (torch.nn.attention.register_flash_attention_impl, as FlashAttention-3 and -4 ship)
override, at the CUDA dispatch key, the aten ops behind SDPA's flash backend. Activated, cuflash serves:

- aten::_scaled_dot_product_flash_attention and its backward: (B, H, N, D) inputs, the op torch's
  F.scaled_dot_product_attention calls (transformers' "sdpa" attention among them) and that torch's
  context_parallel() ring calls on each pair of shards;
- aten::_flash_attention_forward / _flash_attention_backward: (B, N, H, D), or packed (total, H, D)
  with cum_seq_q / cum_seq_k (torch.nn.attention.varlen.varlen_attn); and, where torch has it,
  aten::_flash_attention_forward_no_dropout_inplace (varlen_attn_out).

with the semantics of torch's own kernels (FlashAttention-2): is_causal aligned to the bottom-right
corner of each (seqlen_q, seqlen_k) score matrix (F.scaled_dot_product_attention sends the flash op
square causal calls only, where top-left is the same), window_size_left / window_size_right likewise
(negative: unbounded), GQA where key and value have fewer heads, scale (default 1/sqrt(D)), dropout,
logsumexp (B, H, Nq) fp32 (packed: (H, total_q)), +inf for rows that see no key. cum_seq_q / cum_seq_k of
the SDPA op come back undefined, as torch's do. Dropout draws cuflash's counter-based hash (not torch's
Philox stream): rng_state carries its seed, as two uint64 words, to the backward, which regenerates
the same mask from it, so the forward and its backward must run under the same provider.

seqused_k of a packed call (each sequence's first seqused_k[b] keys; causal and windows align to them)
is FlashAttention-3's, as cuflash's varlen functions take it; the aten backward has no such argument
(torch's varlen_attn calls it inference only), so a backward runs over every key, as torch's does.

Calls cuflash does not take run torch's own kernel, captured when the provider is activated: ALiBi
slopes (the aten backward has no slopes argument), block_table, seqused_k of a dense call,
return_debug_mask=True, and inputs the checks of flash_attn_func refuse (dtypes, head dims over its
maximum, strided last dims, ...), for which torch's kernel gives torch's own error. fp32 inputs, and head
dims from 257, which torch's flash kernel refuses, are computed (exactly, as cuflash computes them
everywhere)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.attention

from .. import ops
from ..backend import backend_name
from ..dropout import draw_seed
from ..errors import ErrorCode, FlashAttentionError, fail
from ..memo import remembered, signature
from ..params import AttentionParams
from ..validate import check_attention_inputs

NAME = "cuflash"

# The aten kernels torch had for CUDA when the provider was last activated: what calls cuflash does
# not take run (None where the build has none, as torch's CPU builds).
TORCH_KERNELS: dict[str, object] = {}
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def available() -> bool:
    """Whether this torch takes SDPA backend providers (torch.nn.attention.register_flash_attention_impl)."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl")


def register() -> bool:
    """Registers the provider under NAME where this torch takes providers (available()); returns
    whether it did. Runs on `import cuflash`: a provider must not activate itself."""
    if not available():
        return False
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_override)
    return True


def activate() -> None:
    """Routes torch's flash attention ops to cuflash (torch.nn.attention.activate_flash_attention_impl);
    torch.nn.attention.restore_flash_attention_impl() gives them back. Raises FlashAttentionError
    on a torch without providers."""
    if not available():
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"torch {torch.__version__} takes no SDPA backend providers "
             "(torch.nn.attention.register_flash_attention_impl, torch 2.10 and later), so cuflash cannot serve "
             "F.scaled_dot_product_attention there; call cuflash.scaled_dot_product_attention instead, or "
             "upgrade torch")
    torch.nn.attention.activate_flash_attention_impl(NAME)


@dataclass
class _Handle:
    """What activation returns to torch's registry, whose remove() (restore_flash_attention_impl)
    takes the overrides out of the dispatcher and gives back SDPA's priority order (where it is still
    the one activation set: an order set since is the user's)."""

    library: torch.library.Library | None
    priority: list[int]
    ours: list[int]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None
            if torch._C._get_sdp_priority_order() == self.ours:
                torch._C._set_sdp_priority_order(self.priority)


def _override() -> _Handle:
    """The provider's register_fn: captures torch's CUDA kernels of the ops, overrides them, and puts
    the flash backend first in SDPA's priority order."""
    library = torch.library.Library("aten", "IMPL", "CUDA")
    with warnings.catch_warnings():  # (the dispatcher warns of every override; these are the point)
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name, impl in IMPLS.items():
            if hasattr(torch.ops.aten, name):  # (torch 2.11 has no _flash_attention_forward_no_dropout_inplace)
                TORCH_KERNELS[name] = _torch_kernel(name)
                library.impl(name, impl, "CUDA")
    _settle_default_priority()
    priority = torch._C._get_sdp_priority_order()
    flash = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
    ours = [flash] + [b for b in priority if b != flash]
    torch._C._set_sdp_priority_order(ours)
    return _Handle(library, priority, ours)


def _settle_default_priority() -> None:
    """Has torch set its default SDPA priority order, which it does on the first CUDA backend choice
    of the process (cuDNN first on Hopper and Blackwell with cuDNN 9.15+), overwriting the order it
    finds: one choice on tiny tensors, so that the order activation sets is not replaced later."""
    if torch.cuda.is_available():
        t = torch.zeros(1, 1, 8, 64, dtype=torch.float16, device="cuda")
        torch._fused_sdp_choice(t, t, t)


def _torch_kernel(name: str):
    try:
        return torch._C._dispatch_get_computed_kernel_for_dispatch_key(f"aten::{name}", torch._C.DispatchKey.CUDA)
    except RuntimeError:  # no CUDA kernel in this build
        return None


def _torch_op(name: str, *args, **kwargs):
    """torch's own kernel of aten::`name` on these arguments."""
    kernel = TORCH_KERNELS.get(name)
    if kernel is None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"cuflash's SDPA provider does not take this call of aten::{name}, "
             "and this torch has no CUDA kernel of its own to run it")
    return kernel.call_boxed(_CUDA_KEYS, *args, **kwargs)  # type: ignore[attr-defined]


def _checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options) -> tuple[bool, dict | None]:
    """(whether cuflash takes q (B, Nq, H, D), k and v (B, Nk, Hk, D): what flash_attn_func's checks
    and its backend accept; the dict in which the backend keeps the launch plans of the call signature
    with `options`, those of the call's options its plans depend on), once per call signature
    (memo.remembered)."""
    def build() -> bool:
        try:
            check_attention_inputs(q, k, v, ("query", "key", "value"), empty=True)
            backend_name(q.device, q.dtype)
        except FlashAttentionError:
            return False
        return True
    return remembered(signature((q, k, v), NAME, *options), build)


def _servable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return _checked(q, k, v)[0]


def _packed_servable(q, k, v, cum_seq_q, cum_seq_k, seqused_k) -> bool:
    """_servable for packed q (total_q, H, D), k and v (total_k, Hk, D) with the int32 prefix sums of
    their sequences and the keys each uses (seqused_k, or None), whose values, as torch's kernel, this
    does not read."""
    return (cum_seq_k is not None and q.ndim == k.ndim == v.ndim == 3 and _servable(q[None], k[None], v[None])
            and all(c.dtype == torch.int32 and c.ndim == 1 and c.device == q.device and c.is_contiguous()
                    for c in (cum_seq_q, cum_seq_k, *(() if seqused_k is None else (seqused_k,))))
            and cum_seq_q.numel() == cum_seq_k.numel() > 0
            and (seqused_k is None or seqused_k.numel() == cum_seq_q.numel() - 1))


def _params(q: torch.Tensor, scale, is_causal: bool, window_left, window_right, dropout_p: float,
            rng_seed: torch.Tensor | None = None, cum_seq_q=None, cum_seq_k=None, max_q: int = 0,
            max_k: int = 0, seqused_k: torch.Tensor | None = None) -> AttentionParams:
    """The aten call as AttentionParams (FlashAttention-2's semantics: the module's doc). rng_seed:
    the forward's seed (the backward's), else a fresh one where dropout_p > 0."""
    if dropout_p > 0 and rng_seed is None:
        rng_seed = draw_seed(q.device)
    left = -1 if window_left is None or window_left < 0 else int(window_left)
    right = 0 if is_causal else -1 if window_right is None or window_right < 0 else int(window_right)
    return AttentionParams(1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale), left, right,
                           dropout_p=float(dropout_p), rng_seed=rng_seed if dropout_p > 0 else None,
                           cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k if cum_seq_q is not None else None,
                           seqused_k=seqused_k,
                           max_seqlen_q=int(max_q) if cum_seq_q is not None else 0,
                           max_seqlen_k=int(max_k) if cum_seq_q is not None else 0,
                           deterministic=torch.are_deterministic_algorithms_enabled())


def _forward(q, k, v, params: AttentionParams, plans: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of cuflash's backend (plans: _checked's). The dispatcher calls the override below
    autograd, which has recorded the aten op already: nothing here records a graph."""
    with torch.no_grad():
        return ops.forward(q, k, v, params, plans)


def _backward(grad_out, q, k, v, out, lse, params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the aten ops have no learnable sink (params.learnable_sink None), so cuflash's
    backward gives no dsink."""
    with torch.no_grad():
        dq, dk, dv = ops.backward(grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous(), q, k, v, out, lse,
                                  params)
    return dq, dk, dv


def _rng_state(q: torch.Tensor, params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's (rng_state, unused): dropout's seed words as torch's (2,) uint64 rng_state (left
    uninitialized without dropout, as torch's kernel leaves it), and torch's empty () uint64."""
    seed = params.rng_seed
    state = torch.empty(2, dtype=torch.uint64, device=q.device) if seed is None else seed.view(torch.uint64)
    return state, torch.empty((), dtype=torch.uint64, device=q.device)


def _seed(dropout_p: float, rng_state: torch.Tensor) -> torch.Tensor | None:
    """The forward's dropout seed from the rng_state it returned (_rng_state)."""
    return rng_state.view(torch.int64) if dropout_p > 0 else None


def _no_debug_mask(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=q.dtype, device=q.device)


def _dropout_ok(dropout_p) -> bool:
    return 0.0 <= dropout_p < 1.0


def _flash_layout(query, key, value) -> tuple:
    """(B, N, H, D) views of the SDPA op's (B, H, N, D) inputs; Nones where they are not 4-D."""
    if not query.ndim == key.ndim == value.ndim == 4:
        return None, None, None
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention: query (B, H, Nq, D), key and value (B, Hk, Nk, D) ->
    (output (B, H, Nq, D), logsumexp (B, H, Nq) fp32, None, None, Nq, Nk, rng_state, unused,
    debug_attn_mask (empty))."""
    q, k, v = _flash_layout(query, key, value)
    servable, plans = (False, None) if q is None else _checked(q, k, v, scale, is_causal)
    if return_debug_mask or not _dropout_ok(dropout_p) or not servable:
        return _torch_op("_scaled_dot_product_flash_attention", query, key, value, dropout_p, is_causal,
                         return_debug_mask, scale=scale)
    params = _params(q, scale, is_causal, None, None, dropout_p)
    out, lse = _forward(q, k, v, params, plans)
    return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], *_rng_state(q, params),
            _no_debug_mask(q))


def sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: (grad_query, grad_key, grad_value) shaped
    like query, key, value, from sdpa_forward's output, logsumexp and rng_state (philox_seed)."""
    q, k, v = _flash_layout(query, key, value)
    if (q is None or not _dropout_ok(dropout_p) or grad_out.shape != query.shape or grad_out.dtype != query.dtype
            or not _servable(q, k, v)):
        return _torch_op("_scaled_dot_product_flash_attention_backward", grad_out, query, key, value, out, logsumexp,
                         cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                         scale=scale)
    params = _params(q, scale, is_causal, None, None, dropout_p, _seed(dropout_p, philox_seed))
    dq, dk, dv = _backward(grad_out.transpose(1, 2), q, k, v, out.transpose(1, 2), logsumexp, params)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_servable(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, seqused_k=None,
                    alibi_slopes=None, block_table=None) -> bool:
    """Whether cuflash takes a call of _flash_attention_forward (or its backward: the options it lacks
    given as None)."""
    if return_debug_mask or not _dropout_ok(dropout_p) or alibi_slopes is not None or block_table is not None:
        return False
    if cum_seq_q is None:
        return cum_seq_k is None and seqused_k is None and query.ndim == 4 and _servable(query, key, value)
    return _packed_servable(query, key, value, cum_seq_q, cum_seq_k, seqused_k)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                  scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):
    """aten::_flash_attention_forward: query (B, Nq, H, D), key and value (B, Nk, Hk, D), or packed
    (total, H, D) with cum_seq_q / cum_seq_k -> (output like query, logsumexp (B, H, Nq) or (H, total_q)
    fp32, rng_state, unused, debug_attn_mask (empty)). num_splits, a split-KV hint, changes nothing
    here."""
    if not _flash_servable(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, seqused_k,
                           alibi_slopes, block_table):
        # (block_table and num_splits only where this torch's schema has them)
        extra = {} if block_table is None and num_splits is None else dict(block_table=block_table,
                                                                           num_splits=num_splits)
        return _torch_op("_flash_attention_forward", query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, return_debug_mask, scale=scale, window_size_left=window_size_left,
                         window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes, **extra)
    params = _params(query, scale, is_causal, window_size_left, window_size_right, dropout_p, None, cum_seq_q,
                     cum_seq_k, max_q, max_k, seqused_k)
    out, lse = _forward(query, key, value, params)
    return (out, lse, *_rng_state(query, params), _no_debug_mask(query))


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """aten::_flash_attention_backward: (grad_query, grad_key, grad_value) like query, key, value."""
    if (not _flash_servable(query, key, value, cum_seq_q, cum_seq_k, dropout_p, False)
            or grad_out.shape != query.shape or grad_out.dtype != query.dtype):
        return _torch_op("_flash_attention_backward", grad_out, query, key, value, out, logsumexp, cum_seq_q,
                         cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, scale=scale,
                         window_size_left=window_size_left, window_size_right=window_size_right)
    params = _params(query, scale, is_causal, window_size_left, window_size_right, dropout_p,
                     _seed(dropout_p, rng_state), cum_seq_q, cum_seq_k, max_q, max_k)
    return _backward(grad_out, query, key, value, out, logsumexp, params)


def flash_forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                       seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward_no_dropout_inplace: flash_forward's output written into `out`
    (shaped like query); returns the logsumexp."""
    if dropout_p != 0 or out.shape != query.shape or out.dtype != query.dtype or not _flash_servable(
            query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, seqused_k, alibi_slopes,
            block_table):
        return _torch_op("_flash_attention_forward_no_dropout_inplace", out, query, key, value, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale,
                         window_size_left=window_size_left, window_size_right=window_size_right,
                         seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table,
                         num_splits=num_splits)
    params = _params(query, scale, is_causal, window_size_left, window_size_right, 0.0, None, cum_seq_q, cum_seq_k,
                     max_q, max_k, seqused_k)
    result, lse = _forward(query, key, value, params)
    out.copy_(result)
    return lse


# The aten ops the provider overrides and their implementations (tests register these for CPU tensors).
IMPLS = {"_scaled_dot_product_flash_attention": sdpa_forward,
          "_scaled_dot_product_flash_attention_backward": sdpa_backward,
          "_flash_attention_forward": flash_forward, "_flash_attention_backward": flash_backward,
          "_flash_attention_forward_no_dropout_inplace": flash_forward_into}
