"""The mod mechanism (cuflash.mods): tracing a FlexAttention-style mod, its Triton code against torch's
own evaluation of the mod, the kernels with mods and a block mask against a float64 oracle, and the
errors a mod the kernels cannot compile raises before any kernel runs."""
import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import cuflash
from cuflash import ops
from cuflash.kernels import attention as kernel_attention
from cuflash.mods import BlockSparsity, Mod, Mods
from cuflash.kernels.triton import mods as mod_code
from cuflash.mods.evaluate import evaluate
from cuflash.mods.trace import trace
from cuflash.params import AttentionParams

from attn_testing import interpret, rel_err

# Mods over every op family the tracer takes; captures of every kind (a tensor table, document ids,
# Python numbers, a number the mod branches on).
BIAS = torch.randn(4, 64)
DOCS = torch.tensor([0] * 10 + [1] * 30 + [2] * 24)
SLOPE = 0.25
WINDOW = 8


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + 32]


def chained_index(score, b, h, q_idx, kv_idx):
    return score + BIAS[h][(q_idx * 3 + kv_idx) % 64]


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPE * (q_idx - kv_idx).abs()


def learnable_alibi(score, b, h, q_idx, kv_idx):  # a captured slope times index arithmetic
    return score - BIAS[h, 0] * (q_idx - kv_idx).abs()


def clipped_distance(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx).clamp(-5, 5) * 0.5 + torch.maximum(-q_idx, kv_idx - 40)


def tanh_of_indices(score, b, h, q_idx, kv_idx):  # tanh of an integer expression
    return score + torch.tanh(q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def math_ops(score, b, h, q_idx, kv_idx):
    x = torch.sigmoid(score) * torch.exp(score / 4) + torch.maximum(score, BIAS[h, kv_idx % 64])
    y = torch.sqrt(score.abs() + 1) - torch.log1p(score.abs()) + torch.clamp(score, -1.0, 2.0) ** 2
    z = (q_idx // 3 - kv_idx % 5).float() + torch.remainder(q_idx - kv_idx, 7) - torch.div(q_idx - 20, 6,
                                                                                            rounding_mode="trunc")
    return x + y + z + torch.where(q_idx > kv_idx, torch.cos(score), torch.sin(score)) - (-score).relu()


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def window(b, h, q_idx, kv_idx):
    if WINDOW > 0:  # a branch on a captured number: baked into the code
        return (q_idx - kv_idx).abs() <= WINDOW
    return q_idx >= 0


def logic(b, h, q_idx, kv_idx):
    return torch.logical_or((h == 1) & (kv_idx % 3 == 0), ~(q_idx < kv_idx)) ^ (b == 1)


SCORE_MODS = [rel_bias, chained_index, alibi, learnable_alibi, clipped_distance, tanh_of_indices, softcap,
              math_ops]
MASK_MODS = [document, window, logic]


def _indices(rows: int, cols: int, b: int = 1, h: int = 2):
    i32 = torch.int32
    return (torch.tensor(b, dtype=i32), torch.tensor(h, dtype=i32), torch.arange(rows, dtype=i32)[:, None],
            torch.arange(cols, dtype=i32)[None, :])


def _vmapped(fn, score, b, h, q, kv):
    """The mod as FlexAttention computes it: called on 0-dim tensors under vmap."""
    inner = torch.vmap(fn, in_dims=(0, None, None, None, 0) if score is not None else (None, None, None, 0))
    outer = torch.vmap(inner, in_dims=(0, None, None, 0, None) if score is not None else (None, None, 0, None))
    return outer(*(() if score is None else (score,)), b, h, q[:, 0], kv[0])


@pytest.mark.parametrize("fn", SCORE_MODS + MASK_MODS, ids=lambda f: f.__name__)
def test_evaluated_graph_matches_the_mod_under_vmap(fn):
    kind = "score" if fn in SCORE_MODS else "mask"
    traced, tensors, scalars = trace(fn, kind)
    score = torch.randn(17, 40) * 4 if kind == "score" else None
    idx = _indices(17, 40)
    got = evaluate(traced.graph, ((score,) if kind == "score" else ()) + idx, tensors, scalars)
    want = _vmapped(fn, score, *idx)
    assert got.dtype == want.dtype
    if got.dtype.is_floating_point:  # (torch's vectorized exp, sqrt, ... under vmap may differ by an ulp)
        torch.testing.assert_close(got, want, rtol=3e-7, atol=0)
    else:
        assert torch.equal(got, want)


@triton.jit
def _apply(S, Out, DS, G, b, h, args, grads, MOD: tl.constexpr, GRAD: tl.constexpr, M: tl.constexpr,
           N: tl.constexpr):
    q = tl.arange(0, M)[:, None]
    kv = tl.arange(0, N)[None, :]
    if GRAD is None:  # a mask_mod
        tl.store(Out + q * N + kv, tl.broadcast_to(MOD(b, h, q, kv, args).to(tl.float32), (M, N)))
    else:
        s = tl.load(S + q * N + kv)
        tl.store(Out + q * N + kv, MOD(s, b, h, q, kv, args))
        tl.store(DS + q * N + kv, GRAD(s, b, h, q, kv, args, tl.load(G + q * N + kv), grads))


@interpret
@pytest.mark.parametrize("fn", SCORE_MODS + MASK_MODS, ids=lambda f: f.__name__)
def test_triton_code_matches_torch_and_its_gradient(fn):
    """The mod's Triton function (interpreted) against torch on the same graph, and its backward
    against torch autograd: the score's gradient and a captured table's (added atomically)."""
    kind = "score" if fn in SCORE_MODS else "mask"
    table = BIAS.clone().requires_grad_()
    traced, tensors, scalars = trace(fn, kind)
    tensors = [table if t is BIAS else t for t in tensors]
    m, n = 16, 32
    idx = _indices(m, n)
    score = (torch.randn(m, n) * 4).requires_grad_()
    out, ds, grad = torch.empty(m, n), torch.empty(m, n), torch.randn(m, n)
    needed = tuple(t.requires_grad for t in tensors)
    buffers = [torch.zeros(t.shape) for t in tensors if t.requires_grad]
    gradient = mod_code.backward_function(traced.graph, needed) if kind == "score" else None
    _apply[(1,)](score.detach(), out, ds, grad, 1, 2, mod_code.kernel_args(tensors, scalars),
                 mod_code.grad_args(buffers), mod_code.forward_function(traced.graph), gradient, m, n)
    ref = evaluate(traced.graph, ((score,) if kind == "score" else ()) + idx, tensors, scalars)
    if kind == "mask":
        assert torch.equal(out.bool(), ref)
        return
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    wanted = torch.autograd.grad(ref, [score] + [t for t in tensors if t.requires_grad], grad)
    torch.testing.assert_close(ds, wanted[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(buffers, wanted[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_traces_are_cached_by_what_the_mod_computes():
    def make(table, slope):
        def mod(score, b, h, q_idx, kv_idx):
            return score * slope + table[h]
        return mod

    first, t1, s1 = trace(make(torch.zeros(4), 0.5), "score")
    second, t2, s2 = trace(make(torch.ones(4), 2.0), "score")  # a new closure: same code, new captures
    assert second is first  # not traced again
    assert s1 == [0.5] and s2 == [2.0]  # the numbers are arguments, read at each call
    assert torch.equal(t2[0], torch.ones(4))

    def same(score, b, h, q_idx, kv_idx):
        return score * SLOPE + BIAS[h, 0]

    def same_again(s, b, h, q, k):  # another function, other names, the same computation: one kernel
        return s * SLOPE + BIAS[h, 0]
    assert trace(same, "score")[0].graph.key == trace(same_again, "score")[0].graph.key
    assert trace(same, "score")[0].graph.key != first.graph.key
    assert mod_code.forward_function(trace(same, "score")[0].graph) is \
        mod_code.forward_function(trace(same_again, "score")[0].graph)


def test_composed_mods_compute_one_after_the_other():
    """Mod.then (softcap and ALiBi around a user's score_mod, builtin_mods.resolved): one graph whose
    value is the second mod's of the first's, with both's captures, made once per pair."""
    first, second = Mod.of(softcap, "score"), Mod.of(rel_bias, "score")
    both = first.then(second)
    assert both.graph is first.then(second).graph
    assert both.tensors == first.tensors + second.tensors and both.scalars == first.scalars + second.scalars
    score = torch.randn(6, 9) * 30
    b, h, q, kv = _indices(6, 9)
    expected = _vmapped(rel_bias, _vmapped(softcap, score, b, h, q, kv), b, h, q, kv)
    got = evaluate(both.graph, (score, b, h, q, kv), list(both.tensors), list(both.scalars))
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, _vmapped(softcap, _vmapped(rel_bias, score, b, h, q, kv), b, h, q, kv))


@pytest.mark.parametrize("fn, gathers", [(rel_bias, True), (chained_index, True), (math_ops, True),
                                         (document, True), (alibi, False), (learnable_alibi, False),
                                         (softcap, False), (window, False), (logic, False)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_graph_knows_whether_it_reads_a_tensor_per_score(fn, gathers):
    """ModGraph.gathers (plan.py buffers fewer stages for those): a load indexed by q_idx or kv_idx."""
    assert Mod.of(fn, "mask" if fn in MASK_MODS else "score").graph.gathers is gathers


@pytest.mark.parametrize("mod, kind, message", [
    (lambda s, b, h, q, k: torch.cumsum(s, 0), "score", "calls cumsum"),
    (lambda s, b, h, q, k: s if q > k else -s, "score", "control flow"),
    (lambda s, b, h, q, k: q + k, "score", "returns a torch.int32 value"),
    (lambda b, h, q, k: q - k, "mask", "returns a bool"),
    (lambda s, b, h, q, k: s + BIAS[h], "score", "with 1 indices"),
    (lambda s, b, h, q, k: s + BIAS[h, 0:4], "score", "slices"),
    (lambda s, b, h, q, k: s + BIAS[h, s], "score", "indexes a captured tensor"),
    (lambda s, b, h, q, k: s ** s, "score", None),
])
def test_mods_the_kernels_cannot_compile_raise_naming_the_mod(mod, kind, message):
    with pytest.raises(cuflash.FlashAttentionError, match=r"mod '.*<lambda>'") as e:
        traced = trace(mod, kind)[0]
        mod_code.forward_function(traced.graph)
    assert message is None or message in str(e.value)


# ---------------------------------------------------------------------------------------------------
# The kernels with mods: the Triton kernels through the interpreter and on the GPU.

def _oracle(q, k, v, scale, score_mod, mask_mod):
    """float64 attention with the mods applied elementwise by broadcasting (B, H, L, S) index grids."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = (t.repeat_interleave(nheads // nheads_k, 1) for t in (kd, vd))
    s = qd @ kd.transpose(-1, -2) * scale
    b, h, i, j = (torch.arange(n, device=q.device).view(shape) for n, shape in (
        (batch, (-1, 1, 1, 1)), (nheads, (1, -1, 1, 1)), (seqlen_q, (1, 1, -1, 1)), (seqlen_k, (1, 1, 1, -1))))
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see no key: 0
    return (p @ vd).transpose(1, 2)


def _block_lists(mask_mod, batch, nheads, seqlen_q, seqlen_k, q_block, kv_block):
    """A BlockSparsity classifying each block of mask_mod (evaluated densely) as empty, partial or full."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(nheads)[None, :, None, None]
    i = torch.arange(seqlen_q)[None, None, :, None]
    j = torch.arange(seqlen_k)[None, None, None, :]
    dense = mask_mod(b, h, i, j).expand(batch, nheads, seqlen_q, seqlen_k)
    nq, nk = -(-seqlen_q // q_block), -(-seqlen_k // kv_block)
    padded = torch.zeros(batch, nheads, nq * q_block, nk * kv_block, dtype=torch.int32)
    padded[..., :seqlen_q, :seqlen_k] = dense.int()
    blocks = padded.view(batch, nheads, nq, q_block, nk, kv_block).sum((3, 5))
    area = torch.zeros_like(padded)
    area[..., :seqlen_q, :seqlen_k] = 1
    areas = area.view(batch, nheads, nq, q_block, nk, kv_block).sum((3, 5))
    full, partial = blocks == areas, (blocks > 0) & (blocks < areas)

    def lists(x):
        return x.sum(-1).int(), torch.argsort((~x).int(), dim=-1, stable=True).int()
    (kn, ki), (fkn, fki) = lists(partial), lists(full)
    (qn, qi), (fqn, fqi) = lists(partial.transpose(-1, -2)), lists(full.transpose(-1, -2))
    return BlockSparsity(q_block, kv_block, kn, ki, fkn, fki, qn, qi, fqn, fqi)


def _check_kernels(device, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, score_mod, mask_mod,
                   blocks, tol):
    torch.manual_seed(seqlen_q * 7 + seqlen_k)
    q, k, v, do = (torch.randn(batch, n, h, head_dim, device=device, dtype=dtype)
                   for n, h in ((seqlen_q, nheads), (seqlen_k, nheads_k), (seqlen_k, nheads_k), (seqlen_q, nheads)))
    table = torch.randn(nheads, 2 * max(seqlen_q, seqlen_k), device=device, requires_grad=True)
    center = max(seqlen_q, seqlen_k)

    def bias(score, b, h, i, j):
        return score_mod(score, b, h, i, j) + table[h, i - j + center]
    scale = 1 / math.sqrt(head_dim)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = _oracle(qd, kd, vd, scale, lambda s, b, h, i, j: bias(s, b, h, i, j).double(), mask_mod)
    want = torch.autograd.grad(ref, (qd, kd, vd, table), do.double())
    block_lists = None
    if blocks:
        block_lists = _block_lists(mask_mod, batch, nheads, seqlen_q, seqlen_k, *blocks)
        block_lists = BlockSparsity(*(x.to(device) if isinstance(x, torch.Tensor) else x
                                      for x in dataclasses.astuple(block_lists)))
    mods = Mods(score=Mod.of(bias, "score"), mask=None if mask_mod is None else Mod.of(mask_mod, "mask"),
                blocks=block_lists)
    params = AttentionParams(softmax_scale=scale, bottom_right=False, mods=mods)
    out, lse = ops.forward(q, k, v, params)
    buffer = torch.zeros(table.shape, device=device)
    grads = kernel_attention.attention_backward(do, q, k, v, out, lse, dataclasses.replace(
        params, mods=dataclasses.replace(mods, grads=(buffer,))))
    assert rel_err(out, ref) < tol
    for name, got, expected in zip(("dq", "dk", "dv", "table"), (*grads, buffer), want):
        assert rel_err(got, expected) < tol, name


def _plain(score, b, h, i, j):
    return score


def _causal_window(b, h, i, j):
    return (i >= j) & (i - j < 40)


def _documents(b, h, i, j):
    return (i // 24 == j // 24) & ((j % 5 != 2) | (h == 0))


def _case_id(case) -> str:
    *sizes, mask_mod, blocks = case
    return "-".join(map(str, sizes)) + f"-{getattr(mask_mod, '__name__', 'nomask')}-{blocks}"


KERNEL_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask_mod, blocks)
    (2, 100, 77, 4, 2, 32, _causal_window, (32, 32)),
    (1, 17, 17, 2, 1, 40, _documents, (16, 16)),
    (1, 1, 33, 2, 2, 16, None, None),
    (2, 64, 64, 2, 2, 64, _documents, None),
]


@interpret
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_triton_kernels_with_mods_and_block_masks(case, monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    _check_kernels("cpu", torch.float32, *case[:6], softcap, case[6], case[7], tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES + [(2, 1000, 1000, 8, 2, 128, _documents, (128, 128)),
                                                 (1, 300, 700, 4, 4, 256, _causal_window, (64, 128)),
                                                 (1, 513, 513, 2, 1, 96, _causal_window, (128, 64))],
                         ids=_case_id)
def test_triton_kernels_with_mods_on_gpu(case, dtype):
    _check_kernels("cuda", dtype, *case[:6], softcap, case[6], case[7], tol=2e-2 if dtype == torch.bfloat16 else 5e-3)


def test_reads_out_of_a_captured_tensor_raise_before_any_kernel_runs():
    table = torch.randn(4, 64)
    docs = torch.zeros(100, dtype=torch.long)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 32]

    def by_document(score, b, h, q_idx, kv_idx):  # an index read from another tensor: not bounded here
        return score + table[h, docs[q_idx]]
    mods = Mods(score=Mod.of(relative, "score"))
    mods.check(batch=2, nheads=4, seqlen_q=32, seqlen_k=32)  # q - kv + 32 in [1, 63]
    with pytest.raises(cuflash.FlashAttentionError, match=r"'.*relative' indexes dimension 1 .* from 1 to 64"):
        mods.check(batch=2, nheads=4, seqlen_q=33, seqlen_k=32)
    with pytest.raises(cuflash.FlashAttentionError, match=r"indexes dimension 0 .* from 0 to 4"):
        mods.check(batch=2, nheads=5, seqlen_q=32, seqlen_k=32)
    backwards = Mods(score=Mod.of(lambda s, b, h, q, k: s + table[h, q - k - 40], "score"))
    backwards.check(1, 4, 1, 25)  # from -64 to -40: negative indices count from the end
    with pytest.raises(cuflash.FlashAttentionError, match=r"from -65 to -40"):
        backwards.check(1, 4, 1, 26)
    Mods(score=Mod.of(lambda s, b, h, q, k: s + table[h, (q * 7 + k) % 64], "score")).check(1, 4, 999, 999)
    Mods(score=Mod.of(by_document, "score")).check(1, 4, 100, 100)
    Mods(mask=Mod.of(lambda b, h, q, k: docs[q] // 2 == docs[k] // 2, "mask")).check(1, 4, 100, 100)  # unbounded
