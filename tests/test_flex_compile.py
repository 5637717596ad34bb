"""score_mod, mask_mod and block masks under torch.compile(fullgraph=True) (mods/compiled.py): the custom
ops take them packed, with no graph break and no recompilation per call of the same mods; forward and
gradients (q, k, v and a learnable bias table the score_mod captures) against the eager calls and the
float64 oracles of test_flex.py and test_flash_mods.py. Then what is guarded (captured numbers and
functions), what runs eagerly (mods made in the compiled function), errors, and the ops themselves."""
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention import flex_attention as torch_flex
from torch.utils._python_dispatch import TorchDispatchMode

import cuflash
import test_flash_mods as flash
from cuflash import ErrorCode, FlashAttentionError, ops
from cuflash.mods import Packed
from cuflash.mods.compiled import EAGER_REASON
from cuflash.params import AttentionParams
from test_flex import BOUND, EXACT, document, oracle, relative_bias, softcap

from attn_testing import rel_err

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

MOST = 56  # the longest sequence of these tests: the captured tables cover it


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own compilations, and compiles them: no graph from torch's caches on disk,
    whose keys do not cover the custom ops' Python (their autograd among it)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def run(fn, tensors: list, captured: list, dout: torch.Tensor | None = None) -> list:
    """[out, then the gradients of tensors and captured] of fn(*tensors) for the gradient dout."""
    for t in tensors + captured:
        t.grad = None
    out = fn(*tensors)
    out.backward(torch.ones_like(out) if dout is None else dout)
    return [out.detach()] + [t.grad for t in tensors + captured]


def agree(ours: list, theirs: list, bound: float) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv", "table"), ours, theirs):
        assert rel_err(a, b) < bound, f"{name}: {rel_err(a, b):.3g}"


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_flex_attention_compiles(backend, compiler):
    """A learnable relative bias (score_mod) and a document mask (a block mask made outside), grouped
    heads: fullgraph, outputs and gradients as eager and as the oracle; three lengths compile twice
    (the second length makes the dims dynamic, as torch does by default), the third reuses that."""
    if compiler == "inductor" and backend == "triton":
        pytest.skip("inductor's graph around the op is the same for both backends (the interpreter is slow)")
    dtype = EXACT[backend]
    torch.manual_seed(0)
    table = torch.randn(2, 2 * MOST - 1, dtype=dtype, requires_grad=True)
    score_mod = relative_bias(table, MOST)
    docs = torch.randint(0, 3, (1, MOST)).sort(-1).values
    counter = CompileCounterWithBackend(compiler)

    def attention(q, k, v, block_mask):
        return cuflash.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    compiled = torch.compile(attention, fullgraph=True, backend=counter)
    for seqlen, compiles in ((24, 1), (40, 2), (56, 2)):
        q = torch.randn(1, 2, seqlen, 16, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 1, seqlen, 16, dtype=dtype, requires_grad=True) for _ in range(2))
        block_mask = cuflash.create_block_mask(document(docs), 1, None, seqlen, seqlen, device="cpu", BLOCK_SIZE=16)
        dout = torch.randn_like(q)
        ours = run(lambda *t: compiled(*t, block_mask), [q, k, v], [table], dout)
        assert counter.frame_count == compiles
        agree(ours, run(lambda *t: attention(*t, block_mask), [q, k, v], [table], dout), BOUND[dtype])
        refs = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
        expected = run(lambda *t: oracle(*t, score_mod=relative_bias(refs[3], MOST), mask_mod=document(docs))[0],
                       refs[:3], refs[3:], dout.double())
        agree(ours, expected, BOUND[dtype])


def test_torch_block_mask_under_compile():
    """A BlockMask made by torch's create_block_mask (outside the compiled function) works as cuflash's."""
    docs = torch.randint(0, 3, (1, 40)).sort(-1).values
    block_mask = torch_flex.create_block_mask(document(docs), 1, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    compiled = torch.compile(cuflash.flex_attention, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, block_mask=block_mask), cuflash.flex_attention(q, k, v, block_mask=block_mask))


def test_flash_attn_func_compiles(backend):
    """flash_attn_func with a learnable score_mod, a mask_mod, causal and attention_chunk (a built-in
    mod made in the graph), and flash_attn_varlen_func with them per sequence (the chunk's offsets a
    tensor): fullgraph, as the oracle and as eager, no recompilation for a third length."""
    dtype = EXACT[backend]
    torch.manual_seed(1)
    table = torch.randn(2, 2 * MOST - 1, dtype=dtype, requires_grad=True)
    options = dict(causal=True, score_mod=flash.relative_bias(table, MOST), mask_mod=flash.stripes, attention_chunk=8)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(functools.partial(cuflash.flash_attn_func, **options), fullgraph=True, backend=counter)
    for seqlen, compiles in ((24, 1), (40, 2), (56, 2)):
        q = torch.randn(1, seqlen, 2, 16, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, seqlen, 1, 16, dtype=dtype, requires_grad=True) for _ in range(2))
        ours = run(compiled, [q, k, v], [table])
        assert counter.frame_count == compiles
        agree(ours, run(functools.partial(cuflash.flash_attn_func, **options), [q, k, v], [table]), BOUND[dtype])
        refs = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
        expected = run(lambda *t: flash.oracle(*t, **dict(options, score_mod=flash.relative_bias(refs[3], MOST)))[0],
                       refs[:3], refs[3:])
        agree(ours, expected, BOUND[dtype])
    q, k, v, cu_q, cu_k = flash.varlen_batch([9, 30, 1], [17, 30, 4], 2, 1, 16, dtype, "cpu")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    varlen = functools.partial(cuflash.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30,
                               max_seqlen_k=30, **dict(options, mask_mod=flash.prefix_lm(torch.tensor([3, 0, 2]))))
    ours = run(torch.compile(varlen, fullgraph=True, backend="aot_eager"), leaves, [table])
    agree(ours, run(varlen, leaves, [table]), BOUND[dtype])


def test_lse_gradient_under_compile():
    """return_lse's lse is differentiable under torch.compile as eagerly (its gradient joins the
    backward op's), the bias table's gradient with it."""
    torch.manual_seed(4)
    table = torch.randn(2, 47, dtype=torch.float64, requires_grad=True)
    score_mod = relative_bias(table, 24)
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    weights = torch.linspace(-1, 1, 24, dtype=torch.float64)

    def loss(q, k, v):
        out, lse = cuflash.flex_attention(q, k, v, score_mod=score_mod, return_lse=True)
        return out.sum(-1) + lse * weights
    ours = run(torch.compile(loss, fullgraph=True, backend="aot_eager"), [q, k, v], [table])
    assert all(torch.equal(a, b) for a, b in zip(ours, run(loss, [q, k, v], [table])))


class _Attention(torch.nn.Module):
    """A projection and attention with a learnable relative bias: the score_mod made once, in __init__,
    over the parameter (a mod made in forward would be made in the compiled graph)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.bias = torch.nn.Parameter(torch.randn(2, 2 * MOST - 1) / 4)
        self.score_mod = flash.relative_bias(self.bias, MOST)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).unbind(2)
        return cuflash.flash_attn_func(q, k, v, causal=True, score_mod=self.score_mod).flatten(2)


def test_a_module_with_a_learnable_bias():
    """torch.compile(model, fullgraph=True): the parameters' gradients (the bias table's among them) as
    eager, for three lengths, compiled twice."""
    torch.manual_seed(3)
    model = _Attention()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for seqlen, compiles in ((20, 1), (36, 2), (50, 2)):
        x = torch.randn(2, seqlen, 32)
        grads = []
        for fn in (compiled, model):
            model.zero_grad()
            fn(x).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        assert counter.frame_count == compiles
        assert model.bias.grad.abs().sum() > 0
        for ours, theirs in zip(*grads):
            assert rel_err(ours, theirs) < BOUND[torch.float32]


def test_captures_are_guarded():
    """The graph reads a mod's captures: a new tensor of the same kind compiles nothing; a new captured
    number (lifted, or baked in where the mod branches on it), a captured function swapped for another
    or a tensor of another dtype compiles again, never reusing a graph made for other captures."""
    q, k, v = (torch.randn(1, 24, 2, 16) for _ in range(3))

    def window(size):
        def mask(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < size if size > 0 else q_idx >= kv_idx  # (branches on size: baked in)
        return mask

    def both(first, second):
        return lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def anti(b, h, q_idx, kv_idx):
        return q_idx <= kv_idx

    def bias(table):
        return lambda score, b, h, q_idx, kv_idx: score + table[h]

    counter = CompileCounterWithBackend("aot_eager")
    attention = functools.partial(cuflash.flash_attn_func, q, k, v)
    compiled = torch.compile(attention, fullgraph=True, backend=counter)
    compiles = []
    for score_mod, mask_mod in ((softcap(2.0), None), (softcap(3.0), None), (None, window(5)), (None, window(0)),
                                (None, both(causal, window(4))), (None, both(anti, window(4))),
                                (bias(torch.randn(2)), None), (bias(torch.randn(2)), None),
                                (bias(torch.randn(2, dtype=torch.float64)), None)):
        ours = compiled(score_mod=score_mod, mask_mod=mask_mod)
        assert torch.equal(ours, attention(score_mod=score_mod, mask_mod=mask_mod))
        compiles.append(counter.frame_count)
    assert compiles[7] == compiles[6]  # a new bias table of the same kind
    assert len(set(compiles[:7])) == 7 and compiles[8] > compiles[7]


def test_mods_that_run_eagerly():
    """Mods made in the compiled function (Dynamo gives no access to their closure), a partial, one
    reading a tensor through another object, and return_attn_probs with mods run eagerly: with
    fullgraph=True torch.compile says why, without it the call is a graph break and gives the eager
    result. create_block_mask too."""
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    table = torch.randn(2)
    holder = torch.nn.Linear(1, 2)

    def made_inside(q, k, v, table):
        return cuflash.flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + table[h])

    def partial_mod(q, k, v, table):
        return cuflash.flex_attention(q, k, v, score_mod=functools.partial(lambda s, b, h, i, j, t: s + t[h], t=table))

    def held_bias(score, b, h, q_idx, kv_idx):  # (made outside, but its tensor is an attribute of a module)
        return score + holder.bias[h]

    def through_object(q, k, v, table):
        return cuflash.flex_attention(q, k, v, score_mod=held_bias)

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 3

    def probabilities(q, k, v, table):  # (the probabilities' mods are computed eagerly only)
        return cuflash.flash_attn_func(q, k, v, causal=True, mask_mod=near, return_attn_probs=True)[2]

    def block_mask_inside(q, k, v, table):
        mask = cuflash.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 24, 24, "cpu")
        return cuflash.flex_attention(q, k, v, block_mask=mask)

    cases = ((made_inside, EAGER_REASON), (partial_mod, EAGER_REASON), (through_object, EAGER_REASON),
             (probabilities, EAGER_REASON), (block_mask_inside, "cuflash.create_block_mask runs eagerly"))
    for fn, reason in cases:
        with pytest.raises(torch._dynamo.exc.Unsupported, match=reason[:40]):
            torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, table)
        assert torch.equal(torch.compile(fn, backend="aot_eager")(q, k, v, table), fn(q, k, v, table))


def test_errors_under_compile():
    """A mod the kernels cannot compute raises in the graph (torch.compile(fullgraph=True) shows the
    message; without fullgraph the call runs eagerly and raises FlashAttentionError); a read outside a
    captured tensor at the call's sizes raises FlashAttentionError when the compiled call runs."""
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))

    def cumulative(score, b, h, q_idx, kv_idx):
        return score.cumsum(0)

    def attention(q, k, v):
        return cuflash.flex_attention(q, k, v, score_mod=cumulative)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="calls cumsum"):
        torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v)
    with pytest.raises(FlashAttentionError, match="calls cumsum"):
        torch.compile(attention, backend="aot_eager")(q, k, v)
    too_short = relative_bias(torch.randn(2, 30), 16)
    short = torch.compile(lambda q, k, v: cuflash.flex_attention(q, k, v, score_mod=too_short), fullgraph=True,
                          backend="aot_eager")
    with pytest.raises(FlashAttentionError, match="with values from -8 to 38 for this call's sizes"):
        short(q, k, v)


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it, calls take the custom ops without torch.compile."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_custom_ops_with_mods():
    """The ops with packed mods: torch.library.opcheck (schema, fake implementations, autograd
    registration, AOT dispatch of the forward), the same results and gradients as the eager path
    through them without torch.compile, and a layout naming a graph this process never traced."""
    torch.manual_seed(2)
    table = torch.randn(2, 2 * 24 - 1, dtype=torch.float64, requires_grad=True)
    docs = torch.randint(0, 3, (1, 24)).sort(-1).values
    block_mask = cuflash.create_block_mask(document(docs), None, None, 24, 24, device="cpu", BLOCK_SIZE=8)
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def attention(q, k, v):
        return cuflash.flex_attention(q, k, v, score_mod=relative_bias(table, 24), block_mask=block_mask)
    eager = run(attention, [q, k, v], [table])
    with _PassThrough():
        assert all(torch.equal(a, b) for a, b in zip(run(attention, [q, k, v], [table]), eager))
    from cuflash.flex import _mods
    params = AttentionParams(0.25, bottom_right=False, mods=_mods(relative_bias(table, 24), block_mask, 1, 2, 24, 24,
                                                                  q.device))
    args = (*(t.transpose(1, 2) for t in (q, k, v)), *ops.op_args(params))
    assert all(result == "SUCCESS" for result in torch.library.opcheck(torch.ops.cuflash.fwd.default, args).values())
    out, lse = ops.attention_forward(*args)
    backward_args = (torch.randn_like(out), *(t.detach() for t in args[:3]), out, lse, None, *args[3:])
    checks = torch.library.opcheck(torch.ops.cuflash.bwd.default, backward_args,
                                   test_utils=("test_schema", "test_faketensor"))  # (no double backward)
    assert all(result == "SUCCESS" for result in checks.values())
    with pytest.raises(FlashAttentionError, match="no mod graph 'score-0123' was traced in this process") as error:
        Packed("score-0123;;;", [], []).unpack()
    assert error.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_flex_attention_compiles_on_gpu(compiler):
    """The GPU kernels (Gluon on Hopper) under torch.compile(fullgraph=True): a learnable relative bias and
    a document block mask of 128-key blocks, bf16, outputs and gradients (the table's too) as eager's."""
    torch.manual_seed(0)
    seqlen = 512
    table = torch.randn(2, 2 * seqlen - 1, device="cuda", requires_grad=True)
    score_mod = relative_bias(table, seqlen)
    docs = torch.randint(0, 3, (1, seqlen), device="cuda").sort(-1).values
    block_mask = cuflash.create_block_mask(document(docs), 1, None, seqlen, seqlen, device="cuda")

    def attention(q, k, v):
        return cuflash.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    compiled = torch.compile(attention, fullgraph=True, backend=compiler)
    q, k, v = (torch.randn(1, 2, seqlen, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    agree(run(compiled, [q, k, v], [table], dout), run(attention, [q, k, v], [table], dout), 1e-2)
