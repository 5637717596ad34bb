"""The op layer: torch.compile(fullgraph=True) over attention and a decode step (aot_eager on the
CPU, inductor on the GPU), gradcheck through the eager path and the custom op, and the two agreeing."""
import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cuflash
from attn_testing import make_qkv, run_and_grad



class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it, calls take the custom ops instead of the eager
    autograd.Function (ops.bypasses_custom_op)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("custom_op", [False, True], ids=["eager", "custom_op"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64_cpu_path(monkeypatch, causal, custom_op):
    """Both autograd paths, including gradcheck's undefined output gradients (none is materialized)."""
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    torch.manual_seed(10)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 5, 7, 2, 1, 4, dtype=torch.float64, device="cpu"))
    with _PassThrough() if custom_op else contextlib.nullcontext():
        assert torch.autograd.gradcheck(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), (q, k, v))


@pytest.mark.parametrize("custom_op", [False, True], ids=["eager", "custom_op"])
def test_gradcheck_of_the_lse_cpu_path(monkeypatch, custom_op):
    """softmax_lse is differentiable through both autograd paths: out and lse together, and lse alone."""
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    torch.manual_seed(11)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 5, 7, 4, 2, 4, dtype=torch.float64, device="cpu"))

    def attention(a, b, c):
        return cuflash.flash_attn_func(a, b, c, causal=True, return_attn_probs=True)[:2]
    with _PassThrough() if custom_op else contextlib.nullcontext():
        assert torch.autograd.gradcheck(attention, (q, k, v))
        assert torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c)[1], (q, k, v))


class _Block(torch.nn.Module):
    """A projection and cuflash attention with the given options, flattened back."""

    def __init__(self, **options):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.options = options

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).unbind(2)
        return cuflash.flash_attn_func(q, k, v, **self.options).flatten(2)


def check_compiled(device, backend, **options):
    """torch.compile(fullgraph=True): no graph break (fullgraph raises on one), forward and backward
    equal to eager, and no recompilation on later calls with the same shapes."""
    torch.manual_seed(11)
    model = _Block(**options).to(device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    # inductor draws random numbers its own way unless told to fall back to torch's (dropout's seed)
    with torch._inductor.config.patch(fallback_random=True):
        for step in range(3):
            x = torch.randn(2, 13, 32, device=device)
            torch.compiler.set_stance("fail_on_recompile" if step > 0 else "default")
            try:
                torch.manual_seed(step)  # the same dropout draw for both runs
                out = compiled(x)
                out.sum().backward()
            finally:
                torch.compiler.set_stance("default")
            grad = model.qkv.weight.grad.clone()
            model.zero_grad()
            torch.manual_seed(step)
            eager = model(x)
            eager.sum().backward()
            assert torch.allclose(out, eager, atol=1e-5)
            assert torch.allclose(grad, model.qkv.weight.grad, atol=1e-4)
            model.zero_grad()


@pytest.mark.parametrize("options", [dict(causal=True),
                                     dict(causal=True, window_size=(5, 0), alibi_slopes="slopes", softcap=8.0,
                                          dropout_p=0.2)], ids=["plain", "variants"])
def test_torch_compile_fullgraph_cpu_path(monkeypatch, options):
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    if options.get("alibi_slopes") == "slopes":
        options = dict(options, alibi_slopes=torch.tensor([0.5, 0.25]))
    check_compiled("cpu", "aot_eager", **options)


def test_eager_path_and_the_custom_op_agree(backend, monkeypatch):
    """Plain eager calls bypass the custom op (ops.bypasses_custom_op) and give the custom op's results and
    gradients, and refuse a double backward as the op does; FakeTensorMode and meta tensors still go
    through the op (its fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from cuflash import ops
    from cuflash.params import AttentionParams
    q, k, v = make_qkv(1, 19, 23, 4, 2, 16, dtype=torch.float32, device="cpu")
    params = AttentionParams(0.25, window_right=0)
    assert ops.bypasses_custom_op(q)
    direct = run_and_grad(lambda *t: ops.forward(*t, params)[0], q, k, v, torch.ones(1, 19, 4, 16))
    through_op = run_and_grad(lambda *t: ops.attention_forward(*t, *ops.op_args(params))[0], q, k, v,
                              torch.ones(1, 19, 4, 16))
    for a, b in zip(direct, through_op):
        assert torch.equal(a, b)
    # create_graph=True works; differentiating the gradients again raises (not: counts them as constants)
    qg = q.clone().requires_grad_()
    grad, = torch.autograd.grad(ops.forward(qg, k, v, params)[0].sum(), qg, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (grad.sum() + qg.sum()).backward()
    with FakeTensorMode():
        fake = torch.empty(1, 19, 4, 16)
        assert not ops.bypasses_custom_op(fake)
        assert ops.forward(fake, fake, fake, params)[0].shape == (1, 19, 4, 16)
    monkeypatch.setenv("CUFLASH_BACKEND", "auto")  # meta tensors: shapes only, whatever the backend
    assert cuflash.flash_attn_func(*(t.to("meta") for t in (q, q, q))).device.type == "meta"


def check_decode_compiled(device, backend, paged):
    """A decode step (rotary, append into the cache, attend) under torch.compile(fullgraph=True):
    no graph break, the same output and cache contents as eager, no recompilation when only the
    values of cache_seqlens change."""
    torch.manual_seed(12)
    batch, nheads, nheads_k, d = 2, 4, 2, 32
    if paged:
        k_cache = torch.randn(8, 16, nheads_k, d, device=device)
        table = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32, device=device)
    else:
        k_cache, table = torch.randn(batch, 48, nheads_k, d, device=device), None
    v_cache = torch.randn_like(k_cache)
    angles = torch.rand(64, d // 2, device=device) * 6.28
    cos, sin = angles.cos(), angles.sin()

    def step(q, k, v, k_cache, v_cache, cache_seqlens):
        return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=cache_seqlens, block_table=table, causal=True,
                                               return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for i, lengths in enumerate(([5, 17], [30, 2], [0, 40])):
        q = torch.randn(batch, 1, nheads, d, device=device)
        k, v = (torch.randn(batch, 1, nheads_k, d, device=device) for _ in range(2))
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        caches = (k_cache.clone(), v_cache.clone())
        torch.compiler.set_stance("fail_on_recompile" if i > 0 else "default")
        try:
            out, lse = compiled(q, k, v, *caches, seqlens)
        finally:
            torch.compiler.set_stance("default")
        eager_caches = (k_cache.clone(), v_cache.clone())
        ref, ref_lse = step(q, k, v, *eager_caches, seqlens)
        assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
        assert torch.equal(caches[0], eager_caches[0]) and torch.equal(caches[1], eager_caches[1])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_compiles_fullgraph_cpu_path(monkeypatch, paged):
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    check_decode_compiled("cpu", "aot_eager", paged)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window_size=(5, 0), softcap=8.0,
                                                             dropout_p=0.2)], ids=["plain", "variants"])
def test_torch_compile_fullgraph_inductor(options):
    """A block with attention under torch.compile(fullgraph=True) with inductor: forward and
    backward equal to eager, no recompilation (check_compiled)."""
    check_compiled("cuda", "inductor", **options)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_compiles_fullgraph_inductor(paged):
    """A decode step (rotary, append, the decode custom op) under torch.compile(fullgraph=True) with
    inductor (check_decode_compiled)."""
    check_decode_compiled("cuda", "inductor", paged)


def test_compiling_warns_of_no_cache_wrapper(monkeypatch):
    """Dynamo traces through a functools.lru_cache wrapper, ignoring the cache, and warns that this may
    be silently wrong: nothing on the path of a compiled call is such a wrapper (the backend choice
    is kept in a plain table outside compiled code)."""
    monkeypatch.setenv("CUFLASH_BACKEND", "cpu")
    torch._dynamo.reset()  # (dynamo warns of each call site once per process)
    q, k, v = make_qkv(1, 9, 9, 2, 2, 16, dtype=torch.float32, device="cpu")
    compiled = torch.compile(lambda *t: cuflash.flash_attn_func(*t, causal=True), fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(q, k, v)
    assert torch.equal(out, cuflash.flash_attn_func(q, k, v, causal=True))
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_backend_choice_queries_the_driver_once(monkeypatch):
    """Outside compiled code the backend choice is kept: the driver is asked once per device."""
    from cuflash.backend import backend_name
    queries = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: queries.append(device) or (9, 0))
    monkeypatch.setenv("CUFLASH_BACKEND", "auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda", 7)  # (a device no other test asks about)
    assert [backend_name(device, torch.float16) for _ in range(3)] == ["triton"] * 3
    assert queries == [device]
