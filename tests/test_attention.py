"""Correctness on the CPU: the blocked PyTorch path and the Triton kernels through the
interpreter, against the float64 oracle, through every public entry point."""


import pytest
import torch

import cuflash
from attn_testing import BOUNDS, GPU_DTYPES, check_against_oracle, dtype_cases, flash_fn, make_qkv, \
    rel_err, rising_qkv, run_and_grad, seed_of, varlen_batch, varlen_reference
from cuflash.params import AttentionParams
from cuflash.reference import attention_probs, attention_reference


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim): odd sizes, seqlen 1, seqlen_q != seqlen_k
# both ways, GQA and MQA, head dims that are not powers of two.
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 17, 17, 2, 2, 40),
    (1, 33, 70, 4, 2, 24),
    (1, 70, 33, 3, 1, 8),
    (2, 48, 48, 2, 1, 64),
    (1, 5, 29, 2, 2, 3),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_attn_func(backend, shape, causal, dtype):
    torch.manual_seed(seed_of(shape, causal))
    q, k, v = make_qkv(*shape, dtype=dtype, device="cpu")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)


@pytest.mark.parametrize("head_dim", [264, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dims_above_256(backend, head_dim, dtype):
    """Head dims 257-512 (the Triton kernels' 512-wide tiles, the CPU path's blocks): causal with seqlen_q !=
    seqlen_k, GQA, gradients."""
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(1, 21, 38, 2, 1, head_dim, dtype, "cpu")
    check_against_oracle(flash_fn(True), q, k, v, True)


@pytest.mark.parametrize("rise,jump", [(0.05, 0.0), (0.25, 0.0), (0.05, 20.0)], ids=["slow", "fast", "jump"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scores_rising_along_the_keys(backend, rise, jump, causal, dtype):
    """Each row's maximum moves at every key tile (by a few units of the exponent, by more than a tile's
    worth, or in one jump), so the output is rescaled (or its maximum kept) tile after tile. The forward
    only: that is where the running maximum lives (the backward reads the lse), and with most of a row's
    probability on its last keys dQ = dS K cancels (dP - delta near 0), which no fp32 computation meets
    the dtype's bound on."""
    torch.manual_seed(seed_of(rise, jump, causal))
    q, k, v = rising_qkv(1, 150, 300, 2, 32, dtype, "cpu", rise, 170, jump)
    check_against_oracle(flash_fn(causal), q, k, v, causal, grads=False)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs(backend, causal):
    torch.manual_seed(1)
    q, k, v = make_qkv(2, 19, 37, 4, 2, 32, dtype=torch.float32, device="cpu", layout="bhnd")
    assert not q.is_contiguous()
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)


def test_fp32_longer_sequence(backend):
    # Spans several tiles on both paths (the CPU path's tiles are 256 x 512).
    torch.manual_seed(2)
    n = 600 if backend == "cpu" else 100
    q, k, v = make_qkv(1, n, n + 7, 2, 1, 16, dtype=torch.float32, device="cpu")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True), q, k, v, True)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch(backend, causal):
    torch.manual_seed(3)
    query = torch.randn(2, 4, 21, 32)
    key = torch.randn(2, 2, 45, 32)
    value = torch.randn(2, 2, 45, 32)
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=0.3, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                              is_causal=causal, scale=0.3, enable_gqa=True)
    assert ours.shape == theirs.shape
    assert rel_err(ours, theirs) < 1e-5


def test_sdpa_two_three_and_five_dims(backend):
    """Inputs of any rank torch takes: (L, E) as one head, (H, L, E), and several batch dims; with a
    mask or causal over L != S."""
    torch.manual_seed(4)
    for shape in [(10, 16), (3, 10, 16), (2, 3, 2, 10, 16)]:
        query = torch.randn(shape)
        key, value = (torch.randn(*shape[:-2], 13, 16) for _ in range(2))
        mask = torch.rand(10, 13) > 0.3
        for options in (dict(), dict(is_causal=True), dict(attn_mask=mask)):
            ours = cuflash.scaled_dot_product_attention(query, key, value, **options)
            theirs = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                                      **options)
            assert ours.shape == shape
            assert rel_err(ours, theirs) < 1e-5, (shape, options)


def test_empty_inputs(backend):
    """Inputs with a dim of size 0 (but the head dim) give torch SDPA's results, output and q/k/v
    gradients shaped and valued as torch's (no key: out 0, gradients 0; no batch, head or query: empty),
    with GQA, causal, a mask, five dims and a value head dim other than query's; flash_attn_func gives
    flash-attn's for seqlen_k = 0 (out 0, softmax_lse +inf), and so do the packed and explicit passes."""
    torch.manual_seed(12)
    cases = [((0, 4, 5, 16), (0, 2, 7, 16), (0, 2, 7, 16), dict(enable_gqa=True)),
             ((2, 0, 5, 16), (2, 0, 7, 16), (2, 0, 7, 16), dict()),
             ((2, 4, 0, 16), (2, 4, 7, 16), (2, 4, 7, 16), dict(is_causal=True)),
             ((2, 4, 5, 16), (2, 4, 0, 16), (2, 4, 0, 16), dict(is_causal=True)),
             ((2, 4, 5, 16), (2, 2, 0, 16), (2, 2, 0, 16), dict(attn_mask=torch.ones(5, 0, dtype=torch.bool),
                                                               enable_gqa=True)),
             ((3, 0, 4, 5, 16), (3, 0, 4, 7, 16), (3, 0, 4, 7, 16), dict()),
             ((3, 5, 16), (3, 0, 16), (3, 0, 8), dict())]
    for shapes in cases:
        *tensors, options = shapes
        query, key, value = (torch.randn(*shape) for shape in tensors)
        dout = torch.randn(*query.shape[:-1], value.shape[-1])
        ours = run_and_grad_any(lambda a, b, c: cuflash.scaled_dot_product_attention(a, b, c, **options),
                                (query, key, value), dout)
        theirs = run_and_grad_any(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, **options),
                                  (query.double(), key.double(), value.double()), dout.double())
        for x, y in zip(ours, theirs):
            assert x.shape == y.shape and torch.equal(x.double(), y), shapes
    q, k, v = make_qkv(2, 6, 0, 4, 2, 16, torch.float32, "cpu")
    out, lse, probs = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(lse, torch.full((2, 4, 6), float("inf")))
    assert probs.shape == (2, 4, 6, 0)
    grads = run_and_grad_any(lambda a, b, c: cuflash.flash_attn_func(a, b, c), (q, k, v), torch.randn_like(q))[1:]
    assert all(torch.equal(g, torch.zeros_like(t)) for g, t in zip(grads, (q, k, v)))
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(cuflash.flash_attn_kvpacked_func(q, kv), torch.zeros_like(q))
    out, lse = cuflash.forward(q, k, v)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isinf(lse).all()
    dq, dk, dv = cuflash.backward(torch.randn_like(q), q, k, v, out, lse)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def run_and_grad_any(fn, inputs, dout):
    """fn's output and the gradients of its inputs (zeros where it has none, as torch gives for empty
    tensors)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


@pytest.mark.parametrize("value_dim", [8, 24])
def test_sdpa_value_head_dim_other_than_query(backend, value_dim):
    """value's head dim Ev other than query's E (torch allows it): output and gradients of q, k, v
    against torch in float64, with GQA, causal and the default scale (query's E)."""
    torch.manual_seed(8)
    query = torch.randn(2, 4, 11, 16, requires_grad=True)
    key = torch.randn(2, 2, 14, 16, requires_grad=True)
    value = torch.randn(2, 2, 14, value_dim, requires_grad=True)
    dout = torch.randn(2, 4, 11, value_dim)
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(ours, (query, key, value), dout)
    leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
    theirs = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    expected = torch.autograd.grad(theirs, leaves, dout.double())
    assert ours.shape == theirs.shape
    for name, x, r in zip(("out", "dq", "dk", "dv"), (ours, *grads), (theirs, *expected)):
        assert rel_err(x, r) < 1e-5, name


def test_packed_variants(backend):
    torch.manual_seed(5)
    qkv = torch.randn(2, 23, 3, 2, 16, requires_grad=True)
    out = cuflash.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.detach().double().unbind(2)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert rel_err(out, ref) < 1e-5
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attention_reference(q, k, v, causal=True)[0].backward(dout.double())
    assert rel_err(qkv.grad, torch.stack((q.grad, k.grad, v.grad), dim=2)) < 1e-5

    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    kv = torch.randn(2, 30, 2, 2, 16, requires_grad=True)
    out = cuflash.flash_attn_kvpacked_func(q, kv, softmax_scale=0.5)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, kv[:, :, 0], kv[:, :, 1]))
    ref, _ = attention_reference(q64, k64, v64, softmax_scale=0.5)
    assert rel_err(out, ref) < 1e-5
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    assert rel_err(q.grad, q64.grad) < 1e-5
    assert rel_err(kv.grad, torch.stack((k64.grad, v64.grad), dim=2)) < 1e-5


def test_return_attn_probs_and_lse(backend):
    torch.manual_seed(6)
    q, k, v = make_qkv(1, 20, 12, 2, 2, 16, dtype=torch.float32, device="cpu")
    out, lse, probs = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert lse.shape == (1, 2, 20) and lse.dtype == torch.float32
    assert probs.shape == (1, 2, 20, 12)
    # causal with seqlen_q > seqlen_k: the first 8 rows see no key: out 0, lse +inf (flash-attn 2).
    assert torch.equal(out[:, :8], torch.zeros_like(out[:, :8]))
    assert torch.isinf(lse[..., :8]).all() and (lse[..., :8] > 0).all()
    assert torch.allclose(lse[..., 8:].double(), ref_lse[..., 8:], atol=1e-5)
    # probs: the float64 softmax of the scaled scores under the bottom-right causal mask (key j is
    # visible to query i when j <= i + 12 - 20); rows that see no key are 0.
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 16 ** 0.5
    hidden = torch.arange(12)[None, :] > torch.arange(20)[:, None] - 8
    expected = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0)
    assert torch.allclose(probs.double(), expected, atol=1e-6)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, options): bottom-right alignment both ways, GQA and MQA,
# per-sequence and per-head slopes; the second leaves its first 16 rows no key.
PROBS_CASES = {
    "window_softcap_alibi_gqa": (2, 13, 29, 4, 2, dict(window_size=(5, 3), softcap=2.0, alibi=(2, 4))),
    "causal_window_alibi_mqa": (1, 29, 13, 2, 1, dict(causal=True, window_size=(4, -1), alibi=(2,))),
}


@pytest.mark.parametrize("case", PROBS_CASES)
def test_return_attn_probs_of_every_variant_are_the_oracles(case):
    """return_attn_probs, which the library computes (cpu.attention_probs), gives the float64
    oracle's probabilities under windows, softcap and ALiBi; rows that see no key are 0."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, options = PROBS_CASES[case]
    options = dict(options)
    torch.manual_seed(seed_of(case))
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, 16, torch.float32, "cpu")
    slopes = torch.rand(*options.pop("alibi"))
    _, _, probs = cuflash.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **options)
    expected, _ = attention_probs(q, k, alibi_slopes=slopes, **options)
    assert probs.shape == expected.shape and torch.allclose(probs.double(), expected, atol=1e-6)
    if options.get("causal"):
        assert torch.equal(probs[:, :, :16], torch.zeros_like(probs[:, :, :16]))


def test_fully_masked_rows_have_zero_finite_gradients(backend):
    torch.manual_seed(7)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 16, 4, 1, 1, 16, dtype=torch.float32, device="cpu"))
    out = cuflash.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all()
    assert torch.equal(q.grad[:, :12], torch.zeros_like(q.grad[:, :12]))


def test_explicit_forward_backward(backend):
    torch.manual_seed(8)
    q, k, v = make_qkv(2, 25, 31, 4, 2, 16, dtype=torch.float32, device="cpu")
    out, lse = cuflash.forward(q, k, v, causal=True)
    dout = torch.randn_like(out)
    dq, dk, dv = cuflash.backward(dout, q, k, v, out, lse, causal=True)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(qd, kd, vd, causal=True)
    ref.backward(dout.double())
    assert rel_err(out, ref) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-6
    for ours, theirs in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert ours.shape == theirs.shape
        assert rel_err(ours, theirs) < 1e-5


def _tiles_used(backend, monkeypatch) -> list[tuple[int, int]]:
    """Records the (query rows, keys) tiles the calls run with: the CPU path's score tiles, the
    Triton kernels' BLOCK_M x BLOCK_N launches (dK/dV's and dQ's too)."""
    seen = []
    if backend == "cpu":
        from cuflash import cpu
        scores = cpu.ScoreTiles.scores

        def spy(self, x, m0, m1, n0, n1, masked):
            seen.append((m1 - m0, n1 - n0))
            return scores(self, x, m0, m1, n0, n1, masked)
        monkeypatch.setattr(cpu.ScoreTiles, "scores", spy)
    else:
        from cuflash.kernels import attention

        def recording(key, tensors, build, _launch=attention.launch):
            launches = build()
            seen.extend((kw["BLOCK_M"], kw["BLOCK_N"]) for kernel, _, kw in launches if "BLOCK_N" in kw)
            return _launch(key, tensors, lambda: launches)
        monkeypatch.setattr(attention, "launch", recording)
    return seen


@pytest.mark.parametrize("blocks", [(16, 16), (32, 64), (128, 16)])
def test_explicit_passes_with_block_sizes(backend, monkeypatch, blocks):
    """block_m / block_n (the seed's Br, Bc) reach the CPU path's tiles and the kernels' launches,
    forward and backward, and the results stay exact; bad sizes raise naming the argument."""
    torch.manual_seed(seed_of(blocks))
    q, k, v = make_qkv(2, 70, 45, 4, 2, 24, dtype=torch.float32, device="cpu")
    seen = _tiles_used(backend, monkeypatch)
    block_m, block_n = blocks
    out, lse = cuflash.forward(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    dout = torch.randn_like(out)
    grads = cuflash.backward(dout, q, k, v, out, lse, causal=True, block_m=block_m, block_n=block_n)
    assert seen and all(m <= block_m and n <= block_n for m, n in seen)
    if backend == "cpu":  # (the band's edges cut some tiles narrower)
        assert any(m == min(block_m, 70) for m, _ in seen)
    else:
        assert (block_m, block_n) in seen
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, causal=True)
    ref.backward(dout.double())
    assert rel_err(out, ref) < 1e-5
    for ours, theirs in zip(grads, (qd.grad, kd.grad, vd.grad)):
        assert rel_err(ours, theirs) < 1e-5
    for bad in (dict(block_m=24, block_n=16), dict(block_m=16), dict(block_m=256, block_n=16)):
        with pytest.raises(cuflash.FlashAttentionError, match="block_"):
            cuflash.forward(q, k, v, **bad)


def test_deterministic_backward(backend):
    torch.manual_seed(9)
    q, k, v = make_qkv(1, 40, 40, 4, 1, 16, dtype=torch.float32, device="cpu")
    dout = torch.randn_like(q)
    out, lse = cuflash.forward(q, k, v)
    first = cuflash.backward(dout, q, k, v, out, lse)
    second = cuflash.backward(dout, q, k, v, out, lse)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_deterministic_reaches_the_params(monkeypatch):
    """flash_attn_func's and the explicit backward's deterministic, and torch.use_deterministic_algorithms
    for SDPA, reach AttentionParams (the fused Hopper backward is taken only without it)."""
    from cuflash import interface
    seen = []

    def record(name):
        def op(*args):
            params = next(a for a in args if isinstance(a, AttentionParams))
            seen.append((name, params.deterministic))
            return (args[1], None) if name == "fwd" else args[1:4]
        return op
    monkeypatch.setattr(interface.ops, "forward", record("fwd"))
    monkeypatch.setattr(interface.ops, "backward", record("bwd"))
    q = torch.randn(1, 5, 2, 16)
    lse = torch.zeros(1, 2, 5)
    cuflash.flash_attn_func(q, q, q)
    cuflash.flash_attn_func(q, q, q, deterministic=True)
    cuflash.backward(q, q, q, q, q, lse, deterministic=True)
    cuflash.scaled_dot_product_attention(q, q, q)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        cuflash.scaled_dot_product_attention(q, q, q)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [("fwd", False), ("fwd", True), ("bwd", True), ("fwd", False), ("fwd", True)]


def test_cuflash_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "fastest")
    q, k, v = make_qkv(1, 4, 4, 1, 1, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(cuflash.FlashAttentionError) as info:
        cuflash.flash_attn_func(q, k, v)
    assert info.value.code == cuflash.ErrorCode.INVALID_ARGUMENT and "CUFLASH_BACKEND" in str(info.value)


# A scale of 0 (uniform attention over the visible keys) and negative ones (the least similar keys
# weigh most), which flash-attn and torch SDPA take: with softcap, in which scale / softcap is folded.
SCALES = [(0.0, 0.0), (-0.7, 0.0), (-0.7, 3.0), (0.0, 3.0)]


@pytest.mark.parametrize("scale,softcap", SCALES)
@pytest.mark.parametrize("causal", [False, True])
def test_zero_and_negative_softmax_scale(backend, scale, softcap, causal):
    """flash_attn_func, forward and backward, against the float64 oracle (GQA, seqlen_q != seqlen_k:
    rows that see one key, several or none)."""
    torch.manual_seed(seed_of(scale, softcap, causal))
    q, k, v = make_qkv(2, 19, 13, 4, 2, 24, dtype=torch.float32, device="cpu")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, softmax_scale=scale, causal=causal,
                                                                  softcap=softcap),
                         q, k, v, causal, with_sdpa=False, softmax_scale=scale, softcap=softcap)


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_zero_and_negative_scale_varlen_and_sdpa(backend, scale):
    """The same scales through flash_attn_varlen_func (window too) and scaled_dot_product_attention,
    forward and backward, against the float64 oracle and torch SDPA's math backend in float64."""
    torch.manual_seed(seed_of(scale))
    q, k, v, cu_q, cu_k = varlen_batch([5, 1, 9], [7, 4, 9], 4, 2, 16, torch.float32, "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cuflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, 9, 9, softmax_scale=scale, causal=True,
                                         window_size=(3, -1))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = varlen_reference(*ref_leaves, cu_q.tolist(), cu_k.tolist(), softmax_scale=scale, causal=True,
                           window_size=(3, -1))
    expected = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *expected)):
        assert rel_err(x, r) < 1e-5, name

    query, key, value = (torch.randn(2, 4, 11, 16, requires_grad=True) for _ in range(3))
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    dout = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (query, key, value), dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
    # (torch's CPU flash kernel gives NaN for a scale <= 0 with is_causal; its math backend does not)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        theirs = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=True, scale=scale)
    expected = torch.autograd.grad(theirs, ref_leaves, dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), (ours, *grads), (theirs, *expected)):
        assert rel_err(x, r) < 1e-5, name


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_zero_and_negative_scale_with_kvcache(backend, scale):
    """flash_attn_with_kvcache (the decode kernel on the Triton backend) with the same scales, causal,
    after appending new tokens, against the float64 oracle over each sequence's filled cache."""
    torch.manual_seed(seed_of("kvcache", scale))
    q = torch.randn(2, 2, 4, 16)
    k_cache, v_cache = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    k_new, v_new = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    lengths = [3, 9]
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, causal=True, softmax_scale=scale,
                                          cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    for b, n in enumerate(lengths):
        ref, _ = attention_reference(q[b:b + 1], k_cache[b:b + 1, :n + 2], v_cache[b:b + 1, :n + 2],
                                     softmax_scale=scale, causal=True)
        assert torch.equal(k_cache[b, n:n + 2], k_new[b])
        assert rel_err(out[b:b + 1], ref) < 1e-5, b


@pytest.mark.parametrize("view", ["every_other", "transposed"])
def test_sdpa_takes_a_strided_head_dim(backend, view):
    """scaled_dot_product_attention takes inputs whose last dim is strided, as torch does (copied
    once), with gradients back through the views; flash_attn_func refuses them (test_errors.py)."""
    torch.manual_seed(seed_of(view))
    shape = (2, 4, 9, 32) if view == "every_other" else (2, 4, 16, 9)
    leaves = [torch.randn(shape, requires_grad=True) for _ in range(3)]

    def strided(t):  # (2, 4, 9, 16) views
        return t[..., ::2] if view == "every_other" else t.transpose(-1, -2)
    assert all(strided(t).stride(-1) != 1 for t in leaves)
    ours = cuflash.scaled_dot_product_attention(*map(strided, leaves), is_causal=True)
    dout = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    theirs = torch.nn.functional.scaled_dot_product_attention(*map(strided, ref_leaves), is_causal=True)
    expected = torch.autograd.grad(theirs, ref_leaves, dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), (ours, *grads), (theirs, *expected)):
        assert rel_err(x, r) < 1e-5, name


HEAD_DIMS = [32, 40, 64, 96, 128, 256, 320, 512]


SEQLENS = [1, 17, 128, 1000, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,seqlen", dtype_cases(SEQLENS, [17, 1000]), ids=str)
def test_against_oracle(dtype, causal, head_dim, seqlen):
    torch.manual_seed(seqlen * 1000 + head_dim)
    batch, nheads = (1, 2) if seqlen >= 1000 else (2, 4)
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype, "cuda")
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("rise,jump", [(0.02, 0.0), (0.1, 0.0), (0.02, 20.0)], ids=["slow", "fast", "jump"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scores_rising_along_the_keys_on_gpu(dtype, causal, head_dim, rise, jump):
    """The GPU kernels (the Gluon forward on Hopper, 64- and 128-key tiles) on scores whose row maxima
    move at every key tile: by a few units of the exponent a tile (slow), by more than the tile before
    (fast), or in one jump (the forward: test_scores_rising_along_the_keys says why)."""
    torch.manual_seed(seed_of(head_dim, rise, jump, causal))
    q, k, v = rising_qkv(1, 1500, 2000, 4, head_dim, dtype, "cuda", rise, 1100, jump)
    check_against_oracle(flash_fn(causal), q, k, v, causal, grads=False)


# fp32 user tiles: the 16-bit sizes but 32 x 32 for 64 x 32, and 128 x 128 only where it is refused
# before any compile (D=256): IEEE fp32 dots of larger tiles compile for minutes (docs/tuning.md).
EXPLICIT_BLOCKS = [(dtype, head_dim, blocks) for dtype in GPU_DTYPES for head_dim in (64, 256)
                   for blocks in ([(16, 16), (32, 32)] + [(128, 128)] * (head_dim == 256) if dtype == torch.float32
                                  else [(16, 16), (64, 32), (128, 128)])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,blocks", EXPLICIT_BLOCKS, ids=str)
def test_explicit_block_sizes_on_gpu(dtype, head_dim, blocks):
    """block_m / block_n on the explicit passes: exact where the tiles fit the GPU, otherwise a
    FlashAttentionError naming them (never a compiler traceback)."""
    torch.manual_seed(seed_of(str(dtype), head_dim, blocks))
    q, k, v = make_qkv(2, 300, 517, 4, 2, head_dim, dtype, "cuda")
    block_m, block_n = blocks
    try:
        out, lse = cuflash.forward(q, k, v, causal=True, block_m=block_m, block_n=block_n)
        dout = torch.randn_like(out)
        grads = cuflash.backward(dout, q, k, v, out, lse, causal=True, block_m=block_m, block_n=block_n)
    except cuflash.FlashAttentionError as exc:
        # (which tiles fit depends on the GPU, head dim and dtype; the smallest always do)
        assert "block_m" in str(exc) and "smaller blocks" in str(exc)
        assert blocks != (16, 16), f"{blocks} should fit: {exc}"
        return
    ref = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=True)[0],
                       q.double(), k.double(), v.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        assert rel_err(x, r) < BOUNDS[dtype], name


@pytest.mark.gpu
@pytest.mark.parametrize("nheads,nheads_k", [(8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,seqlen_q,seqlen_k", dtype_cases(
    [(1, 1000), (17, 128), (1000, 17), (128, 4096), (4096, 1000)], [(1, 1000), (1000, 17)], unpack=True), ids=str)
def test_gqa_and_unequal_seqlens(dtype, causal, head_dim, nheads, nheads_k, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q + seqlen_k + nheads + head_dim)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, "cuda")
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 128])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_non_contiguous(dtype, head_dim):
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 300, 517, 4, 2, head_dim, dtype, "cuda", layout="bhnd")
    assert not q.is_contiguous()
    check_against_oracle(flash_fn(True), q, k, v, True)


@pytest.mark.gpu
def test_sdpa_interface_on_gpu():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 8, 1000, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                           is_causal=True)
    assert ((ours.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.gpu
def test_tf32_only_when_allowed():
    """fp32 is exact by default (IEEE dots, or tf32x3 on Hopper); with allow_tf32 it runs on one TF32
    pass per dot, with an error no more than 2x that of torch's own attention with TF32 matmuls."""
    torch.manual_seed(1)
    q, k, v = make_qkv(1, 512, 512, 2, 2, 64, torch.float32, "cuda")
    ref, _ = attention_reference(q, k, v)
    exact = cuflash.flash_attn_func(q, k, v)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        fast = cuflash.flash_attn_func(q, k, v)
        torch_tf32, _ = attention_reference(q, k, v, dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err_exact, err_fast, err_torch = (rel_err(x, ref) for x in (exact, fast, torch_tf32))
    assert err_exact < 1e-5
    assert err_fast > 10 * err_exact, "allow_tf32 had no effect"
    assert err_fast < 1e-3, f"TF32 error {err_fast:.2e} above docs/DESIGN.md's 1e-3"
    assert err_fast <= 2 * err_torch, f"TF32 error {err_fast:.2e} vs torch's TF32 attention {err_torch:.2e}"


@pytest.mark.gpu
def test_deterministic_backward_on_gpu():
    torch.manual_seed(2)
    q, k, v = make_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    out, lse = cuflash.forward(q, k, v, causal=True)
    first = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_memory_is_linear_in_seqlen():
    """Forward + backward at seqlen 32k: the N x N scores alone would take 8 * 32k^2 * 2 bytes
    = 16 GB; we allow at most 3x the bytes of q, k, v and out."""
    torch.manual_seed(3)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 32768, 32768, 8, 8, 128, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = cuflash.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * q.element_size()
    assert extra <= 3 * inputs, f"peak extra memory {extra / 1e9:.2f} GB > 3x q+k+v+out ({inputs / 1e9:.2f} GB)"
    assert torch.isfinite(q.grad).all()
