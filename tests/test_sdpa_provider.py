"""cuflash as torch's SDPA flash backend provider (cuflash/integrations/sdpa.py).

CPU: the registration, activation and restore through torch's registry; the message on a torch
without providers; the fallback to torch's kernel; the aten ops' implementations called on CPU tensors
(the CPU path) against the float64 oracle and torch's math SDPA, and the shapes and dtypes of their
outputs against torch's meta kernels; the same implementations registered for CPU tensors and reached
through the dispatcher and torch's autograd (the op's derivative formula hands the forward's outputs
to the backward), varlen_attn among the callers. GPU (`gpu`): F.scaled_dot_product_attention,
the aten ops, varlen_attn and an unmodified transformers model with the provider active against
torch's own flash kernel; torch's context_parallel() on 2 GPUs is in test_distributed.py."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cuflash
from cuflash.dropout import head_ids, keep_mask
from cuflash.integrations import sdpa
from cuflash.reference import attention_reference
from cuflash.validate import MAX_HEAD_DIM

from attn_testing import count_plan_lookups, interpret, rel_err, varlen_reference

needs_hook = pytest.mark.skipif(not sdpa.available(), reason="this torch takes no SDPA providers")
aten = torch.ops.aten


@pytest.fixture
def restored():
    """Leaves torch's default flash implementation in place after the test."""
    yield
    if sdpa.available():
        attention.restore_flash_attention_impl(_raise_warn=False)


@contextlib.contextmanager
def on_cpu_tensors():
    """The provider's implementations registered for CPU tensors too (torch has no CPU kernel of these
    ops), so that the dispatcher and autograd reach them as they reach the CUDA override."""
    library = torch.library.Library("aten", "IMPL", "CPU")
    try:
        for name, impl in sdpa.IMPLS.items():
            if hasattr(aten, name):
                library.impl(name, impl, "CPU")
        yield
    finally:
        library._destroy()


@needs_hook
def test_registered_on_import_and_not_activated():
    assert sdpa.NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != sdpa.NAME
    assert cuflash.sdpa_provider_available()


def _cuda_kernel_source(name: str) -> str:
    return "".join(line for line in torch._C._dispatch_dump(f"aten::{name}").splitlines() if line.startswith("CUDA:"))


@needs_hook
def test_activate_overrides_the_ops_and_restore_gives_them_back(restored):
    """Activation overrides the ops and puts the flash backend first in SDPA's priority order (torch
    2.11 on Hopper prefers cuDNN, and SDPA calls would never reach the provider); restore gives both back."""
    before = {name: _cuda_kernel_source(name) for name in sdpa.IMPLS if hasattr(aten, name)}
    assert all("sdpa.py" not in source for source in before.values())
    flash, cudnn = (int(b) for b in (attention.SDPBackend.FLASH_ATTENTION, attention.SDPBackend.CUDNN_ATTENTION))
    sdpa._settle_default_priority()  # (on a GPU: torch's own default first, which a later choice would set)
    default_priority = torch._C._get_sdp_priority_order()
    users = [cudnn] + [b for b in default_priority if b != cudnn]  # a user's own order, flash not first
    torch._C._set_sdp_priority_order(users)
    try:
        cuflash.activate_sdpa_provider()
        assert attention.current_flash_attention_impl() == sdpa.NAME
        assert all("integrations/sdpa.py" in _cuda_kernel_source(name) for name in before)
        assert torch._C._get_sdp_priority_order() == [flash] + [b for b in users if b != flash]
        attention.activate_flash_attention_impl(sdpa.NAME)  # again: torch restores first, the override is redone
        assert all("integrations/sdpa.py" in _cuda_kernel_source(name) for name in before)
        assert torch._C._get_sdp_priority_order()[0] == flash
        attention.restore_flash_attention_impl()
        assert attention.current_flash_attention_impl() is None
        assert {name: _cuda_kernel_source(name) for name in before} == before
        assert torch._C._get_sdp_priority_order() == users
        cuflash.activate_sdpa_provider()  # an order the user sets while it is active stays theirs
        torch._C._set_sdp_priority_order(default_priority)
        attention.restore_flash_attention_impl()
        assert torch._C._get_sdp_priority_order() == default_priority
    finally:
        torch._C._set_sdp_priority_order(default_priority)


def test_a_torch_without_providers_says_so(monkeypatch):
    monkeypatch.delattr(attention, "register_flash_attention_impl", raising=False)
    assert not cuflash.sdpa_provider_available()
    assert not sdpa.register()
    with pytest.raises(cuflash.FlashAttentionError, match=r"no SDPA backend providers.*2\.10") as info:
        cuflash.activate_sdpa_provider()
    assert info.value.code == cuflash.ErrorCode.UNSUPPORTED_FEATURE


class _TorchKernel:
    """Stands in for torch's CUDA kernel of an op: records its calls."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keys, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "torch's"


def _bhnd(b, h, n, d, dtype=torch.float32):
    return torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2)  # as a model's projections give them


def test_calls_cuflash_does_not_take_run_torchs_kernel(monkeypatch):
    kernels = {name: _TorchKernel() for name in sdpa.IMPLS}
    monkeypatch.setattr(sdpa, "TORCH_KERNELS", kernels)
    q = _bhnd(1, 2, 8, 16)
    strided = torch.randn(1, 2, 8, 32)[..., ::2]
    big = _bhnd(1, 2, 8, MAX_HEAD_DIM + 8)
    cases = [((q, q, q, 0.0, False, True), {}), ((q, q, q, 1.0), {}), ((strided, q, q), {}), ((big, big, big), {}),
             ((q, q, q.to(torch.float16)), {}), ((q[0], q[0], q[0]), {})]
    for args, kwargs in cases:
        assert sdpa.sdpa_forward(*args, **kwargs) == "torch's"
    args, _ = kernels["_scaled_dot_product_flash_attention"].calls[0]
    assert args[5] is True  # (return_debug_mask, passed on as given)
    flash = q.transpose(1, 2)
    slopes = torch.ones(2)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = flash[0]
    used = torch.ones(1, dtype=torch.int32)
    cases = [((flash, None), dict(alibi_slopes=slopes)), ((flash, None), dict(seqused_k=used)),  # dense: no seqused
             ((packed, cu), dict(block_table=torch.zeros(1, 1, dtype=torch.int32)))]
    for (t, cum), kwargs in cases:
        assert sdpa.flash_forward(t, t, t, cum, cum, 8, 8, 0.0, False, False, **kwargs) == "torch's"
        (name, value), = kwargs.items()
        assert kernels["_flash_attention_forward"].calls[-1][1][name] is value
    for cum in (cu.long(), cu[None]):  # prefix sums torch's kernel refuses: its error, not ours
        assert sdpa.flash_forward(packed, packed, packed, cum, cum, 8, 8, 0.0, False, False) == "torch's"
    out = torch.empty_like(packed)
    assert sdpa.flash_forward_into(out, packed, packed, packed, cu, cu, 8, 8, 0.1, False, False) == "torch's"
    assert sdpa.sdpa_backward(q, q, q, q, q, torch.zeros(1, 2, 8), None, None, 8, 8, 0.0, False, cu, cu,
                              scale=None) != "torch's"  # taken: the call is cuflash's
    assert sdpa.sdpa_backward(q.double(), q, q, q, q, torch.zeros(1, 2, 8), None, None, 8, 8, 0.0, False, cu, cu) \
        == "torch's"  # a grad_out of another dtype


@interpret
def test_a_repeated_sdpa_call_runs_its_kept_launch_plan(monkeypatch):
    """The SDPA op's forward keeps its launch plans per call signature (memo.remembered) as
    cuflash.scaled_dot_product_attention does: a repeat with new data looks nothing up; new options
    (scale, is_causal) make plans of their own."""
    from cuflash.kernels import attention as kernels
    looked_up = count_plan_lookups(monkeypatch, kernels)
    query, key, value = (_bhnd(1, 2, 24, 16) for _ in range(3))
    first = sdpa.sdpa_forward(query, key, value, 0.0, True)[0]
    assert looked_up == ["attention_forward"]
    assert torch.equal(sdpa.sdpa_forward(query, key, value, 0.0, True)[0], first)
    again = [t + 1 for t in (query, key, value)]
    sdpa.sdpa_forward(*again, 0.0, True)
    assert looked_up == ["attention_forward"]
    sdpa.sdpa_forward(*again, 0.0, True, scale=0.5)
    assert looked_up == ["attention_forward"] * 2


def test_without_a_torch_kernel_the_fallback_says_so(monkeypatch):
    monkeypatch.setattr(sdpa, "TORCH_KERNELS", {})
    q = _bhnd(1, 2, 8, 16)
    with pytest.raises(cuflash.FlashAttentionError, match="no CUDA kernel"):
        sdpa.sdpa_forward(q, q, q, 0.0, False, True)


def _visible(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """FlashAttention-2's mask: bottom-right aligned causal and window, (Nq, Nk) bool."""
    rows, cols = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q, torch.arange(seqlen_k)[None]
    left, right = window[0], 0 if causal else window[1]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if right >= 0:
        keep &= cols <= rows + right
    if left >= 0:
        keep &= cols >= rows - left
    return keep


def _math_sdpa(query, key, value, keep, scale=None):
    """torch's math SDPA in float64 (B, H, N, D), rows that see no key 0."""
    out = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=keep, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return torch.nan_to_num(out, 0.0)


SDPA_CASES = [  # (batch, heads, heads_k, seqlen_q, seqlen_k, head_dim, causal)
    (2, 4, 4, 17, 17, 16, True), (1, 4, 2, 33, 70, 40, True), (2, 6, 2, 70, 33, 32, True),
    (1, 2, 1, 1, 29, 96, True), (2, 3, 3, 40, 25, 24, False)]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: "x".join(map(str, c)))
def test_sdpa_op_against_torchs_math_sdpa(case, backend):
    """aten::_scaled_dot_product_flash_attention and its backward as cuflash computes them: output,
    logsumexp and gradients against torch's math SDPA and the float64 oracle, with torch's own
    (FlashAttention-2) causal alignment, bottom-right; GQA; the outputs' shapes, dtypes and the
    undefined cum_seq as torch's meta kernel gives them."""
    batch, heads, heads_k, seqlen_q, seqlen_k, head_dim, causal = case
    torch.manual_seed(sum(case))
    query, key, value = (_bhnd(batch, h, n, head_dim) for h, n in ((heads, seqlen_q), (heads_k, seqlen_k),
                                                                    (heads_k, seqlen_k)))
    outputs = sdpa.sdpa_forward(query, key, value, 0.0, causal, scale=0.3)
    meta = aten._scaled_dot_product_flash_attention(*(t.to("meta") for t in (query, key, value)), 0.0, causal,
                                                    scale=0.3)
    for ours, theirs in zip(outputs, meta):
        if isinstance(theirs, torch.Tensor):
            assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
        else:
            assert ours == theirs
    out, lse = outputs[:2]
    keep = _visible(seqlen_q, seqlen_k, causal)
    leaves = [t.double().requires_grad_() for t in (query, key, value)]
    expected = _math_sdpa(*leaves, keep, scale=0.3)
    assert rel_err(out, expected) < 1e-5
    _, ref_lse = attention_reference(*(t.transpose(1, 2) for t in leaves), 0.3, causal)
    assert torch.allclose(lse.double(), ref_lse.detach(), atol=1e-5)
    grad_out = torch.randn_like(out)
    expected.backward(grad_out.double())
    grads = sdpa.sdpa_backward(grad_out, query, key, value, out, lse, *outputs[2:6], 0.0, causal, *outputs[6:8],
                               scale=0.3)
    for ours, leaf in zip(grads, leaves):
        assert ours.shape == leaf.shape
        assert rel_err(ours, leaf.grad) < 1e-5


PACKED_CASES = [  # (lens_q, lens_k, heads, heads_k, causal, window)
    ([5, 17, 1], [5, 17, 1], 4, 2, True, (-1, -1)), ([9, 3, 12], [4, 20, 12], 2, 2, True, (3, -1)),
    ([8, 1, 6], [8, 7, 6], 3, 1, False, (2, 1)), ([7, 11], [7, 11], 2, 2, False, (-1, -1))]


@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}h{c[3]}-{c[4]}-{c[5]}")
def test_flash_attention_forward_packed_and_dense(case, backend):
    """aten::_flash_attention_forward / _backward: packed sequences (cum_seq_q, cum_seq_k; logsumexp
    (H, total_q)) with is_causal and windows aligned bottom-right in each sequence, GQA, against the
    oracle one sequence at a time; the dense (B, N, H, D) form of one of them the same; shapes and
    dtypes as torch's meta kernel's."""
    lens_q, lens_k, heads, heads_k, causal, window = case
    torch.manual_seed(len(lens_q) + heads)
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), heads, 32)
    k, v = (torch.randn(sum(lens_k), heads_k, 32) for _ in range(2))
    args = (cu_q, cu_k, max(lens_q), max(lens_k), 0.0, causal, False)
    options = dict(scale=None, window_size_left=window[0], window_size_right=window[1])
    outputs = sdpa.flash_forward(q, k, v, *args, **options)
    meta = aten._flash_attention_forward(*(t.to("meta") for t in (q, k, v, cu_q, cu_k)), *args[2:], **options)
    assert [(t.shape, t.dtype) for t in outputs] == [(t.shape, t.dtype) for t in meta]
    out, lse = outputs[:2]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = varlen_reference(*leaves, cu_q.tolist(), cu_k.tolist(), causal=causal, window_size=window)
    assert rel_err(out, expected) < 1e-5
    grad_out = torch.randn_like(out)
    expected.backward(grad_out.double())
    grads = sdpa.flash_backward(grad_out, q, k, v, out, lse, *args[:6], *outputs[2:4], **options)
    for ours, leaf in zip(grads, leaves):
        assert rel_err(ours, leaf.grad) < 1e-5
    n_q, n_k = lens_q[0], lens_k[0]  # dense: the first sequence as a batch of one
    dense = sdpa.flash_forward(q[None, :n_q], k[None, :n_k], v[None, :n_k], None, None, n_q, n_k, 0.0, causal, False,
                               **options)
    assert rel_err(dense[0][0], expected[:n_q].detach()) < 1e-5
    assert dense[1].shape == (1, heads, n_q)


class _CuflashOps(TorchDispatchMode):
    """Records the cuflash custom ops called under it, each as {argument name: value}: under a dispatch
    mode the provider's calls take the custom ops (ops.bypasses_custom_op), as under torch.compile."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "cuflash":
            self.calls.append((func._schema.name, dict(zip((a.name for a in func._schema.arguments), args))))
        return func(*args, **(kwargs or {}))


def test_translation_through_cuflashs_custom_ops(backend):
    """The aten call's options land on the custom ops' arguments of their names (learnable_sink None:
    torch's ops have no sink), and the backward op's (dq, dk, dv, [dsink], captured) comes back as the
    aten backward's three gradients, the same as the direct path's."""
    torch.manual_seed(17)
    lens = [9, 3, 12]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v, grad_out = (torch.randn(sum(lens), h, 16) for h in (4, 2, 2, 4))
    args = (cu, cu, 12, 12, 0.0, True, False)
    options = dict(scale=0.25, window_size_left=3, window_size_right=-1)
    direct = sdpa.flash_forward(q, k, v, *args, **options)
    direct_grads = sdpa.flash_backward(grad_out, q, k, v, *direct[:2], *args[:6], *direct[2:4], **options)
    with _CuflashOps() as log:
        outputs = sdpa.flash_forward(q, k, v, *args, **options)
        grads = sdpa.flash_backward(grad_out, q, k, v, *outputs[:2], *args[:6], *outputs[2:4], **options)
    assert [name for name, _ in log.calls] == ["cuflash::fwd", "cuflash::bwd"]
    for _, call in log.calls:
        assert call["learnable_sink"] is None and call["alibi_slopes"] is None and call["attn_mask"] is None
        assert (call["softmax_scale"], call["window_left"], call["window_right"]) == (0.25, 3, 0)
        assert call["cu_seqlens_q"] is cu and (call["max_seqlen_q"], call["max_seqlen_k"]) == (12, 12)
    assert len(grads) == 3
    for ours, theirs in zip((*outputs[:2], *grads), (*direct[:2], *direct_grads)):
        assert torch.equal(ours, theirs)


def test_packed_seqused_k(backend):
    """seqused_k of a packed call: sequence b attends to its first seqused_k[b] keys only, causal
    aligned to them (FlashAttention-2's and -3's semantics, cuflash's varlen seqused_k)."""
    torch.manual_seed(16)
    lens = [9, 14, 5]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    used = torch.tensor([4, 14, 0], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), 2, 16) for _ in range(3))
    out = sdpa.flash_forward(q, k, v, cu, cu, 14, 14, 0.0, True, False, seqused_k=used)[0]
    bounds = cu.tolist()
    for b, n in enumerate(used.tolist()):
        rows = slice(bounds[b], bounds[b + 1])
        keys = slice(bounds[b], bounds[b] + n)
        expected, _ = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=True)
        assert rel_err(out[rows], expected[0]) < 1e-5 if n else not out[rows].any()


def test_flash_forward_into_writes_the_output(backend):
    q = torch.randn(20, 2, 16)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = sdpa.flash_forward_into(out, q, q, q, cu, cu, 12, 12, 0.0, True, False)
    expected, expected_lse = sdpa.flash_forward(q, q, q, cu, cu, 12, 12, 0.0, True, False)[:2]
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def test_dropout_backward_regenerates_the_forwards_mask(backend):
    """The forward's rng_state carries cuflash's dropout seed (uint64 words) to the backward: out and
    the gradients match the oracle with the keep mask that seed draws."""
    torch.manual_seed(11)
    batch, heads, heads_k, seqlen, head_dim, p = 2, 4, 2, 24, 16, 0.3
    query, key, value = (_bhnd(batch, h, seqlen, head_dim) for h in (heads, heads_k, heads_k))
    outputs = sdpa.sdpa_forward(query, key, value, p, True)
    out, lse, rng_state = outputs[0], outputs[1], outputs[6]
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    seed = rng_state.view(torch.int64)
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None]
    keep = keep_mask(seed, head_ids(0, batch, heads, "cpu")[..., None, None], rows, cols, p)
    leaves = [t.transpose(1, 2).double().requires_grad_() for t in (query, key, value)]
    expected, _ = attention_reference(*leaves, causal=True, dropout_p=p, dropout_keep=keep)
    assert rel_err(out.transpose(1, 2), expected) < 1e-5
    grad_out = torch.randn_like(out)
    expected.backward(grad_out.transpose(1, 2).double())
    grads = sdpa.sdpa_backward(grad_out, query, key, value, out, lse, *outputs[2:6], p, True, *outputs[6:8])
    for ours, leaf in zip(grads, leaves):
        assert rel_err(ours.transpose(1, 2), leaf.grad) < 1e-5


def test_through_the_dispatcher_and_autograd():
    """The implementations registered as the provider registers them (here for CPU tensors) and
    reached through the dispatcher: autograd's formula of each op hands the forward's outputs to the
    backward (dropout's mask comes back the same); varlen_attn (torch's custom op over
    _flash_attention_forward / _backward) gives cuflash's results."""
    torch.manual_seed(12)
    query, key, value = (_bhnd(2, h, 19, 16).requires_grad_() for h in (4, 2, 2))
    with on_cpu_tensors():
        out = aten._scaled_dot_product_flash_attention(query, key, value, 0.2, True, scale=0.25)[0]
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (query, key, value), grad_out)
        torch.manual_seed(12)  # the same inputs and seed through cuflash's own SDPA
        leaves = [_bhnd(2, h, 19, 16).requires_grad_() for h in (4, 2, 2)]
        expected = cuflash.scaled_dot_product_attention(*leaves, dropout_p=0.2, is_causal=True, scale=0.25,
                                                        enable_gqa=True)
        assert torch.allclose(out, expected, atol=1e-6)
        for ours, theirs in zip(grads, torch.autograd.grad(expected, leaves, grad_out)):
            assert torch.allclose(ours, theirs, atol=1e-6)
        if not hasattr(attention, "varlen"):
            return
        from torch.nn.attention.varlen import varlen_attn
        q, k, v = (torch.randn(30, 2, 16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 11, 30], dtype=torch.int32)
        out = varlen_attn(q, k, v, cu, cu, 19, 19, window_size=(-1, 0))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = cuflash.flash_attn_varlen_func(*leaves, cu, cu, 19, 19, causal=True)
    assert torch.allclose(out, expected, atol=1e-6)
    for ours, theirs in zip(grads, torch.autograd.grad(expected, leaves, torch.ones_like(expected))):
        assert torch.allclose(ours, theirs, atol=1e-6)


# ---- GPU: with the provider active against torch's own flash kernel --------------------------------

def _cuflash_kernels_ran(fn) -> tuple[set, object]:
    """The CUDA kernel names a profiler saw while fn() ran, and fn()'s result."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}, result


def _fwd_bwd(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def _compare_with_torch_flash(fn, inputs, grad_out, tol):
    """fn's output and gradients with the provider active (cuflash's kernels, seen in a profile)
    against the same with torch's flash kernel (provider restored): relative difference under tol."""
    cuflash.activate_sdpa_provider()
    try:
        names, ours = _cuflash_kernels_ran(lambda: _fwd_bwd(fn, inputs, grad_out))
    finally:
        attention.restore_flash_attention_impl()
    assert any(n.startswith("_attn_fwd") for n in names) and any(n.startswith("_attn_bwd") for n in names), names
    assert not any("flash_fwd" in n or "flash_bwd" in n for n in names), names
    names, theirs = _cuflash_kernels_ran(lambda: _fwd_bwd(fn, inputs, grad_out))
    assert not any(n.startswith("_attn_") for n in names), names
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        err = rel_err(a, b)
        assert err < tol, f"{name}: {err:.2e} from torch's flash kernel"


def _flash_sdpa(*args, **kwargs):
    with attention.sdpa_kernel([attention.SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.gpu
@needs_hook
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 128), (1, 4, 4, 257, 64), (3, 6, 3, 77, 96), (2, 4, 1, 128, 36)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_sdpa_matches_torchs_flash(dtype, shape, causal, restored):
    batch, heads, heads_k, seqlen, head_dim = shape
    torch.manual_seed(seqlen)
    inputs = [torch.randn(batch, seqlen, h, head_dim, dtype=dtype, device="cuda").transpose(1, 2)
              for h in (heads, heads_k, heads_k)]
    grad_out = torch.randn(batch, heads, seqlen, head_dim, dtype=dtype, device="cuda")
    _compare_with_torch_flash(lambda q, k, v: _flash_sdpa(q, k, v, is_causal=causal, enable_gqa=heads != heads_k),
                              inputs, grad_out, 2e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@needs_hook
@pytest.mark.parametrize("seqlens", [(100, 300), (300, 100), (1, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_aten_ops_causal_alignment_and_windows(seqlens, restored):
    """The aten ops called directly as torch's context_parallel and varlen_attn call them: non-square
    causal (torch's kernel aligns it bottom-right) and windows, against torch's kernel."""
    seqlen_q, seqlen_k = seqlens
    torch.manual_seed(seqlen_q)
    q = torch.randn(2, 4, seqlen_q, 64, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 2, seqlen_k, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    grad_out = torch.randn_like(q)
    _compare_with_torch_flash(lambda a, b, c: aten._scaled_dot_product_flash_attention(a, b, c, 0.0, True)[0],
                              (q, k, v), grad_out, 2e-2)
    for window, causal in (((16, -1), True), ((8, 4), False)):
        def windowed(a, b, c, window=window, causal=causal):
            return aten._flash_attention_forward(a, b, c, None, None, seqlen_q, seqlen_k, 0.0, causal, False,
                                                 window_size_left=window[0], window_size_right=window[1])[0]
        _compare_with_torch_flash(windowed, [t.transpose(1, 2).contiguous() for t in (q, k, v)],
                                  grad_out.transpose(1, 2).contiguous(), 2e-2)


@pytest.mark.gpu
@needs_hook
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (32, 0)])
def test_gpu_varlen_attn(window, restored):
    from torch.nn.attention.varlen import varlen_attn
    torch.manual_seed(3)
    lens = [300, 17, 1000, 1]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    inputs = [torch.randn(sum(lens), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    grad_out = torch.randn_like(inputs[0])
    _compare_with_torch_flash(lambda q, k, v: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window),
                              inputs, grad_out, 2e-2)


@pytest.mark.gpu
@needs_hook
def test_gpu_dropout_is_cuflashs_and_its_backward_matches(restored):
    """Under the provider, F.scaled_dot_product_attention's dropout is cuflash's, its backward
    regenerating the forward's mask: the same seed drawn from torch's generator gives
    cuflash.scaled_dot_product_attention's output and gradients."""
    shape = (2, 4, 333, 64)
    inputs = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    grad_out = torch.randn_like(inputs[0])
    cuflash.activate_sdpa_provider()
    torch.manual_seed(5)
    ours = _fwd_bwd(lambda q, k, v: _flash_sdpa(q, k, v, dropout_p=0.25, is_causal=True), inputs, grad_out)
    attention.restore_flash_attention_impl()
    torch.manual_seed(5)
    theirs = _fwd_bwd(lambda q, k, v: cuflash.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True),
                      inputs, grad_out)
    for a, b in zip(ours, theirs):  # (another mask would differ by tens of percent; dQ's adds vary in order)
        assert rel_err(a, b) < 1e-2


ACTIVATE_FIRST = """
import torch, torch.nn.functional as F, cuflash
from torch.nn import attention
def kernels():
    q = torch.randn(1, 4, 256, 64, dtype=torch.bfloat16, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
cuflash.activate_sdpa_provider()  # before any SDPA call of the process
assert any(n.startswith("_attn_fwd") for n in kernels()), "not cuflash's"
attention.restore_flash_attention_impl()
assert not any(n.startswith("_attn_") for n in kernels()), "cuflash's after restore"
print("ok")
"""


@pytest.mark.gpu
@needs_hook
def test_gpu_activation_before_any_sdpa_call():
    """In a fresh process, activation before the first SDPA call: torch sets its default priority order
    on its first CUDA backend choice (cuDNN first on Hopper), which must not undo the provider's; plain
    SDPA calls run cuflash's kernels, and torch's own after restore."""
    src = str(Path(cuflash.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", ACTIVATE_FIRST], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.gpu
@needs_hook
def test_gpu_unmodified_transformers_model_trains_on_cuflash(restored):
    """A tiny Llama with attn_implementation="sdpa", unmodified: with the provider active its
    attention runs cuflash's kernels (a profile names them) and its losses over a few training steps
    match those without, within bf16 noise."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

    def train(provider: bool):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           dtype=torch.bfloat16).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        if provider:
            cuflash.activate_sdpa_provider()
        losses, names = [], set()
        try:
            for _ in range(4):
                ids = torch.randint(0, 256, (2, 384), generator=data).cuda()
                seen, loss = _cuflash_kernels_ran(lambda: _step(model, optimizer, ids))
                names |= seen
                losses.append(loss)
        finally:
            if provider:
                attention.restore_flash_attention_impl()
        return losses, names

    ours, names = train(True)
    assert any(n.startswith("_attn_fwd") for n in names) and any(n.startswith("_attn_bwd") for n in names), names
    theirs, names = train(False)
    assert not any(n.startswith("_attn_") for n in names), names
    assert all(abs(a - b) < 0.02 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)


def _step(model, optimizer, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
