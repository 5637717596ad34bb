"""The custom ops (forward, backward, decode), their fake implementations for torch.compile, the
autograd registration, and the dispatch of each call to the backend module that backend.py names.

forward() and backward() go through the custom ops wherever PyTorch needs to see them (under
torch.compile, a dispatch mode such as FakeTensorMode, torch.func transforms, tensor subclasses,
meta tensors). On plain tensors in eager mode they call the backend directly, with autograd
through a plain autograd.Function where a graph is built (none without grad): the custom op's
dispatch costs the host as long as a short sequence's whole forward kernel takes, the Function a
fraction of it (docs/tuning.md).

A call's mods (score_mod, mask_mod, a block mask: AttentionParams.mods) reach the custom ops packed
(mods.Packed: a string naming the traced graphs, and lists of the tensors and numbers they capture),
which torch.compile can put in a graph (mods/compiled.py); the forward op's autograd gives those of
the score_mod's tensors that require grad their gradients, which the backward op returns.

Backends (backend.py chooses): the Triton kernels (kernels/) and the blocked PyTorch implementation
in cpu.py.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .backend import backend_name
from .cache import append_to_cache
from .dtypes import lse_dtype
from .errors import ErrorCode, fail
from .mods import Packed
from .params import OP_FIELD_NAMES, AttentionParams, empty_out
from .sinks import empty_lse, sink_grad


def _backend(device: torch.device, dtype: torch.dtype):
    if backend_name(device, dtype) == "triton":
        from . import kernels
        return kernels
    from . import cpu
    return cpu


_BACKEND = "backend"  # _call_backend's key in a signature's plans (the launch plans' keys are tuples)


def _call_backend(q: torch.Tensor, plans: dict | None):
    """_backend for q's device and dtype, kept in `plans` (the dict of a public function's call
    signature, memo.remembered, which fixes both and the backend settings) after the first call:
    each lookup reads two environment variables (docs/tuning.md)."""
    if plans is None:
        return _backend(q.device, q.dtype)
    backend = plans.get(_BACKEND)
    if backend is None:
        backend = plans[_BACKEND] = _backend(q.device, q.dtype)
    return backend


def _backward_backend(q: torch.Tensor, params: AttentionParams, forward_backend=None):
    """The backend of a backward (the forward's, where given), which no paged (block_table) call has
    (flash-attn has none either)."""
    if params.block_table is not None:
        fail(ErrorCode.UNSUPPORTED_FEATURE, "no backward through paged K/V (block_table): flash_attn_varlen_func "
             "with block_table is forward only; pass contiguous k and v (total_k, nheads_k, headdim) to train")
    return forward_backend or _backend(q.device, q.dtype)


@torch.library.custom_op("cuflash::fwd", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      window_left: int, window_right: int, bottom_right: bool, softcap: float,
                      alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                      attn_mask: Optional[torch.Tensor], dropout_p: float, rng_seed: Optional[torch.Tensor],
                      cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                      seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                      max_seqlen_k: int, deterministic: bool, block_table: Optional[torch.Tensor], block_m: int,
                      block_n: int, mods: Optional[str], mod_tensors: list[torch.Tensor],
                      mod_scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, H, D), k (B, Nk, Hk, D) and v (B, Nk, Hk, Dv) (varlen: (total, H, D)) -> out shaped
    like q with v's head dim Dv and softmax_lse (B, H, Nq) (varlen: (H, total_q)), fp32. The other
    arguments are the fields of AttentionParams, in order, then its mods packed (mods.Packed: None, [],
    [] without); forward() and backward() below take the dataclass."""
    params = _op_params((softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, learnable_sink,
                         attn_mask, dropout_p, rng_seed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, deterministic, block_table, block_m, block_n, mods,
                         mod_tensors, mod_scalars))
    if params.mods is not None:  # (checked here, at run time: the sizes are symbolic where the graph is traced)
        params.mods.check(*_sizes(q, k, params))
    return _backend(q.device, q.dtype).attention_forward(q, k, v, params)


@attention_forward.register_fake
def _(q, k, v, *args):
    return (empty_out(q, v),
            q.new_empty(AttentionParams(*args[:len(OP_FIELD_NAMES)]).lse_shape(q), dtype=lse_dtype(q.dtype)))


@torch.library.custom_op("cuflash::bwd", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, softmax_lse: torch.Tensor, softmax_lse_grad: Optional[torch.Tensor],
                       softmax_scale: float,
                       window_left: int, window_right: int, bottom_right: bool, softcap: float,
                       alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                       attn_mask: Optional[torch.Tensor], dropout_p: float, rng_seed: Optional[torch.Tensor],
                       cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                       seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                       max_seqlen_k: int, deterministic: bool, block_table: Optional[torch.Tensor], block_m: int,
                       block_n: int, mods: Optional[str], mod_tensors: list[torch.Tensor], mod_scalars: list[float]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Gradients (dq, dk, dv) of attention_forward, shaped like q, k, v, from those of out (dout) and of
    softmax_lse (softmax_lse_grad, or None), then [that of learnable_sink] ([] without a sink), and those
    of the score_mod's captured tensors that need one (Mods.grad_tensors()), each shaped and typed like
    its tensor."""
    params = _op_params((softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, learnable_sink,
                         attn_mask, dropout_p, rng_seed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, deterministic, block_table, block_m, block_n, mods,
                         mod_tensors, mod_scalars))
    dq, dk, dv, dsink, captured = _gradients(_backward_backend(q, params), dout, q, k, v, out, softmax_lse, params,
                                             softmax_lse_grad)
    return dq, dk, dv, [] if dsink is None else [dsink], captured


@attention_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, softmax_lse_grad, *args):
    params = _op_params(args)
    captured = () if params.mods is None else params.mods.grad_tensors()
    sink = () if params.learnable_sink is None else (params.learnable_sink,)
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            *([torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts] for ts in (sink, captured)))


def _op_params(args: tuple) -> AttentionParams:
    """The AttentionParams of the custom ops' trailing arguments (op_args)."""
    *fields, layout, tensors, scalars = args
    params = AttentionParams(*fields)
    return params if layout is None else dataclasses.replace(params, mods=Packed(layout, tensors, scalars).unpack())


def op_args(params: AttentionParams) -> tuple:
    """The custom ops' arguments after q, k, v (the backward's: after softmax_lse_grad) of params: its
    fields but mods (as_args), then its mods packed (Mods.pack). Public: tests and scripts call the ops."""
    return (*params.as_args(), *(_NO_MODS if params.mods is None else params.mods.pack()))


_NO_MODS: tuple = (None, [], [])  # (the ops' mods arguments of a call without any)


def _sizes(q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> tuple[int, int, int, int]:
    """(batch, nheads, seqlen_q, seqlen_k) that a call's mods see (varlen: the longest sequences)."""
    if params.varlen:
        assert params.cu_seqlens_q is not None
        return params.cu_seqlens_q.numel() - 1, q.shape[1], params.max_seqlen_q, params.max_seqlen_k
    return q.shape[0], q.shape[2], q.shape[1], k.shape[1]


def _gradients(backend, dout, q, k, v, out, lse, params: AttentionParams, dlse, plans: dict | None = None) -> tuple:
    """(dq, dk, dv, the learnable sink's gradient (None without one), [the gradients of the captured
    tensors that ask for one, params.mods.grad_tensors(), each in its tensor's dtype]) from the backend's
    backward: it adds those into fp32 buffers (fp64 for fp64 tensors), and returns the sink's after dv."""
    captured = () if params.mods is None else params.mods.grad_tensors()
    if captured:
        assert params.mods is not None
        buffers = tuple(torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
                        for t in captured)
        params = dataclasses.replace(params, mods=dataclasses.replace(params.mods, grads=buffers))
    dq, dk, dv, *dsink = backend.attention_backward(dout, q, k, v, out, lse, params, plans=plans, dlse=dlse)
    return dq, dk, dv, dsink[0] if dsink else None, [b.to(t.dtype) for b, t in zip(buffers, captured)] if captured \
        else []


@torch.library.custom_op("cuflash::decode", mutates_args=())
def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: Optional[torch.Tensor], cache_seqlen: int, seqlen_new: int,
                     cache_leftpad: Optional[torch.Tensor], cache_rows: Optional[torch.Tensor],
                     block_table: Optional[torch.Tensor], num_splits: int, softmax_scale: float, window_left: int,
                     window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                     learnable_sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, H, D) to each sequence's keys in a KV cache (kvcache.py appended the
    new ones): keys cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 (cache_seqlens None: the
    int cache_seqlen for every sequence) of cache row cache_rows[b] (default b) or of the pages
    block_table[b]. Returns out (B, Sq, H, Dv) (v_cache's head dim) and softmax_lse (B, H, Sq) fp32."""
    params = AttentionParams(softmax_scale, window_left, window_right, softcap=softcap, alibi_slopes=alibi_slopes,
                             learnable_sink=learnable_sink)
    seqlens = cache_seqlen if cache_seqlens is None else cache_seqlens
    return _backend(q.device, q.dtype).decode_forward(q, k_cache, v_cache, seqlens, seqlen_new, cache_leftpad,
                                                      cache_rows, block_table, params, num_splits)


@attention_decode.register_fake
def _(q, k_cache, v_cache, *args):
    return (empty_out(q, v_cache),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


def bypasses_custom_op(q: torch.Tensor) -> bool:
    """Whether forward(), backward() and decode() on q call the backend directly instead of going
    through the custom ops (the module's doc): in eager mode on plain CPU/CUDA tensors, under no
    dispatch mode and no torch.func transform. Public: tests check which way a call takes."""
    return (type(q) is torch.Tensor and q.device.type in ("cuda", "cpu") and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0 and not torch._C._are_functorch_transforms_active())


def _records_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams) -> bool:
    """Whether autograd records this call (grad mode on and an input requiring grad: q, k, v, the
    learnable sink or a tensor that the score_mod captures)."""
    sink = params.learnable_sink
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sink is not None and sink.requires_grad)
                                        or (params.mods is not None and bool(params.mods.grad_tensors())))


def _no_functorch_mods(params: AttentionParams) -> None:
    """Refuses mods under torch.func transforms: the custom ops have no functorch rule (torch's
    autograd.Function under them needs one; calls without mods fail there with torch's own error)."""
    if params.mods is not None and torch._C._are_functorch_transforms_active():
        fail(ErrorCode.UNSUPPORTED_FEATURE, "score_mod, mask_mod and block_mask are not supported under torch.func "
             "transforms (grad, vmap, ...): cuflash's custom ops have no functorch rules; call eagerly or under "
             "torch.compile and take gradients with torch.autograd")


def _output_grad(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The gradient of out as the kernels take it: zeros where only softmax_lse has one (autograd gives
    None); gradients can arrive with any strides (a broadcast from .sum() has stride 0 everywhere), and
    the kernels need a contiguous last dim."""
    if dout is None:
        return torch.zeros_like(out)
    return dout if dout.stride(-1) == 1 else dout.contiguous()


def _save(ctx, q, k, v, out, lse, params: AttentionParams, plans: dict | None = None, more: tuple = ()) -> None:
    """What both autograd paths keep for the backward: the tensors (the option tensors among them, and
    `more`: the custom op's mod tensors) through save_for_backward, the params without them, and the
    forward's launch plans (forward())."""
    tensors = params.tensors()
    ctx.save_for_backward(q, k, v, out, lse, *tensors, *more)
    ctx.params = params.with_tensors((None,) * len(tensors)) if params.holds_tensors else params
    ctx.plans = plans
    ctx.more = len(more)
    ctx.set_materialize_grads(False)  # no zero tensor made for lse's gradient on every backward


def _restore(ctx) -> tuple:
    """(q, k, v, out, lse, params, more) as _save kept them."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    more = tuple(tensors[len(tensors) - ctx.more:])
    tensors = tensors[:len(tensors) - ctx.more]
    params = ctx.params.with_tensors(tuple(tensors)) if any(t is not None for t in tensors) else ctx.params
    return q, k, v, out, lse, params, more


class _Attention(torch.autograd.Function):
    """The eager path's autograd: the same kernels as the custom ops, called directly."""

    # forward takes ctx (no separate setup_context): apply() would otherwise bind the arguments
    # through inspect.signature on every call.
    # sink: params.learnable_sink (or None), and captured: the tensors the score_mod captures that ask for a
    # gradient (params.mods.grad_tensors()), inputs here so that autograd gives them theirs.
    @staticmethod
    def forward(ctx, q, k, v, params: AttentionParams, plans: dict | None, sink, *captured):
        backend = _call_backend(q, plans)
        out, lse = backend.attention_forward(q, k, v, params, plans=plans)
        _save(ctx, q, k, v, out, lse, params, plans)
        ctx.backend = backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, params, _ = _restore(ctx)
        if dout is None and dlse is None:
            return (None,) * (6 + len(() if params.mods is None else params.mods.grad_tensors()))
        backend = _backward_backend(q, params, ctx.backend)
        recorded = torch.is_grad_enabled()
        with torch.no_grad():
            dq, dk, dv, dsink, captured = _gradients(backend, _output_grad(dout, out), q, k, v, out, lse, params,
                                                     dlse, ctx.plans)
        grads = (dq, dk, dv, *(() if dsink is None else (dsink,)), *captured)
        if recorded:
            # create_graph=True: the gradients get a node that raises if they are differentiated again
            # (the kernels' gradients have no gradient), rather than counting as constants.
            error = torch._C._functions.DelayedError(b"cuflash: attention has no double backward", len(grads))
            grads = error(*(g.detach().requires_grad_() for g in grads))
        if dsink is None:
            grads = (*grads[:3], None, *grads[3:])
        return (*grads[:3], None, None, *grads[3:])


class _Empty(torch.autograd.Function):
    """Attention with no query or no key (a dim of size 0): out 0 (v's head dim) and softmax_lse +inf,
    gradients 0, as flash-attn gives for seqlen_k = 0 and torch SDPA for every empty input; nothing is
    launched. With a learnable sink (`sink`, params.learnable_sink), softmax_lse is the sink's logit (+inf
    on the rows past seqused_q), whose gradient is then lse's summed over the rows (as FlashAttention-4)."""

    @staticmethod
    def forward(ctx, q, k, v, params: AttentionParams, sink):
        shape = params.lse_shape(q)
        if sink is None:
            lse = q.new_full(shape, float("inf"), dtype=lse_dtype(q.dtype))
            ctx.mark_non_differentiable(lse)
        else:
            lse = empty_lse(sink, shape, lse_dtype(q.dtype))
            if params.seqused_q is not None:  # (rows past seqused_q are no rows of the softmax: +inf)
                lse = lse.masked_fill(_past_seqused_q(params, q.shape[0]), float("inf"))
        ctx.save_for_backward(q, k, v, sink, lse)
        return empty_out(q, v).zero_(), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, lse = ctx.saved_tensors
        dsink = None
        if sink is not None:  # (the rows' delta is -dlse: out is 0)
            dsink = sink_grad(sink, lse, -dlse) if dlse is not None else torch.zeros_like(sink)
        return (*(torch.zeros_like(t) for t in (q, k, v)), None, dsink)


def _past_seqused_q(p: AttentionParams, total_q: int) -> torch.Tensor:
    """(total_q,) bool: the query rows of a varlen batch past their sequence's seqused_q (on the device)."""
    assert p.cu_seqlens_q is not None and p.seqused_q is not None
    rows = torch.arange(total_q, dtype=p.cu_seqlens_q.dtype, device=p.cu_seqlens_q.device)
    seq = torch.searchsorted(p.cu_seqlens_q[1:], rows, right=True)  # (each row's sequence)
    return rows - p.cu_seqlens_q[seq] >= p.seqused_q[seq]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, plans: dict | None = None):
    """(out, softmax_lse), differentiable in q, k, v. plans: a dict that the public functions keep per
    checked call signature (memo.py) whose params have no tensor fields, where the backend keeps this
    call's launch plans for the next call of the signature (kernels/attention.py); None elsewhere."""
    if q.numel() == 0 or k.numel() == 0:
        return _Empty.apply(q, k, v, params, params.learnable_sink)
    if bypasses_custom_op(q):
        if _records_graph(q, k, v, params):
            captured = () if params.mods is None else params.mods.grad_tensors()
            return _Attention.apply(q, k, v, params, plans, params.learnable_sink, *captured)
        return _call_backend(q, plans).attention_forward(q, k, v, params, plans=plans)  # no graph to record
    _no_functorch_mods(params)
    return attention_forward(q, k, v, *op_args(params))


def forward_kept(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: AttentionParams,
                 plans: dict | None) -> torch.Tensor | None:
    """forward()'s output for query, key, value in torch SDPA's layout (B, H, N, D) where no graph is
    recorded and an earlier call of their signature kept its launch plan (the Triton backend's
    attention_forward_kept), else None: the caller then goes through forward() on (B, N, H, D) views."""
    if plans is None or not bypasses_custom_op(query) or _records_graph(query, key, value, params):
        return None
    backend = _call_backend(query, plans)
    # The CPU backend keeps no launch plans (it has no attention_forward_kept).
    kept_forward = getattr(backend, "attention_forward_kept", None)
    return None if kept_forward is None else kept_forward(query, key, value, params, plans)


def backward(dout, q, k, v, out, softmax_lse, params: AttentionParams):
    """(dq, dk, dv), and with a learnable sink (dq, dk, dv, dsink) (as FlashAttention-4's backward)."""
    if q.numel() == 0 or k.numel() == 0:  # (_Empty's)
        sink = params.learnable_sink
        return tuple(torch.zeros_like(t) for t in (q, k, v, *(() if sink is None else (sink,))))
    if bypasses_custom_op(q):
        return _backward_backend(q, params).attention_backward(dout, q, k, v, out, softmax_lse, params)
    _no_functorch_mods(params)
    dq, dk, dv, dsink, _ = attention_backward(dout, q, k, v, out, softmax_lse, None, *op_args(params))
    return dq, dk, dv, *dsink


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | int,
           seqlen_new: int, cache_leftpad: torch.Tensor | None, cache_rows: torch.Tensor | None,
           block_table: torch.Tensor | None, params: AttentionParams, num_splits: int,
           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, plans: dict | None = None,
           rotary_end: int | None = None):
    """(out, softmax_lse) of a decode step (attention_decode; cache_seqlens an int or (B,) int32),
    no autograd, after k_new, v_new (B, seqlen_new, Hk, D) are written into the cache in place: by
    the backend's decode when called directly, else (a traced graph) by torch ops before the op,
    which itself then mutates nothing. plans: as forward()'s; rotary_end: as kernels.decode_forward's."""
    if bypasses_custom_op(q):
        return _call_backend(q, plans).decode_forward(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_leftpad,
                                                      cache_rows, block_table, params, num_splits, k_new, v_new,
                                                      plans=plans, rotary_end=rotary_end)
    if k_new is not None:
        append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_rows, block_table)
    given = isinstance(cache_seqlens, torch.Tensor)
    return attention_decode(q, k_cache, v_cache, cache_seqlens if given else None, 0 if given else cache_seqlens,
                            seqlen_new, cache_leftpad, cache_rows, block_table, num_splits, params.softmax_scale,
                            params.window_left, params.window_right, params.softcap, params.alibi_slopes,
                            params.learnable_sink)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    *fields, layout, mod_tensors, scalars = args
    _save(ctx, q, k, v, *output, AttentionParams(*fields), more=tuple(mod_tensors))
    ctx.packed = (layout, scalars)  # (the mods but their tensors, which _save keeps)


def _backward(ctx, dout, dlse):
    fields = len(OP_FIELD_NAMES)
    if dout is None and dlse is None:  # (as _Attention.backward)
        return (None,) * (3 + fields) + (None, [None] * ctx.more, _scalars_grad(ctx.packed[1]))
    q, k, v, out, lse, params, mod_tensors = _restore(ctx)
    layout, scalars = ctx.packed
    mods = None if layout is None else Packed(layout, list(mod_tensors), scalars)
    dq, dk, dv, dsink, captured = attention_backward(_output_grad(dout, out), q, k, v, out, lse, dlse,
                                                     *params.as_args(), *(mods or _NO_MODS))
    field_grads = [None] * fields
    if dsink:  # (the learnable sink's, at its field)
        field_grads[_SINK_FIELD] = dsink[0]
    # (the mods' tensors get theirs: the score_mod's that ask for one)
    mod_grads = [] if mods is None else mods.input_grads(captured)
    return (dq, dk, dv, *field_grads, None, mod_grads, _scalars_grad(scalars))


_SINK_FIELD = OP_FIELD_NAMES.index("learnable_sink")


def _scalars_grad(scalars: list) -> list | None:
    """The gradient of the forward op's mod_scalars: torch's autograd wrapper takes a list of numbers
    for a leaf (gradient None) but an empty list for a list of tensors (gradient [])."""
    return None if scalars else []


attention_forward.register_autograd(_backward, setup_context=_setup_context)
