"""The Triton backend's forward, backward and decode: allocate the outputs, ask kernels/plan.py which
kernels run, and launch them through kernels/launch.py (whose per-signature cache makes the plan
and the launch arguments once per shape). The kernels take softcap and ALiBi as score_mods
(builtin_mods.resolved, after a kept plan is looked for: its key holds the options as given)."""
from __future__ import annotations

import dataclasses
import os

import torch

from ..builtin_mods import resolved
from ..cache import DecodeStep
from ..params import AttentionParams, empty_out
from ..sinks import sink_grad
from .compat import gluon_kernels
from .device import tf32
from .launch import keep, kept, launch, open_key, workspace
from .plan import Entry, select, select_decode, user_tiles_checked
from .triton import SplitOperands, Tiles
from .triton import backward as triton_backward
from .triton import decode as triton_decode
from .triton import exact as triton_exact
from .triton import forward as triton_forward
from .variant import problem, variant_tensors

gluon_forward = gluon_kernels("forward")  # None where Triton has not its Gluon dialect
gluon_backward = gluon_kernels("backward")
LAUNCH_BLOCKING = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"  # a deferred step's own errors are raised at once


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams,
                      entry: Entry | None = None, plans: dict | None = None):
    """q (B, Nq, H, D), k (B, Nk, Hk, D) and v (B, Nk, Hk, Dv), any strides with a contiguous last dim
    (varlen: (total, H, D); paged varlen: k and v (num_blocks, page_block_size, Hk, D)). Returns out
    shaped like q with v's head dim Dv, and softmax_lse (B, H, Nq) (varlen: (H, total_q)) fp32. entry:
    candidates instead of the table's (kernels/plan.py), for tuning and tests. plans (ops.forward): the
    launch plans of one call signature of a public function, which fixes q, k and v's shapes, strides,
    dtypes and devices and params: a later call finds its plan there by what the signature leaves open
    (launch.open_key)."""
    if params.seqused_q is None:
        out = empty_out(q, v)
        lse = torch.empty(params.lse_shape(q), dtype=torch.float32, device=q.device)
    else:  # the rows past seqused_q, which no program writes: out 0, lse +inf (as rows that see no key)
        out = empty_out(q, v).zero_()
        lse = torch.full(params.lse_shape(q), float("inf"), dtype=torch.float32, device=q.device)
    key = _open_key(plans, params, entry, "forward", (q, k, v))
    plan = kept(plans, key)
    if plan is not None:
        plan(dict(Q=q, K=k, V=v, Out=out, Lse=lse))
        return out, lse
    params = resolved(params, q.shape[1], k.shape[1])
    tensors = dict(Q=q, K=k, V=v, Out=out, Lse=lse, **variant_tensors(params))
    if params.block_table is not None:
        tensors["BlockTable"] = params.block_table
    with user_tiles_checked(params, q.shape[-1], q.dtype):
        plan = launch((attention_forward, params.key(), entry, tf32(q)), tensors,
                      lambda: forward_launches(tensors, params, entry))
    keep(plans, key, plan)
    return out, lse


def attention_forward_kept(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams,
                           plans: dict | None) -> torch.Tensor | None:
    """attention_forward's output for q, k, v in torch SDPA's layout (B, H, N, D), through the plan
    an earlier call of their signature kept in `plans` (made on their (B, N, H, D) views), or None
    where none is kept. A kept plan takes nothing of its tensors but their addresses (launch.py),
    which the views share with q, k, v, and writes the output in (B, N, H, D) order: here into a
    buffer made as its (B, H, N, D) view. The views and the output's transpose, each costing host
    time (docs/tuning.md), are not made."""
    plan = kept(plans, _open_key(plans, params, None, "forward", (q, k, v)))
    if plan is None:
        return None
    batch, heads, seqlen, dim = *q.shape[:3], v.shape[3]
    out = torch.empty_strided((batch, heads, seqlen, dim), (seqlen * heads * dim, dim, heads * dim, 1),
                              dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=q.device)
    plan(dict(Q=q, K=k, V=v, Out=out, Lse=lse))
    return out


def _open_key(plans: dict | None, params: AttentionParams, entry: Entry | None, pass_: str,
              inputs: tuple[torch.Tensor, ...], *extra) -> tuple | None:
    """launch.open_key, with `extra` in a backward dO's strides and dtype (autograd passes any); None
    with candidates (entry), tensor fields in params or mods (their tensors would be launch arguments
    that no key holds)."""
    if entry is not None or params.holds_tensors or params.mods is not None:
        return None
    return open_key(plans, pass_, inputs, *extra)


def forward_launches(t: dict, params: AttentionParams, entry: Entry | None) -> list[tuple]:
    """[(kernel, grid, keyword arguments)] of the forward on the tensors `t` (Q, K, V, Out, Lse and the
    variant's), with the candidate select() takes (split operands: their split kernels first)."""
    prob = problem(t["Q"], t["K"], t["V"], params)
    cfg = select(prob, params, entry).forward
    if isinstance(cfg, Tiles):
        return [triton_forward.launch_args(t, prob, params, cfg)]
    if isinstance(cfg, SplitOperands):
        return triton_exact.launches(t, prob, params, cfg)
    return [gluon_forward.launch_args(t, prob, params, cfg)]


def attention_backward(dout, q, k, v, out, lse, params: AttentionParams, entry: Entry | None = None,
                       plans: dict | None = None, dlse: torch.Tensor | None = None):
    """Gradients of attention_forward: dq, dk, dv shaped like q, k, v, and with a learnable sink its
    gradient (dq, dk, dv, dsink). dout and out are shaped like the output (q's shape with v's head dim),
    lse like the forward's softmax_lse, and so dlse, the gradient of lse where it has one. plans:
    attention_forward's, whose out and lse these are. The kernels run as without the sink (the lse
    counts it; cuflash/sinks.py), its gradient is reduced from their delta."""
    sink = params.learnable_sink
    if sink is not None:
        params = dataclasses.replace(params, learnable_sink=None)
    # The rows past seqused_q / seqused_k, which no program writes, get gradient 0.
    dq_like = torch.empty_like if params.seqused_q is None else torch.zeros_like
    dkv_like = torch.empty_like if params.seqused_k is None else torch.zeros_like
    tensors = dict(Q=q, K=k, V=v, Out=out, DO=dout, Lse=lse.contiguous(),
                   DQ=dq_like(q, memory_format=torch.contiguous_format),
                   DK=dkv_like(k, memory_format=torch.contiguous_format),
                   DV=dkv_like(v, memory_format=torch.contiguous_format))
    if dlse is not None:
        tensors["DLse"] = dlse.to(torch.float32).contiguous()
    key = _open_key(plans, params, entry, "backward", (q, k, v, dout), dout.stride(), dout.dtype, dlse is not None)
    plan = kept(plans, key)
    if plan is not None:
        plan(tensors)
    else:
        params = resolved(params, q.shape[1], k.shape[1])
        tensors.update(variant_tensors(params))
        with user_tiles_checked(params, q.shape[-1], q.dtype):
            plan = launch((attention_backward, params.key(), entry, tf32(q)), tensors,
                          lambda: _backward(tensors, params, entry))
        keep(plans, key, plan)
    if sink is None:
        return tensors["DQ"], tensors["DK"], tensors["DV"]
    return tensors["DQ"], tensors["DK"], tensors["DV"], sink_grad(sink, tensors["Lse"], _delta(tensors, params))


def _delta(t: dict, params: AttentionParams) -> torch.Tensor:
    """The backward's delta, rowsum(dO * O) - dlse, shaped like softmax_lse: the delta kernel's, or
    where one launch computed it in its dK/dV kernel (no dlse there), from O and dO (fp32)."""
    if "Delta" in t:
        return t["Delta"]
    delta = (t["Out"].float() * t["DO"].float()).sum(-1)  # (B, Nq, H), varlen (total_q, H)
    return delta.T if params.varlen else delta.transpose(1, 2)


def _backward(t: dict, params: AttentionParams, entry: Entry | None) -> list[tuple]:
    """delta (rowsum(dO * O)), then dK/dV, then dQ (or, fused into dK/dV, its fp32 sum's cast; or on
    split operands, their split first); or all three in the Triton dK/dV kernel where one key tile holds
    every key. Workspaces added to t are made anew on every call (kernels/launch.py's workspace())."""
    prob = problem(t["Q"], t["K"], t["V"], params, t["DO"])
    plan = select(prob, params, entry, one_launch="DLse" not in t)
    dkdv = plan.dkdv
    assert dkdv is not None  # (select plans the backward's passes when the problem has dO)
    if isinstance(dkdv, Tiles) and plan.dq is None:
        return [triton_backward.dkdv_launch(t, prob, params, dkdv, dq_here=True)]
    t["Delta"] = workspace(t["Lse"].shape, torch.float32, t["Lse"].device, zeroed=False)
    if isinstance(dkdv, SplitOperands):
        assert isinstance(plan.dq, SplitOperands)  # (select plans the two together)
        return [triton_backward.delta_launch(t, prob, params, acc_init=False),
                *triton_exact.backward_launches(t, prob, params, dkdv, plan.dq)]
    launches = [triton_backward.delta_launch(t, prob, params, acc_init=not isinstance(dkdv, Tiles))]
    if isinstance(dkdv, Tiles):
        launches.append(triton_backward.dkdv_launch(t, prob, params, dkdv))
    else:
        if plan.dq is None:
            t["DQAcc"] = workspace(t["Q"].shape, torch.float32, t["Q"].device)
        launches.append(gluon_backward.dkdv_launch(t, prob, params, dkdv))
    if plan.dq is None:
        launches.append(triton_backward.cast_launch(t, prob))
    elif isinstance(plan.dq, Tiles):
        launches.append(triton_backward.dq_launch(t, prob, params, plan.dq))
    else:
        launches.append(gluon_backward.dq_launch(t, prob, params, plan.dq))
    return launches


def decode_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | int,
                   seqlen_new: int, leftpad: torch.Tensor | None, cache_rows: torch.Tensor | None,
                   block_table: torch.Tensor | None, params: AttentionParams, num_splits: int = 0,
                   k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, tiles: Tiles | None = None,
                   plans: dict | None = None, rotary_end: int | None = None):
    """q (B, Sq, H, D) attending to the keys leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 of
    sequence b of the cache (cache_seqlens an int: the same for every sequence; leftpad None: 0):
    k_cache (rows, rows_per_seq, Hk, D) and v_cache (rows, rows_per_seq, Hk, Dv), any strides but the
    last dim's, sequence b in row cache_rows[b] (default b), or pages of rows_per_seq keys listed by
    block_table (B, pages). k_new (B, seqlen_new, Hk, D), v_new (B, seqlen_new, Hk, Dv): written into
    the cache at positions cache_seqlens[b] .. by the decode kernel before it reads them (else the
    cache holds them already). tiles: the decode kernel's instead of the table's (tuning). plans: as
    attention_forward's, from flash_attn_with_kvcache's call signature (whose options hold no tensor).
    rotary_end: the largest cache_seqlens the caller's rotary tables cover (None: no rotary).
    The index tensors' values are checked by the kernel (kernels/triton/decode.py's doc): a bad one
    is raised by this call once the GPU has run it, or, deferred, by a later step (cache.DecodeStep).
    Returns out (B, Sq, H, Dv) (v_cache's head dim Dv) and softmax_lse (B, H, Sq) fp32."""
    batch, seqlen_q, nheads = q.shape[:3]
    out = empty_out(q, v_cache)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    given = isinstance(cache_seqlens, torch.Tensor)
    optional = (cache_seqlens if given else None, leftpad, cache_rows, block_table, k_new, v_new)
    report = DecodeStep(q.device, any(t is not None for t in optional[:4]), LAUNCH_BLOCKING)
    inputs = (q, k_cache, v_cache, *(t for t in optional if isinstance(t, torch.Tensor)))
    tensors: dict[str, torch.Tensor | int] = dict(Q=q, K=k_cache, V=v_cache, Out=out, Lse=lse, Errors=report.record,
                                                  step=report.step)
    tensors.update({name: t for name, t in zip(triton_decode.OPTIONAL_TENSORS, optional) if t is not None})
    # An int cache_seqlens is an argument of the plan like the tensors (the kernels do not specialize
    # on it, only on its width), so that a decode loop stepping through positions keeps one plan.
    tensors["cache_seqlen"] = seqlen = 0 if given else cache_seqlens
    key = None if tiles is not None else open_key(plans, "decode", inputs, -2**31 <= seqlen < 2**31)
    plan = kept(plans, key)
    if plan is not None:  # (plans come with options that hold no tensor: no mod tensor is missing)
        plan(tensors)
    else:
        params = resolved(params, 0, 0)  # (the decode kernel hands mods each query's key position: no offset)
        tensors.update(variant_tensors(params))
        cfg = select_decode(q, k_cache, v_cache, block_table, num_splits, tiles)
        plan = launch((decode_forward, params.key(), cfg, seqlen_new, rotary_end), tensors,
                      lambda: triton_decode.launches(tensors, params, cfg, seqlen_new, rotary_end))
        keep(plans, key, plan)
    report.done()
    return out, lse
