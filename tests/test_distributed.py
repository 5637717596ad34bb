"""Context parallelism on the CPU: the ring and the all-to-all attention with 2 and 3 processes over
gloo, against single-process attention on the whole sequence. Every process run has a deadline, so a
hang fails instead of blocking CI."""
import datetime
import itertools
import os
import tempfile
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cuflash
from cuflash.distributed import context_parallel_attn_func, context_parallel_attn_varlen_func, context_parallel_shard, \
    ring_flash_attn_func, ring_flash_attn_varlen_func, ulysses_flash_attn_func, ulysses_flash_attn_varlen_func, \
    zigzag_shard, zigzag_unshard
from cuflash.distributed.mesh import ULYSSES_MAX_TOKENS, auto_mode
from cuflash.distributed import ring, shards
from cuflash.distributed.ring import dense_steps, packed_steps, zigzag_packed_steps
from cuflash.distributed.shards import join_packed, join_sequence, split_packed

DEADLINE_S = 120


def _shard(x, rank, world, layout):
    return zigzag_shard(x, rank, world) if layout == "zigzag" else x.chunk(world, dim=1)[rank]


def _unshard(x, world, layout):
    if layout == "zigzag":
        return zigzag_unshard(x)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def _assert_matches(out, local, ref, full, unshard, tol, what):
    """This rank's output and the gradients of its shards (local), made whole by unshard, against the
    one-process output ref and the gradients of its inputs (full): relative error under tol."""
    for name, mine, theirs in (("out", out.detach(), ref.detach()), ("dq", local[0].grad, full[0].grad),
                               ("dk", local[1].grad, full[1].grad), ("dv", local[2].grad, full[2].grad)):
        err = ((unshard(mine) - theirs).norm() / theirs.norm()).item()
        assert err < tol, f"{what}: {name} error {err:.2e}"


def _gather_tokens(x):
    """Every rank's contiguous share of a packed (total, heads, dim) tensor, whole."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _check_against_full(rank, world):
    """Both layouts, causal or not, GQA, fp64 and fp32; every other rank's K/V shard received before
    the first step (the default budget) or each one only a step ahead (a budget of one byte)."""
    cases = itertools.product(("contiguous", "zigzag"), (False, True), (ring.KV_PREFETCH_BYTES, 1),
                              ((4, 4, torch.float64), (4, 2, torch.float64), (2, 1, torch.float32)))
    for layout, causal, budget, (nheads, nheads_k, dtype) in cases:
        torch.manual_seed(0)  # the same full problem on every rank
        seqlen = 12 * world
        q, k, v, dout = (torch.randn(2, seqlen, h, 8, dtype=dtype) for h in (nheads, nheads_k, nheads_k, nheads))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_func(*full, causal=causal)
        ref.backward(dout)
        local = [_shard(t, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v)]
        default, ring.KV_PREFETCH_BYTES = ring.KV_PREFETCH_BYTES, budget
        try:
            out = ring_flash_attn_func(*local, causal=causal, layout=layout)
            out.backward(_shard(dout, rank, world, layout))
        finally:
            ring.KV_PREFETCH_BYTES = default
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        what = f"layout={layout} causal={causal} prefetch={budget} heads={nheads}/{nheads_k} {dtype}"
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, layout), tol, what)


def _check_strided_inputs(rank, world):
    """The ring with q a transposed view and k, v every other head of wider tensors (as a fused
    projection gives them): K/V travel between ranks, so they must go as contiguous copies."""
    torch.manual_seed(5)
    q, k, v, dout = (torch.randn(2, 8 * world, 4, 8, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = cuflash.flash_attn_func(*full, causal=True)
    ref.backward(dout)
    shard = [_shard(t, rank, world, "zigzag").detach().clone() for t in (q, k, v)]
    local = [shard[0].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()]
    local += [torch.stack([t, torch.zeros_like(t)], dim=3).flatten(2, 3).requires_grad_() for t in shard[1:]]
    views = [local[0], local[1][:, :, ::2], local[2][:, :, ::2]]
    assert not any(t.is_contiguous() for t in views)
    out = ring_flash_attn_func(*views, causal=True, layout="zigzag")
    out.backward(_shard(dout, rank, world, "zigzag"))
    for t in local[1:]:  # the views' gradients land in the wide tensors' every other head
        assert t.grad[:, :, 1::2].abs().max() == 0
    grads = [SimpleNamespace(grad=local[0].grad)] + [SimpleNamespace(grad=t.grad[:, :, ::2]) for t in local[1:]]
    _assert_matches(out, grads, ref, full, lambda x: _unshard(x, world, "zigzag"), 1e-12, "strided q, k, v")


def _check_mismatched_shards(rank, world):
    q = torch.randn(1, 8 + 2 * rank, 2, 8)
    with pytest.raises(cuflash.FlashAttentionError) as info:
        ring_flash_attn_func(q, q, q)
    assert info.value.code == cuflash.ErrorCode.SHAPE_MISMATCH and "every rank" in str(info.value)


def _check_odd_zigzag(rank, world):
    q = torch.randn(1, 7, 2, 8)
    with pytest.raises(cuflash.FlashAttentionError) as info:
        ring_flash_attn_func(q, q, q, causal=True, layout="zigzag")
    assert "odd" in str(info.value)


def _check_ulysses(rank, world):
    """The all-to-all attention with every option it passes on (causal, window, softcap, ALiBi, GQA),
    both layouts, forward and backward, against flash_attn_func on the whole sequence."""
    options = {"plain": {}, "causal": dict(causal=True), "window_softcap": dict(window_size=(7, 2), softcap=5.0),
               "alibi_causal": dict(causal=True, alibi=True)}
    for layout in ("contiguous", "zigzag"):
        for name, opts in options.items():
            for nheads_k, dtype in ((6, torch.float64), (world, torch.float32)):
                torch.manual_seed(1)  # the same full problem on every rank
                seqlen = 10 * world
                q, k, v, dout = (torch.randn(2, seqlen, h, 8, dtype=dtype) for h in (6, nheads_k, nheads_k, 6))
                opts = dict(opts)
                if opts.pop("alibi", False):
                    opts["alibi_slopes"] = torch.rand(2, 6, dtype=torch.float32)
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = cuflash.flash_attn_func(*full, **opts)
                ref.backward(dout)
                local = [_shard(t, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v)]
                out = ulysses_flash_attn_func(*local, layout=layout, **opts)
                out.backward(_shard(dout, rank, world, layout))
                tol = 1e-12 if dtype == torch.float64 else 1e-5
                what = f"layout={layout} {name} heads=6/{nheads_k} {dtype}"
                _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, layout), tol, what)


def _check_ulysses_varlen(rank, world):
    """Packed documents (cu_seqlens) through the all-to-all: each rank holds a contiguous share of the
    packed tokens, documents crossing the shares' edges; against flash_attn_varlen_func in one process."""
    lens = [5, 9, 4, 6, 0, 6]  # 30 tokens: a multiple of 2 and 3; one empty document
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    for causal in (False, True):
        for nheads_k in (6, world):
            torch.manual_seed(3)
            q, dout = torch.randn(30, 6, 8, dtype=torch.float64), torch.randn(30, 6, 8, dtype=torch.float64)
            k, v = (torch.randn(30, nheads_k, 8, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), causal=causal)
            ref.backward(dout)
            local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
            out = ulysses_flash_attn_varlen_func(*local, cu, cu, max(lens), max(lens), causal=causal)
            out.backward(dout.chunk(world)[rank])
            _assert_matches(out, local, ref, full, _gather_tokens, 1e-12, f"varlen causal={causal} heads=6/{nheads_k}")
    with pytest.raises(cuflash.FlashAttentionError, match="pad it"):
        ulysses_flash_attn_varlen_func(q[:7], k[:7], v[:7], cu, cu, max(lens), max(lens))
    # cross-attention: other key counts than query counts
    lens_k = [3, 1, 8, 2, 4, 0]  # 18 keys
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    k, v = (torch.randn(18, 6, 8, dtype=torch.float64) for _ in range(2))
    ref = cuflash.flash_attn_varlen_func(q, k, v, cu, cu_k, max(lens), max(lens_k), causal=True)
    out = ulysses_flash_attn_varlen_func(*(t.chunk(world)[rank] for t in (q, k, v)), cu, cu_k, max(lens), max(lens_k),
                                         causal=True)
    assert ((_gather_tokens(out) - ref).norm() / ref.norm()).item() < 1e-12


def _check_ring_varlen(rank, world):
    """Packed documents (cu_seqlens) through the ring: contiguous shares of the packed tokens, documents
    crossing the shares' edges (one longer than a share, one empty, one inside a share) or all inside
    shares (fewer ring steps than ranks), causal or not, GQA, fp64 and fp32, forward and backward,
    against flash_attn_varlen_func in one process."""
    cases = itertools.product(([5, 13, 1, 0, 4, 7], [4, 6, 5, 0, 15]), (False, True),
                              ((6, torch.float64), (2, torch.float64), (3, torch.float32)))
    for lens, causal, (nheads_k, dtype) in cases:  # 30 tokens: a multiple of 2 and 3
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        torch.manual_seed(4)
        q, dout = (torch.randn(30, 6, 8, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(30, nheads_k, 8, dtype=dtype) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), causal=causal)
        ref.backward(dout)
        local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        out = ring_flash_attn_varlen_func(*local, cu, max(lens), causal=causal)
        out.backward(dout.chunk(world)[rank])
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        _assert_matches(out, local, ref, full, _gather_tokens, tol,
                        f"lens={lens} causal={causal} heads=6/{nheads_k} {dtype}")
    with pytest.raises(cuflash.FlashAttentionError, match="pad it"):
        ring_flash_attn_varlen_func(q[:7], k[:7], v[:7], cu, max(lens))
    with pytest.raises(cuflash.FlashAttentionError, match="max_seqlen"):
        ring_flash_attn_varlen_func(*(t.chunk(world)[rank] for t in (q, k, v)), cu, 4)


def _check_ulysses_heads(rank, world):
    q, k = torch.randn(1, 8, 2 * world + 1, 8), torch.randn(1, 8, 1, 8)
    with pytest.raises(cuflash.FlashAttentionError) as info:
        ulysses_flash_attn_func(q, k, k)
    assert info.value.code == cuflash.ErrorCode.SHAPE_MISMATCH and "nheads" in str(info.value)


def _mesh_unshard(x, mesh, layout):
    """The whole sequence from every rank's context_parallel_shard (ranks row-major over the mesh)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    if mesh.ndim == 2:  # ring shard i is the concatenation of its all-to-all ranks' parts
        inner = mesh.size(1)
        parts = [torch.cat(parts[i * inner:(i + 1) * inner], dim=1) for i in range(mesh.size(0))]
    return join_sequence(parts, layout)


def _check_mesh(rank, world):
    """context_parallel_attn_func over a DeviceMesh: 2 ranks as a 1-D mesh (the all-to-all where the
    heads divide, the ring where not), 4 ranks as 2 x 2 (the hybrid: ring over dim 0, all-to-all
    within dim 1), both layouts, causal or not, GQA, forward and backward, against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,) if world == 2 else (2, world // 2))
    heads = [(4, 2), (3, 3)] if world == 2 else [(4, 2)]
    for layout in ("contiguous", "zigzag"):
        for causal, softcap in ((False, 0.0), (True, 0.0), (True, 0.5)):
            for nheads, nheads_k in heads:
                torch.manual_seed(2)
                q, k, v, dout = (torch.randn(2, 8 * world, h, 8, dtype=torch.float64)
                                 for h in (nheads, nheads_k, nheads_k, nheads))
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = cuflash.flash_attn_func(*full, causal=causal, softcap=softcap)
                ref.backward(dout)
                local = [context_parallel_shard(t, mesh, layout).detach().clone().requires_grad_() for t in (q, k, v)]
                out = context_parallel_attn_func(*local, mesh, causal=causal, layout=layout, softcap=softcap)
                out.backward(context_parallel_shard(dout, mesh, layout))
                what = (f"mesh {tuple(mesh.shape)} layout={layout} causal={causal} softcap={softcap} "
                        f"heads={nheads}/{nheads_k}")
                _assert_matches(out, local, ref, full, lambda x: _mesh_unshard(x, mesh, layout), 1e-12, what)
    q = torch.randn(1, 8, 4, 8)
    for mode, words in (("hybrid", "2-D") if world == 2 else ("ring", "2-D"), ("sideways", "mode")):
        with pytest.raises(cuflash.FlashAttentionError, match=words):
            context_parallel_attn_func(q, q, q, mesh, mode=mode)
    if world == 4:  # the hybrid's ring takes a sliding window; it has no varlen path
        torch.manual_seed(2)
        q, k, v, dout = (torch.randn(2, 8 * world, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_func(*full, causal=True, window_size=(5, 0))
        ref.backward(dout)
        local = [context_parallel_shard(t, mesh, "zigzag").detach().clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn_func(*local, mesh, causal=True, layout="zigzag", window_size=(5, 0))
        out.backward(context_parallel_shard(dout, mesh, "zigzag"))
        _assert_matches(out, local, ref, full, lambda x: _mesh_unshard(x, mesh, "zigzag"), 1e-12, "hybrid window")
        q = torch.randn(1, 8, 4, 8)
        cu = torch.tensor([0, 32], dtype=torch.int32)
        with pytest.raises(cuflash.FlashAttentionError, match="1-D mesh"):
            context_parallel_attn_varlen_func(q[0], q[0], q[0], cu, cu, 32, 32, mesh)


def _check_ring_softcap(rank, world):
    """The ring with softcap, dense (both layouts, causal or not) and packed, forward and backward,
    against one process."""
    for layout, causal in itertools.product(("contiguous", "zigzag"), (False, True)):
        torch.manual_seed(6)
        q, k, v, dout = (torch.randn(2, 8 * world, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_func(*full, causal=causal, softcap=0.5)
        ref.backward(dout)
        local = [_shard(t, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v)]
        out = ring_flash_attn_func(*local, causal=causal, layout=layout, softcap=0.5)
        out.backward(_shard(dout, rank, world, layout))
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, layout), 1e-12,
                        f"softcap layout={layout} causal={causal}")
    lens = [5, 13, 1, 0, 4, 7]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v, dout = (torch.randn(30, h, 8, dtype=torch.float64) for h in (6, 2, 2, 6))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), causal=True, softcap=0.5)
    ref.backward(dout)
    local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring_flash_attn_varlen_func(*local, cu, max(lens), causal=True, softcap=0.5)
    out.backward(dout.chunk(world)[rank])
    _assert_matches(out, local, ref, full, _gather_tokens, 1e-12, "softcap packed")


def _check_mesh_options(rank, world):
    """context_parallel_attn_func and context_parallel_attn_varlen_func on a 1-D mesh with a sliding
    window and softcap, through each mode that can run them (auto takes the all-to-all for a window),
    forward and backward, against one process; a mode that cannot run an option raises naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    dense = [("ulysses", dict(window_size=(3, 1))), ("auto", dict(causal=True, window_size=(4, 4), softcap=0.5)),
             ("ring", dict(causal=True, softcap=0.5)), ("ring", dict(causal=True, window_size=(-1, 2)))]
    for mode, opts in dense:
        torch.manual_seed(7)
        q, k, v, dout = (torch.randn(2, 10 * world, h, 8, dtype=torch.float64) for h in (2 * world, world, world,
                                                                                           2 * world))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_func(*full, **opts)
        ref.backward(dout)
        local = [context_parallel_shard(t, mesh).detach().clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn_func(*local, mesh, mode=mode, **opts)
        out.backward(context_parallel_shard(dout, mesh))
        _assert_matches(out, local, ref, full, lambda x: _mesh_unshard(x, mesh, "contiguous"), 1e-12,
                        f"mode={mode} {opts}")
    lens = [5, 9, 4, 6, 0, 6]  # 30 tokens: a multiple of 2 and 3
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    packed = [("ring", dict(causal=True, softcap=0.5)), ("ring", dict(causal=False)),
              ("ulysses", dict(causal=True, window_size=(2, 0))), ("auto", dict(window_size=(2, 3), softcap=0.5))]
    for mode, opts in packed:
        torch.manual_seed(8)
        q, k, v, dout = (torch.randn(30, h, 8, dtype=torch.float64) for h in (2 * world, world, world, 2 * world))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), **opts)
        ref.backward(dout)
        local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn_varlen_func(*local, cu, cu.clone(), max(lens), max(lens), mesh, mode=mode, **opts)
        out.backward(dout.chunk(world)[rank])
        _assert_matches(out, local, ref, full, _gather_tokens, 1e-12, f"packed mode={mode} {opts}")
    q = torch.randn(2, 4 * world, 2 * world, 8, dtype=torch.float64)
    odd = torch.randn(2, 4 * world, 2 * world + 1, 8, dtype=torch.float64)
    for mode, heads in (("ring", q), ("auto", odd)):  # auto: the all-to-all cannot split 2W + 1 heads: the ring
        ref = cuflash.flash_attn_func(heads, heads, heads, causal=True, window_size=(3, 0))
        out = context_parallel_attn_func(*(context_parallel_shard(heads, mesh),) * 3, mesh, mode=mode, causal=True,
                                         window_size=(3, 0))
        assert ((_mesh_unshard(out, mesh, "contiguous") - ref).norm() / ref.norm()).item() < 1e-12, mode
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    zigzag_cu = torch.tensor([0, 4 * world, 10 * world], dtype=torch.int32)
    uneven_cu = torch.tensor([0, 1, 4 * world], dtype=torch.int32)  # documents of 1 and 4W - 1 tokens
    refusals = [("cu_seqlens_k", "ring", cu, dict(cu_seqlens_k=cu_k)),
                ("window_size", "ring", zigzag_cu, dict(window_size=(2, 2), layout="zigzag")),
                ("layout='zigzag'", "ulysses", zigzag_cu, dict(layout="zigzag")),
                ("pad each document", "ring", uneven_cu, dict(layout="zigzag"))]
    for words, mode, cu_q, opts in refusals:
        opts = dict(dict(cu_seqlens_k=cu_q), **opts)
        shard = torch.randn(int(cu_q[-1]) // world, 2 * world, 8, dtype=torch.float64)
        with pytest.raises(cuflash.FlashAttentionError, match=words):
            longest = int(cu_q.diff().max())
            context_parallel_attn_varlen_func(shard, shard, shard, cu_q, max_seqlen_q=longest, max_seqlen_k=longest,
                                              mesh=mesh, mode=mode, **opts)


def _check_transformers_cp(rank, world):
    """register_context_parallel's attention called as transformers calls it (query (B, H, L, D) of
    this rank's shard; sliding_window, softcap, is_causal and the padding-free cu_seq_lens_* kwargs of
    the whole packed row), through the ring, the all-to-all and auto, against attention_forward on the
    whole sequence in one process with the same options, forward and backward, and packed sequences in
    zigzag shards through the ring; what a mode cannot run (dropout, documents the zigzag layout cannot
    cut) raises naming it. Then a Gemma-2 (sliding
    and full layers, softcapped logits) on the mesh against the eager model in one process."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import cuflash.integrations.transformers as cuflash_hf
    mesh = init_device_mesh("cpu", (world,))
    for mode in ("ring", "ulysses", "auto"):
        cuflash_hf.register_context_parallel(mesh, name=f"cp_{mode}", mode=mode)
    cuflash_hf.register_context_parallel(mesh, name="cp_zigzag", layout="zigzag")
    module = torch.nn.Module()  # causal, as transformers' decoders
    lens = [5, 9, 4, 6, 0, 6]  # 30 tokens: a multiple of 2 and 3
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lens), max_length_k=max(lens))
    cases = [("ring", dict(softcap=0.5)), ("ring", dict(is_causal=False)), ("ring", dict(sliding_window=5)),
             ("ring", dict(packed, sliding_window=3)), ("ulysses", dict(sliding_window=5)),
             ("ulysses", dict(sliding_window=4, is_causal=False, softcap=0.5)), ("auto", dict(sliding_window=5)),
             ("ring", dict(packed, softcap=0.5)), ("ring", dict(packed, is_causal=False)),
             ("ulysses", dict(packed, sliding_window=3)), ("auto", dict(packed, sliding_window=3, softcap=0.5))]
    for mode, opts in cases:
        torch.manual_seed(9)
        batch = 1 if "cu_seq_lens_q" in opts else 2
        q, k, v, dout = (torch.randn(batch, 30, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, _ = cuflash_hf.attention_forward(module, *(t.transpose(1, 2) for t in full), None, **opts)
        ref.backward(dout)
        local = [t.chunk(world, dim=1)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        out, _ = ALL_ATTENTION_FUNCTIONS[f"cp_{mode}"](module, *(t.transpose(1, 2) for t in local), None, **opts)
        out.backward(dout.chunk(world, dim=1)[rank])
        what = f"mode={mode} {sorted(opts)} softcap={opts.get('softcap')} window={opts.get('sliding_window')}"
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, "contiguous"), 1e-12, what)
    lens = [2 * world, 8 * world, 0, 4 * world]  # whole documents of 2W-chunks: the zigzag layout
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    zigzag = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lens), max_length_k=max(lens))
    torch.manual_seed(9)
    q, k, v, dout = (torch.randn(1, sum(lens), h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = cuflash_hf.attention_forward(module, *(t.transpose(1, 2) for t in full), None, **zigzag)
    ref.backward(dout)
    local = [context_parallel_shard(t, mesh, "zigzag", dim=1, cu_seqlens=cu).detach().clone().requires_grad_()
             for t in (q, k, v)]
    out, _ = ALL_ATTENTION_FUNCTIONS["cp_zigzag"](module, *(t.transpose(1, 2) for t in local), None, **zigzag)
    out.backward(context_parallel_shard(dout, mesh, "zigzag", dim=1, cu_seqlens=cu))
    _assert_matches(out, local, ref, full, lambda x: _gather_packed(x, cu, "zigzag", dim=1), 1e-12, "zigzag packed")
    q = torch.randn(1, 4, 30 // world, 8, dtype=torch.float64)
    uneven = torch.tensor([0, 1, 30], dtype=torch.int32)  # documents of 1 and 29 tokens
    refusals = [("cp_auto", dict(dropout=0.1), "dropout"), ("cp_ulysses", dict(packed, dropout=0.1), "dropout"),
                ("cp_zigzag", dict(cu_seq_lens_q=uneven, cu_seq_lens_k=uneven, max_length_q=29, max_length_k=29),
                 "pad each document")]
    for name, opts, words in refusals:
        with pytest.raises(cuflash.FlashAttentionError, match=words):
            ALL_ATTENTION_FUNCTIONS[name](module, q, q, q, None, **opts)

    def config():
        return transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                         attn_logit_softcapping=0.5, max_position_embeddings=64)
    torch.manual_seed(10)
    ref = transformers.Gemma2ForCausalLM._from_config(config(), attn_implementation="eager", dtype=torch.float64)
    ours = transformers.Gemma2ForCausalLM._from_config(config(), attn_implementation="cp_auto", dtype=torch.float64)
    err = _mesh_logits_error(ours, ref, mesh, world)  # (eager attention takes its softmax in fp32)
    assert err < 1e-6, f"Gemma-2 on the mesh: logits error {err:.2e}"


def _assert_sink_grad(local_sink, full_sink, tol, what):
    """The sink's gradient, each rank's share summed over the ranks, against the one-process one."""
    grad = local_sink.grad.clone()
    dist.all_reduce(grad)
    err = ((grad - full_sink.grad).norm() / full_sink.grad.norm()).item()
    assert err < tol, f"{what}: dsink error {err:.2e}"


def _check_sinks(rank, world):
    """A learnable sink through the ring (both layouts, causal or not, packed), the all-to-all (dense,
    packed) and register_context_parallel's attention (gpt-oss's s_aux), forward and backward, the
    sink's gradient summed over the ranks, against one process; then a gpt-oss (sliding and full
    layers) on the mesh against the eager model in one process."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import cuflash.integrations.transformers as cuflash_hf
    mesh = init_device_mesh("cpu", (world,))
    cuflash_hf.register_context_parallel(mesh, name="cp_sinks")
    lens = [5, 9, 4, 6, 0, 6]  # 30 tokens: a multiple of 2 and 3
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    heads, heads_k = 2 * world, world
    dense = [(ring_flash_attn_func, "contiguous", True), (ring_flash_attn_func, "zigzag", True),
             (ring_flash_attn_func, "zigzag", False), (ulysses_flash_attn_func, "zigzag", True)]
    for fn, layout, causal in dense:
        torch.manual_seed(11)
        q, k, v, dout = (torch.randn(2, 10 * world, h, 8, dtype=torch.float64) for h in (heads, heads_k, heads_k,
                                                                                           heads))
        full = [t.clone().requires_grad_() for t in (q, k, v, torch.randn(heads, dtype=torch.float64))]
        ref = cuflash.flash_attn_func(*full[:3], causal=causal, learnable_sink=full[3])
        ref.backward(dout)
        local = [_shard(t, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v)]
        local.append(full[3].detach().clone().requires_grad_())
        out = fn(*local[:3], causal=causal, layout=layout, learnable_sink=local[3])
        out.backward(_shard(dout, rank, world, layout))
        what = f"{fn.__name__} layout={layout} causal={causal}"
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, layout), 1e-12, what)
        _assert_sink_grad(local[3], full[3], 1e-12, what)
    for fn, causal in ((ring_flash_attn_varlen_func, True), (ulysses_flash_attn_varlen_func, False)):
        torch.manual_seed(12)
        q, k, v, dout = (torch.randn(30, h, 8, dtype=torch.float64) for h in (heads, heads_k, heads_k, heads))
        full = [t.clone().requires_grad_() for t in (q, k, v, torch.randn(heads, dtype=torch.float64))]
        ref = cuflash.flash_attn_varlen_func(*full[:3], cu, cu, max(lens), max(lens), causal=causal,
                                             learnable_sink=full[3])
        ref.backward(dout)
        local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        local.append(full[3].detach().clone().requires_grad_())
        packed = (cu, max(lens)) if fn is ring_flash_attn_varlen_func else (cu, cu, max(lens), max(lens))
        out = fn(*local[:3], *packed, causal=causal, learnable_sink=local[3])
        out.backward(dout.chunk(world)[rank])
        _assert_matches(out, local, ref, full, _gather_tokens, 1e-12, fn.__name__)
        _assert_sink_grad(local[3], full[3], 1e-12, fn.__name__)
    module = torch.nn.Module()
    for opts in (dict(), dict(sliding_window=5)):  # the ring, then the all-to-all
        torch.manual_seed(13)
        q, k, v, dout = (torch.randn(2, 30, h, 8, dtype=torch.float64) for h in (heads, heads_k, heads_k, heads))
        full = [t.clone().requires_grad_() for t in (q, k, v, torch.randn(heads, dtype=torch.float64))]
        ref, _ = cuflash_hf.attention_forward(module, *(t.transpose(1, 2) for t in full[:3]), None, s_aux=full[3],
                                              **opts)
        ref.backward(dout)
        local = [t.chunk(world, dim=1)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        local.append(full[3].detach().clone().requires_grad_())
        out, _ = ALL_ATTENTION_FUNCTIONS["cp_sinks"](module, *(t.transpose(1, 2) for t in local[:3]), None,
                                                     s_aux=local[3], **opts)
        out.backward(dout.chunk(world, dim=1)[rank])
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, "contiguous"), 1e-12, f"cp {opts}")
        _assert_sink_grad(local[3], full[3], 1e-12, f"cp {opts}")

    def config():
        return transformers.GptOssConfig(vocab_size=97, hidden_size=48, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=12, num_key_value_heads=6, head_dim=8,
                                         num_local_experts=2, num_experts_per_tok=2, sliding_window=5,
                                         layer_types=["sliding_attention", "full_attention"],
                                         max_position_embeddings=4096)
    cuflash_hf.register()  # (gpt-oss lists the flash implementations it runs; cp_sinks is not "flash")
    torch.manual_seed(14)
    ref = transformers.GptOssForCausalLM._from_config(config(), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    ours = transformers.GptOssForCausalLM._from_config(config(), attn_implementation="cp_sinks", dtype=torch.float32)
    err = _mesh_logits_error(ours, ref, mesh, world)
    assert err < 1e-5, f"gpt-oss on the mesh: logits error {err:.2e}"  # (its experts take no fp64)


def _mesh_logits_error(ours, ref, mesh, world) -> float:
    """The relative error of model `ours` (ref's weights loaded) on contiguous shards of a batch of ids
    and positions, its logits gathered, against `ref` on the whole batch."""
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 8 * world))
    positions = torch.arange(8 * world).expand(2, -1)
    logits = ours(input_ids=context_parallel_shard(ids, mesh),
                  position_ids=context_parallel_shard(positions, mesh)).logits
    expected = ref(input_ids=ids).logits
    return ((_mesh_unshard(logits, mesh, "contiguous") - expected).norm() / expected.norm()).item()


def _gather_packed(x, cu_seqlens, layout, dim=0):
    """The whole packed batch from every rank's shard (split_packed's layout)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return join_packed(parts, cu_seqlens, layout, dim)


def _check_ring_windows(rank, world):
    """Sliding windows through the ring: dense in both layouts (windows inside a chunk and across
    shards, causal or not, some bounded on one side only), packed in contiguous shares (a document
    crossing the shares' edges, one longer than a share, an empty one); forward and backward against
    one process."""
    windows = [(3, 0), (11, 0), (5, 2), (-1, 4), (2, -1), (1, 1)]
    for layout, causal, window in itertools.product(("contiguous", "zigzag"), (False, True), windows):
        torch.manual_seed(13)
        q, k, v, dout = (torch.randn(2, 8 * world, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_func(*full, causal=causal, window_size=window, softcap=0.5)
        ref.backward(dout)
        local = [_shard(t, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v)]
        out = ring_flash_attn_func(*local, causal=causal, layout=layout, window_size=window, softcap=0.5)
        out.backward(_shard(dout, rank, world, layout))
        _assert_matches(out, local, ref, full, lambda x: _unshard(x, world, layout), 1e-12,
                        f"layout={layout} causal={causal} window={window}")
    lens = [5, 13, 1, 0, 4, 7]  # 30 tokens: a multiple of 2 and 3
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    for causal, window in itertools.product((False, True), [(3, 0), (6, 2), (-1, 3), (2, -1), (20, 20)]):
        torch.manual_seed(14)
        q, k, v, dout = (torch.randn(30, h, 8, dtype=torch.float64) for h in (6, 2, 2, 6))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), causal=causal, window_size=window)
        ref.backward(dout)
        local = [t.chunk(world)[rank].detach().clone().requires_grad_() for t in (q, k, v)]
        out = ring_flash_attn_varlen_func(*local, cu, max(lens), causal=causal, window_size=window)
        out.backward(dout.chunk(world)[rank])
        _assert_matches(out, local, ref, full, _gather_tokens, 1e-12, f"packed causal={causal} window={window}")


def _check_ring_packed_zigzag(rank, world):
    """Packed documents in the zigzag layout (context_parallel_shard with cu_seqlens cuts them; each
    document cut into 2W chunks): a long document, short ones, an empty one, causal or not, softcap,
    GQA, fp64 and fp32, forward and backward, through ring_flash_attn_varlen_func and
    context_parallel_attn_varlen_func (auto takes the ring), against flash_attn_varlen_func in one
    process."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    unit = 2 * world
    cases = itertools.product(([1, 6, 0, 2], [9], [0, 1]), (False, True),
                              ((6, torch.float64), (2, torch.float64), (3, torch.float32)))
    for units, causal, (nheads_k, dtype) in cases:
        lens = [n * unit for n in units]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        torch.manual_seed(15)
        q, dout = (torch.randn(sum(lens), 6, 8, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(sum(lens), nheads_k, 8, dtype=dtype) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.flash_attn_varlen_func(*full, cu, cu, max(lens), max(lens), causal=causal, softcap=0.5)
        ref.backward(dout)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for through_mesh in (False, True):
            local = [context_parallel_shard(t, mesh, "zigzag", dim=0, cu_seqlens=cu).detach().clone().requires_grad_()
                     for t in (q, k, v)]
            if through_mesh:
                out = context_parallel_attn_varlen_func(*local, cu, cu, max(lens), max(lens), mesh, causal=causal,
                                                        softcap=0.5, layout="zigzag")
            else:
                out = ring_flash_attn_varlen_func(*local, cu, max(lens), causal=causal, softcap=0.5, layout="zigzag")
            out.backward(split_packed(dout, cu, world, "zigzag")[rank])
            _assert_matches(out, local, ref, full, lambda x: _gather_packed(x, cu, "zigzag"), tol,
                            f"zigzag lens={lens} causal={causal} heads=6/{nheads_k} {dtype} mesh={through_mesh}")


def _assert_sink_case(tensors, attend_full, attend_local, shard, unshard, what):
    """attend_full(q, k, v, sink) in one process against attend_local(q, k, v, sink) on this rank's
    shards (shard cuts q, k, v and dout; the sink is the same on every rank): the output, the gradients
    and the sink's, summed over the ranks."""
    q, k, v, dout = tensors
    full = [t.clone().requires_grad_() for t in (q, k, v, torch.randn(q.shape[-2], dtype=q.dtype))]
    ref = attend_full(*full)
    ref.backward(dout)
    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    local.append(full[3].detach().clone().requires_grad_())
    out = attend_local(*local)
    out.backward(shard(dout))
    _assert_matches(out, local, ref, full, unshard, 1e-12, what)
    _assert_sink_grad(local[3], full[3], 1e-12, what)


def _check_ring_sinks(rank, world):
    """A learnable sink through the ring's packed zigzag layout (ring_flash_attn_varlen_func and
    context_parallel_attn_varlen_func: a long document, short ones, an empty one, causal or not, GQA)
    and through its windows (dense in both layouts, packed in contiguous shares), against one process;
    a window over packed zigzag shards is refused naming it, sink or not."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for units, causal, through_mesh in itertools.product(([1, 6, 0, 2], [0, 1]), (False, True), (False, True)):
        lens = [n * 2 * world for n in units]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        torch.manual_seed(16)
        tensors = [torch.randn(sum(lens), h, 8, dtype=torch.float64) for h in (6, 2, 2, 6)]
        if through_mesh:
            def local(q, k, v, sink):
                return context_parallel_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), mesh, causal=causal,
                                                         layout="zigzag", learnable_sink=sink)
        else:
            def local(q, k, v, sink):
                return ring_flash_attn_varlen_func(q, k, v, cu, max(lens), causal=causal, layout="zigzag",
                                                   learnable_sink=sink)
        _assert_sink_case(tensors, lambda q, k, v, sink: cuflash.flash_attn_varlen_func(
            q, k, v, cu, cu, max(lens), max(lens), causal=causal, learnable_sink=sink), local,
            lambda t: split_packed(t, cu, world, "zigzag")[rank], lambda x: _gather_packed(x, cu, "zigzag"),
            f"zigzag sink lens={lens} causal={causal} mesh={through_mesh}")
    for layout, (causal, window) in itertools.product(("contiguous", "zigzag"),
                                                      ((True, (3, 0)), (False, (5, 2)), (False, (-1, 4)))):
        torch.manual_seed(17)
        _assert_sink_case(
            [torch.randn(2, 8 * world, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4)],
            lambda q, k, v, sink: cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                          learnable_sink=sink),
            lambda q, k, v, sink: ring_flash_attn_func(q, k, v, causal=causal, layout=layout, window_size=window,
                                                       learnable_sink=sink),
            lambda t: _shard(t, rank, world, layout), lambda x: _unshard(x, world, layout),
            f"dense sink layout={layout} causal={causal} window={window}")
    lens = [5, 13, 1, 0, 4, 7]  # 30 tokens: a multiple of 2 and 3
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    for causal, window in ((True, (3, 0)), (False, (6, 2))):
        torch.manual_seed(18)
        _assert_sink_case(
            [torch.randn(30, h, 8, dtype=torch.float64) for h in (6, 2, 2, 6)],
            lambda q, k, v, sink: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                                 window_size=window, learnable_sink=sink),
            lambda q, k, v, sink: ring_flash_attn_varlen_func(q, k, v, cu, max(lens), causal=causal,
                                                              window_size=window, learnable_sink=sink),
            lambda t: t.chunk(world)[rank], _gather_tokens, f"packed sink causal={causal} window={window}")
    q = torch.randn(4, 2, 8, dtype=torch.float64)  # (this rank's share of one document of 4W tokens)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    with pytest.raises(cuflash.FlashAttentionError, match="window_size"):
        ring_flash_attn_varlen_func(q, q, q, cu, 4 * world, causal=True, layout="zigzag", window_size=(2, 0),
                                    learnable_sink=torch.zeros(2, dtype=torch.float64))


def _check_shards_checked_once(rank, world):
    """check_shards gathers the ranks' shapes once per signature: again for new shapes, a new layout or
    another group, not for repeats."""
    gathers = []
    real = dist.all_gather
    dist.all_gather = lambda *args, **kwargs: gathers.append(kwargs.get("group")) or real(*args, **kwargs)
    try:
        q, wide = torch.randn(1, 8, 2, 8), torch.randn(1, 12, 2, 8)
        pair = dist.new_group(list(range(world)))
        counts = []
        for args in ((q, "contiguous"), (q, "contiguous"), (wide, "contiguous"), (q, "contiguous"),
                     (q, "zigzag"), (wide, "contiguous"), (q, "zigzag")):
            before = len(gathers)
            ring_flash_attn_func(args[0], args[0], args[0], causal=True, layout=args[1])
            counts.append(len(gathers) - before)
        before = len(gathers)
        ring_flash_attn_func(q, q, q, group=pair)
        ring_flash_attn_func(q, q, q, group=pair)
        counts.append(len(gathers) - before)
    finally:
        dist.all_gather = real
    assert counts == [1, 0, 1, 0, 1, 0, 0, 1], counts
    assert shards.CHECKED_SHARDS, "nothing remembered"


CHECKS = {"full": _check_against_full, "strided": _check_strided_inputs, "mesh": _check_mesh, "ulysses": _check_ulysses,
          "ulysses_varlen": _check_ulysses_varlen, "ring_varlen": _check_ring_varlen,
          "ulysses_heads": _check_ulysses_heads, "mismatch": _check_mismatched_shards, "odd_zigzag": _check_odd_zigzag,
          "ring_softcap": _check_ring_softcap, "mesh_options": _check_mesh_options,
          "transformers_cp": _check_transformers_cp, "checked_once": _check_shards_checked_once,
          "ring_windows": _check_ring_windows, "ring_packed_zigzag": _check_ring_packed_zigzag,
          "sinks": _check_sinks, "ring_sinks": _check_ring_sinks}


def _check_torch_context_parallel(rank, world):
    """torch's own context parallelism (context_parallel(): its ring, with its head-tail load balancer,
    calling aten::_scaled_dot_product_flash_attention on each pair of shards) with cuflash's SDPA
    provider active, on GPUs: a profile names cuflash's kernels, and the output and the gradients
    match one GPU's torch flash attention on the whole sequence."""
    import torch.nn.attention as attention
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    mesh = init_device_mesh("cuda", (world,))
    flash = [attention.SDPBackend.FLASH_ATTENTION]
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 8, 2048 * world, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    with attention.sdpa_kernel(flash):
        ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    cuflash.activate_sdpa_provider()
    try:
        local = [t.clone() for t in (q, k, v, dout)]
        with context_parallel(mesh, buffers=local, buffer_seq_dims=[2] * 4):
            for t in local[:3]:
                t.requires_grad_()
            with attention.sdpa_kernel(flash), torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = F.scaled_dot_product_attention(*local[:3], is_causal=True)
                out.backward(local[3])
                torch.cuda.synchronize()
            grads = [t.grad for t in local[:3]]
            for t in local[:3]:
                t.requires_grad_(False)
            whole = context_parallel_unshard(mesh, [out.detach(), *grads], [2] * 4)
    finally:
        attention.restore_flash_attention_impl()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any(n.startswith("_attn_fwd") for n in names) and any(n.startswith("_attn_bwd") for n in names), names
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), whole, (ref, *(t.grad for t in full))):
        err = ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()
        assert err < 2e-2, f"torch context_parallel on cuflash: {name} error {err:.2e}"


# Checks that run on GPUs (one a rank, NCCL); the others run on the CPU (gloo).
GPU_CHECKS = {"torch_context_parallel": _check_torch_context_parallel}


def _worker(rank, world, init_file, result_dir, check):
    if check in GPU_CHECKS:
        torch.cuda.set_device(rank)
    else:
        os.environ["CUFLASH_BACKEND"] = "cpu"
    dist.init_process_group("nccl" if check in GPU_CHECKS else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=DEADLINE_S))
    try:
        {**CHECKS, **GPU_CHECKS}[check](rank, world)
        message = "ok"
    except BaseException:
        message = traceback.format_exc()
    finally:
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    # Leave without the interpreter's teardown: gloo's threads can abort it ("terminate called
    # without an active exception"), seen about once in ten runs under pytest, after the checks.
    os._exit(0)


def _run(world, check):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), tmp, check), nprocs=world,
                                 join=False, start_method="spawn")
        try:
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=DEADLINE_S)
            while not ctx.join(timeout=1):
                assert datetime.datetime.now() < deadline, f"{check} with {world} processes hung"
        except mp.ProcessExitedException as exc:
            written = {r: os.path.exists(os.path.join(tmp, f"rank{r}.txt")) for r in range(world)}
            raise AssertionError(f"{exc}; result written by rank: {written}") from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.txt")) as f:
                result = f.read()
            assert result == "ok", f"rank {rank}:\n{result}"


@pytest.mark.parametrize("check", ["full", "strided", "ring_varlen", "ulysses", "ulysses_varlen", "ring_softcap",
                                   "mesh_options", "sinks", "ring_windows", "ring_packed_zigzag",
                                   "ring_sinks"])
@pytest.mark.parametrize("world", [2, 3])
def test_matches_single_process(world, check):
    """The ring and the all-to-all, dense and packed, with 2 and 3 processes (the CHECKS above)."""
    _run(world, check)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(not cuflash.sdpa_provider_available(), reason="this torch takes no SDPA providers")
def test_torch_context_parallel_runs_on_cuflash_on_two_gpus():
    """torch's context_parallel() over 2 GPUs with cuflash's SDPA provider active (GPU_CHECKS)."""
    _run(2, "torch_context_parallel")


def test_ring_gathers_at_most_an_eighth_of_a_gpus_memory(monkeypatch):
    """The K/V a rank gathers before its first step: KV_PREFETCH_BYTES, and on a GPU at most an
    eighth of its memory (a 16 GB GPU gathers 2 GiB at most; an 80 GB one the whole 8 GiB)."""
    for total, budget in ((16 << 30, 2 << 30), (80 << 30, ring.KV_PREFETCH_BYTES)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
        assert ring.prefetch_budget(torch.device("cuda", 0)) == budget
    assert ring.prefetch_budget(torch.device("cpu")) == ring.KV_PREFETCH_BYTES


@pytest.mark.parametrize("lens,size,causal,steps", [
    ([4, 6, 5, 0, 15], 2, True, 1), ([4, 6, 5, 0, 15], 2, False, 1),  # every document inside a share
    ([4, 6, 5, 0, 15], 3, True, 2), ([4, 6, 5, 0, 15], 3, False, 3),  # one crossing into the next share
    ([30], 3, True, 3)])
def test_packed_ring_stops_after_the_last_step_with_work(lens, size, causal, steps):
    """The packed ring runs as many steps as the farthest shard any document reaches (the same on
    every rank), not one per rank."""
    bounds = [0, *itertools.accumulate(lens)]
    for rank in range(size):
        blocks = packed_steps(bounds, rank, size, sum(lens) // size, causal, 1.0, torch.device("cpu"))
        assert len(blocks) == steps


def _pairs(block_q: slice, block_k: slice, left: int, right: int, n: int, m: int) -> torch.Tensor:
    """The (n, m) bool matrix of local (query row, key row) pairs a block with a top-left window sees."""
    visible = torch.zeros(n, m, dtype=torch.bool)
    i = torch.arange(block_q.stop - block_q.start)[:, None]
    j = torch.arange(block_k.stop - block_k.start)[None]
    ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    visible[block_q, block_k] = ok
    return visible


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_blocks_see_exactly_the_windows_pairs(layout):
    """Every (query, key) pair of the whole sequence that a window (causal or not, one-sided, wider
    than a shard) lets through is seen by exactly one block of exactly one ring step, and no other:
    the blocks' trimmed rows and shifted windows against the window over global positions."""
    size, seqlen = 4, 6  # 24 tokens; zigzag chunks of 3
    position = torch.cat([torch.arange(r * seqlen, (r + 1) * seqlen) if layout == "contiguous"
                          else zigzag_shard(torch.arange(size * seqlen)[None], r, size)[0] for r in range(size)])
    for causal, window in itertools.product((False, True), [(0, 0), (2, 0), (4, 1), (-1, 3), (5, -1), (13, 13)]):
        left, right = window[0], 0 if causal else window[1]
        g_q, g_k = position.view(size, seqlen)[:, :, None], position.view(size, seqlen)[:, None, :]
        for rank in range(size):
            seen = torch.zeros(size, seqlen, seqlen, dtype=torch.int64)  # per source shard
            for s, blocks in enumerate(dense_steps(rank, size, seqlen, causal, layout, 1.0,
                                                   window=ring.window_bounds(window, causal))):
                for qs, ks, params in blocks:
                    assert not params.bottom_right or params.window_left == params.window_right == -1
                    seen[(rank - s) % size] += _pairs(qs, ks, params.window_left, params.window_right, seqlen, seqlen)
            expected = torch.ones(size, seqlen, seqlen, dtype=torch.bool)
            if left >= 0:
                expected &= g_k >= g_q[rank] - left
            if right >= 0:
                expected &= g_k <= g_q[rank] + right
            assert torch.equal(seen, expected.long()), (causal, window, rank)


def _packed_pairs_seen(steps, rows_of, rank: int, size: int, total: int) -> torch.Tensor:
    """(total, total) counts of the global (query, key) token pairs that rank's blocks see over all ring
    steps: each block's documents (its prefix sums) under its window (top-left aligned, as the ring's
    packed blocks take it) at local rows mapped to global tokens by rows_of(rank)."""
    seen = torch.zeros(total, total, dtype=torch.int64)
    for s, blocks in enumerate(steps):
        q_global, k_global = rows_of(rank), rows_of((rank - s) % size)
        for qs, ks, params in blocks:
            assert not params.bottom_right
            cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
            for b in range(len(cu_q) - 1):
                i = torch.arange(cu_q[b + 1] - cu_q[b])[:, None]
                j = torch.arange(cu_k[b + 1] - cu_k[b])[None]
                ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
                if params.window_left >= 0:
                    ok &= j >= i - params.window_left
                if params.window_right >= 0:
                    ok &= j <= i + params.window_right
                rows = q_global[qs.start + cu_q[b] + i.flatten()]
                keys = k_global[ks.start + cu_k[b] + j.flatten()]
                seen[rows[:, None], keys[None]] += ok.long()
    return seen


def _packed_pairs_expected(lens, causal, window) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    start = torch.tensor([0, *itertools.accumulate(lens)])[doc]
    pos = torch.arange(sum(lens)) - start  # the position in its document
    ok = doc[:, None] == doc[None]
    left, right = window
    right = 0 if causal else right
    if right >= 0:
        ok &= pos[None] <= pos[:, None] + right
    if left >= 0:
        ok &= pos[None] >= pos[:, None] - left
    return ok.long()


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (4, 2)),
                                           (False, (-1, 5)), (True, (40, 0))])
def test_packed_ring_blocks_see_exactly_the_documents_pairs(causal, window):
    """Over all ring steps and ranks, the packed ring's blocks see every (query, key) pair of a document
    that causal and a window let through exactly once, and nothing else: contiguous shares (documents
    crossing the shares' edges, one longer than several shares, an empty one) with windows, and the
    zigzag layout's chunks (without)."""
    size = 3
    lens = [6, 30, 0, 12, 18]  # 66 tokens: shares of 22; zigzag chunks of 1, 5, 0, 2, 3
    bounds, total = [0, *itertools.accumulate(lens)], sum(lens)
    expected = _packed_pairs_expected(lens, causal, window)
    seen = sum(_packed_pairs_seen(packed_steps(bounds, r, size, total // size, causal, 1.0, torch.device("cpu"),
                                               window=ring.window_bounds(window, causal)),
                                  lambda x: torch.arange(x * total // size, (x + 1) * total // size), r, size, total)
               for r in range(size))
    assert torch.equal(seen, expected)
    if window == (-1, -1):
        zigzag = [split_packed(torch.arange(total), bounds, size, "zigzag")[r] for r in range(size)]
        seen = sum(_packed_pairs_seen(zigzag_packed_steps(bounds, r, size, causal, 1.0, torch.device("cpu")),
                                      lambda x: zigzag[x], r, size, total) for r in range(size))
        assert torch.equal(seen, expected)


def test_packed_zigzag_balances_the_causal_work():
    """Under a causal mask, the zigzag layout gives every rank the same work on packed documents (the
    visible pairs of its blocks over all steps), where contiguous shares give a document longer than a
    share to the later ranks."""
    size, lens = 4, [8 * 64, 8 * 4, 0, 8 * 12]
    bounds = [0, *itertools.accumulate(lens)]

    def work(blocks):
        total = 0
        for step in blocks:
            for _, _, params in step:
                n = params.cu_seqlens_q.diff().long()
                total += int((n * (n + 1) // 2).sum() if params.window_right == 0 else (n * n).sum())
        return total
    zigzag = [work(zigzag_packed_steps(bounds, r, size, True, 1.0, torch.device("cpu"))) for r in range(size)]
    assert len(set(zigzag)) == 1 and zigzag[0] * size == sum(n * (n + 1) // 2 for n in lens)
    contiguous = [work(packed_steps(bounds, r, size, sum(lens) // size, True, 1.0, torch.device("cpu")))
                  for r in range(size)]
    assert max(contiguous) > 1.5 * min(contiguous)


def test_split_packed_and_join_packed():
    x = torch.arange(24)
    cu = [0, 8, 8, 24]  # documents of 8, 0 and 16 tokens: chunks of 2 and 4 on 2 ranks
    shards = split_packed(x, cu, 2, "zigzag")
    assert shards[0].tolist() == [0, 1, 8, 9, 10, 11, 6, 7, 20, 21, 22, 23]
    assert shards[1].tolist() == [2, 3, 12, 13, 14, 15, 4, 5, 16, 17, 18, 19]
    assert torch.equal(join_packed(shards, torch.tensor(cu), "zigzag"), x)
    assert torch.equal(join_packed(split_packed(x, cu, 2, "contiguous"), cu, "contiguous"), x)
    with pytest.raises(cuflash.FlashAttentionError, match="document 0 .* 6 tokens"):
        split_packed(x, [0, 6, 24], 2, "zigzag")


def test_auto_mode_takes_the_all_to_all_only_where_it_led():
    """mode="auto" on a 1-D mesh: the all-to-all for whole sequences up to ULYSSES_MAX_TOKENS whose
    head counts divide among the ranks; the ring for longer ones or where a head count does not divide.
    A call the ring cannot run (packed cross-attention) takes the all-to-all at any length where the heads divide."""
    assert auto_mode(32, 8, ULYSSES_MAX_TOKENS, 2) == "ulysses"
    assert auto_mode(32, 8, 2 * ULYSSES_MAX_TOKENS, 2) == "ring"
    assert auto_mode(32, 8, 1024, 16) == "ring"  # 8 KV heads among 16 ranks
    assert auto_mode(30, 10, 1024, 4) == "ring"
    assert auto_mode(32, 8, 2 * ULYSSES_MAX_TOKENS, 2, ring_can=False) == "ulysses"
    assert auto_mode(30, 10, 1024, 4, ring_can=False) == "ring"  # which then raises naming what it cannot run


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_over_a_device_mesh(world):
    _run(world, "mesh")


@pytest.mark.parametrize("check", ["mismatch", "odd_zigzag", "ulysses_heads"])
def test_bad_shards_raise_on_every_rank(check):
    _run(2, check)


def test_shard_shapes_are_gathered_once_per_signature():
    """check_shards' all-gather (and its host read) runs for a signature it has not checked, not in
    every call (every layer)."""
    _run(2, "checked_once")


def test_transformers_context_parallel_attention_honours_every_option():
    """register_context_parallel's attention: sliding_window, softcap, is_causal and packed
    sequences give what the one-process attention gives; dropout, and what a mode cannot run, raise."""
    pytest.importorskip("transformers")
    _run(2, "transformers_cp")


@pytest.mark.parametrize("fn", [ring_flash_attn_func, ulysses_flash_attn_func])
def test_needs_a_process_group(fn):
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(cuflash.FlashAttentionError) as info:
        fn(q, q, q)
    assert "init_process_group" in str(info.value)


def test_zigzag_shard_layout():
    x = torch.arange(8).view(1, 8)
    assert zigzag_shard(x, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert zigzag_shard(x, 1, 2).tolist() == [[2, 3, 4, 5]]
    with pytest.raises(cuflash.FlashAttentionError):
        zigzag_shard(torch.arange(6).view(1, 6), 0, 2)


def test_fsdp2_context_parallel_example_matches_one_process(tmp_path):
    """examples/train_llama_cp.py at toy size: a transformers Llama under FSDP2 with cuflash context
    parallelism over 2 processes (torchrun, gloo), through the all-to-all and through the ring (which
    sends the model's transposed K/V views), gives the loss of the one-process run at every step
    (three optimizer steps at a learning rate that moves the toy's loss: the gradients agree too); so
    do packed documents cut into zigzag shards (context_parallel_shard with cu_seqlens) through the ring."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parents[1] / "examples" / "train_llama_cp.py"
    env = dict(os.environ, CUFLASH_BACKEND="cpu", OMP_NUM_THREADS="1")
    runs = {"one": [sys.executable, str(example)],
            "cp2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(example), "--cp", "2"]}
    runs["cp2_ring"] = runs["cp2"] + ["--cp-mode", "ring"]
    docs = ["--batch", "1", "--doc-len", "24"]  # documents of 24, 24 and 16 tokens in each row
    runs["one_docs"] = runs["one"] + docs
    runs["cp2_zigzag_docs"] = runs["cp2"] + docs + ["--cp-mode", "ring", "--layout", "zigzag"]
    losses = {}
    for name, command in runs.items():
        out = tmp_path / f"{name}.json"
        done = subprocess.run(command + ["--device", "cpu", "--lr", "1e-2", "--out", str(out)], env=env,
                              timeout=DEADLINE_S, capture_output=True, text=True)
        assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        losses[name] = json.loads(out.read_text())
    assert len(losses["one"]) == 3
    for one, cp, cp_ring in zip(losses["one"], losses["cp2"], losses["cp2_ring"]):
        assert abs(one - cp) < 1e-5 * abs(one) and abs(one - cp_ring) < 1e-5 * abs(one), losses
    for one, cp in zip(losses["one_docs"], losses["cp2_zigzag_docs"]):  # packed documents, zigzag shards
        assert abs(one - cp) < 1e-5 * abs(one), losses


def test_cp_bench_runs_and_writes_its_table(tmp_path):
    """scripts/cp_bench.py (the multi-GPU benchmark) at toy size on the CPU: its correctness check
    passes and it writes one CSV row per mode and length."""
    import csv
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "scripts" / "cp_bench.py"
    env = dict(os.environ, CUFLASH_BACKEND="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(bench), "--device", "cpu", "--tokens", "160,256", "--heads", "4", "--kv-heads", "2",
                           "--dim", "16", "--check-tokens", "64", "--modes", "ring,ulysses,packed,packed_zigzag",
                           "--doc-tokens", "40", "--ref-tokens", "64", "--out", str(tmp_path)],
                          env=env, timeout=DEADLINE_S, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [line for line in done.stdout.splitlines() if "vs one process" in line]
    assert len(errors) == 4 and all(float(e) < 1e-5 for line in errors for e in line.split()[-7::2]), errors
    rows = list(csv.DictReader(open(tmp_path / "cp_bench.csv")))
    # 160 packed tokens: four 40-token documents, two in each share (one ring step, nothing exchanged);
    # 256: a document crosses the shares' edge (two steps). Cut into chunks, every document meets every rank.
    assert [(r["mode"], r["tokens"], r["layout"], r["ring_steps"]) for r in rows] == [
        ("ring", "160", "zigzag", "2"), ("ring", "256", "zigzag", "2"), ("ulysses", "160", "zigzag", "1"),
        ("ulysses", "256", "zigzag", "1"), ("packed", "160", "contiguous", "1"), ("packed", "256", "contiguous", "2"),
        ("packed_zigzag", "160", "zigzag", "2"), ("packed_zigzag", "256", "zigzag", "2")]
    assert float(rows[4]["exchange_ms"]) == 0.0 and float(rows[5]["exchange_ms"]) > 0.0
    best = {float(r["one_gpu_16k_tflops_fwdbwd"]) for r in rows}
    assert len(best) == 1 and best.pop() > 0  # measured once per run
    for r in rows:
        assert float(r["efficiency_vs_16k_fwdbwd"]) == \
            pytest.approx(float(r["tflops_per_gpu_fwdbwd"]) / float(r["one_gpu_16k_tflops_fwdbwd"]))
