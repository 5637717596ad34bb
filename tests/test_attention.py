"""Correctness on the CPU: the blocked PyTorch path and the Triton kernels through the
interpreter, against the float64 oracle, through every public entry point."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cuflash
from attn_testing import check_against_oracle, check_tile_loads, interpret, make_qkv, rel_err, run_and_grad, \
    seed_of, varlen_batch
from cuflash.kernels.plan import Plan
from cuflash.kernels.triton import Tiles
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference


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


def test_sdpa_three_and_five_dims(backend):
    torch.manual_seed(4)
    for shape in [(3, 10, 16), (2, 3, 2, 10, 16)]:
        query, key, value = (torch.randn(shape) for _ in range(3))
        ours = cuflash.scaled_dot_product_attention(query, key, value)
        theirs = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double())
        assert ours.shape == shape
        assert rel_err(ours, theirs) < 1e-5


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
    assert torch.allclose(probs.sum(-1)[..., 8:], torch.ones(1, 2, 12), atol=1e-5)


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
        scores = cpu._Tiles.scores

        def spy(self, x, m0, m1, n0, n1, masked):
            seen.append((m1 - m0, n1 - n0))
            return scores(self, x, m0, m1, n0, n1, masked)
        monkeypatch.setattr(cpu._Tiles, "scores", spy)
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


def test_tensor_descriptors_only_where_they_compile():
    tma, n = Tiles(64, 64, 4, 3, tma=True, warp_specialize=True), (17, 33)
    x = torch.randn(2, 17, 3, 40, dtype=torch.float16)

    def used(tiles, seqlens, *streamed):
        return tiles.on(seqlens, *streamed).tma

    assert tma.on(n, x, x[:, :, 1:]) == tma  # 80-byte rows and heads
    assert tma.on(n) == Tiles(64, 64, 4, 3)  # nothing streamed (paged keys): pointers, no warp specialization
    assert not used(Tiles(64, 64, 4, 3), n, x)  # not asked for
    assert not used(tma, (1, 33), x) and not used(tma, (17, 1), x)  # a length Triton makes a constant 1
    assert not used(tma, n, torch.randn(2, 17, 3, 44, dtype=torch.float16))  # 88-byte rows
    buf = torch.randn(x.numel() + 8, dtype=torch.float16)
    assert used(tma, n, buf[8:].view(x.shape))  # base 16 bytes in
    assert not used(tma, n, buf[4:-4].view(x.shape))  # base 8 bytes in
    assert not used(tma, n, torch.randn(1, 1, 3, 40).expand(2, 17, 3, 40))  # rows at stride 0


LENGTH_CLASS_KEYS = (128, 256, 512, 1024, 2048, 4096)  # the longest (or a long) sequence of each class


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_table_launch_is_accepted_by_its_kernel(arch):
    """Every candidate of the table (each head dim class, length class, causal or not, dtype) is one
    its kernel takes: Triton tiles last (they take every call), power-of-two tiles of 16 to 256 rows,
    1-8 warps, warp specialization only with tensor descriptors; Gluon candidates only on Hopper for
    16-bit inputs at D=64/128/256 (what the Gluon kernels take; the backward's at 64/128), with key
    tiles and buffers that fit their shared memory (launch_args validates them). Which candidate wins
    where is measured, not restated here (docs/tuning.md); that each compiles and computes the right
    thing is tests/test_gpu.py's test_every_length_class_on_gpu."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import forward as gluon_forward
    from cuflash.kernels.plan import Length, entry
    from cuflash.kernels.variant import problem

    causal, plain = AttentionParams(0.1, window_right=0), AttentionParams(0.1)
    for block_d in (16, 32, 64, 128, 256):
        for fp32 in (False, True):
            for length, keys in zip(Length, LENGTH_CLASS_KEYS):
                assert Length.of(keys) == length
                for banded in (False, True):
                    cell = entry(arch, block_d, fp32, False, length, banded)
                    for candidates in (cell.forward, cell.dkdv, cell.dq):
                        *first, last = candidates
                        assert isinstance(last, Tiles) and not any(isinstance(c, Tiles) for c in first), cell
                        for tile in (last.block_m, last.block_n):
                            assert 16 <= tile <= 256 and tile & (tile - 1) == 0, cell
                        assert last.num_warps in (1, 2, 4, 8) and last.num_stages >= 1, cell
                        assert not last.warp_specialize or last.tma, cell
                    if len(cell.forward) + len(cell.dkdv) + len(cell.dq) == 3:
                        continue
                    # (a Gluon kernel is a candidate where it measured faster; it runs only where it
                    # accepts the call, and the Triton tiles after it elsewhere)
                    assert arch == 90 and not fp32, (block_d, length, banded)
                    if block_d not in (64, 128, 256):
                        continue
                    q = torch.randn(1, keys, 2, block_d, dtype=torch.bfloat16)
                    params = causal if banded else plain
                    if len(cell.forward) > 1:
                        prob = problem(q, q, q, params)
                        assert gluon.accepts(prob, params)
                        gluon_forward.launch_args(dict(Q=q, K=q, V=q, Out=q, Lse=q), prob, params, cell.forward[0])
                    if len(cell.dkdv) + len(cell.dq) > 2:
                        assert gluon.accepts(problem(q, q, q, params, q), params), (block_d, length, banded)


def test_gluon_kernels_accept_only_what_they_implement(monkeypatch):
    """The Gluon kernels accept only the plain 16-bit attention they implement (the rest takes the
    Triton kernels) and refuse configurations that do not fit them (the kernels run on the GPU only:
    tests/test_gpu.py)."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import forward as gluon_forward
    from cuflash.kernels.variant import problem

    q, k = (torch.randn(2, 600, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    causal = AttentionParams(128 ** -0.5, window_right=0)
    assert gluon.accepts(problem(q, k, k, causal), causal)
    assert gluon.accepts(problem(q[..., :64], k[..., :64], k[..., :64], causal), causal)
    for kwargs, match in ((dict(consumers=4), "2 or 3 consumer"), (dict(block_n=16), "32-, 64- or 128-key tiles")):
        with pytest.raises(ValueError, match=match):
            gluon.Forward(**kwargs)
    with pytest.raises(ValueError, match="fewer than 7"):
        gluon_forward.launch_args(dict(Q=q, K=k, V=k, Out=q), problem(q, k, k, causal), causal,
                                  gluon.Forward(2, 64, 7))
    wide = torch.randn(2, 600, 4, 256, dtype=torch.bfloat16)  # D=256: one Q buffer, at most 2 K/V buffers of 64 keys
    assert gluon.accepts(problem(wide, wide, wide, causal), causal)
    assert not gluon.accepts(problem(wide, wide, wide, causal, wide), causal)  # no Gluon backward at D=256
    with pytest.raises(ValueError, match="fewer than 3"):
        gluon_forward.launch_args(dict(Q=wide, K=wide, V=wide, Out=wide), problem(wide, wide, wide, causal), causal,
                                  gluon.Forward(2, 64, 3))
    for params in (AttentionParams(0.1, window_left=64, window_right=0), AttentionParams(0.1, softcap=30.0),
                   AttentionParams(0.1, dropout_p=0.1), AttentionParams(0.1, alibi_slopes=torch.ones(4)),
                   AttentionParams(0.0)):
        assert not gluon.accepts(problem(q, k, k, params), params)
    buf = torch.randn(q.numel() + 4, dtype=torch.bfloat16)
    for other in (q.float(), q[..., :96], buf[4:].view(q.shape)):  # fp32, D=96, a base 8 bytes off
        assert not gluon.accepts(problem(other, k, k, causal), causal)
    cu = torch.tensor([0, 600, 1200], dtype=torch.int32)
    varlen = AttentionParams(0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=600, max_seqlen_k=600)
    flat = q.reshape(1200, 4, 128)
    assert not gluon.accepts(problem(flat, flat, flat, varlen), varlen)
    assert gluon.accepts(problem(q, k, k, causal, q.transpose(1, 2).contiguous().transpose(1, 2)), causal)
    assert not gluon.accepts(problem(q, k, k, causal, buf[4:].view(q.shape)), causal)
    monkeypatch.setattr(gluon, "GLUON_TRITON", False)  # a Triton older than 3.6
    assert not gluon.accepts(problem(q, k, k, causal), causal)
    assert not gluon.accepts(problem(q, k, k, causal, q), causal)


def test_select_falls_back_and_keeps_determinism():
    """select() takes each pass's first candidate whose kernel accepts the call: Gluon where it does,
    the Triton tiles otherwise; a deterministic backward unfuses dQ from the Gluon dK/dV kernel."""
    from cuflash.kernels import gluon
    from cuflash.kernels.plan import Entry, select
    from cuflash.kernels.variant import problem

    q = torch.randn(1, 300, 2, 64, dtype=torch.bfloat16)
    tiles = Tiles(64, 64, 4, 3)
    cell = Entry((gluon.Forward(3, 64, 6), tiles), (gluon.Dkdv(fuse_dq=True), tiles), (gluon.Dq(), tiles))
    plain, softcap = AttentionParams(0.1), AttentionParams(0.1, softcap=5.0)
    assert select(problem(q, q, q, plain), plain, cell) == Plan(gluon.Forward(3, 64, 6))
    assert select(problem(q, q, q, plain, q), plain, cell) == Plan(gluon.Forward(3, 64, 6), gluon.Dkdv(True), None)
    exact = AttentionParams(0.1, deterministic=True)
    assert select(problem(q, q, q, exact, q), exact, cell) == Plan(gluon.Forward(3, 64, 6), gluon.Dkdv(False),
                                                                   gluon.Dq())
    assert select(problem(q, q, q, softcap, q), softcap, cell) == Plan(tiles, tiles, tiles)
    asked = AttentionParams(0.1, block_m=32, block_n=16)
    assert select(problem(q, q, q, asked, q), asked) == Plan(*(Tiles(32, 16, 4, 2),) * 3)


@interpret
@pytest.mark.parametrize("varlen", [False, True])
def test_tensor_descriptor_loads_match_pointer_loads(varlen):
    """The interpreter runs the descriptor path as the GPU does (zero-filled rows and columns past
    each sequence's end and the head dim): it must give the pointer path's results."""
    torch.manual_seed(21)
    if varlen:
        q, k, v, cu_q, cu_k = varlen_batch([1, 17, 0, 30], [5, 17, 9, 33], 4, 2, 40, torch.float32, "cpu")
        params = AttentionParams(40 ** -0.5, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=30, max_seqlen_k=33)
    else:
        q, k, v = make_qkv(2, 37, 50, 4, 2, 40, torch.float32, "cpu")
        params = AttentionParams(40 ** -0.5, window_right=0)
    assert Tiles(16, 16, 1, 1, tma=True).on((30, 33), q, k, v).tma
    check_tile_loads(q, k, v, params, Tiles(32, 16, 1, 1), Tiles(16, 32, 1, 1), Tiles(32, 16, 1, 1), tol=1e-6)


@interpret
def test_launch_plans_are_reused_per_signature_and_hold_no_tensors():
    """A launch plan keeps every argument of a signature's first call but its tensors: later
    calls with new data reuse it, new strides, options or a misaligned base make a new one, and
    the first call's tensors are not kept alive."""
    import gc
    import weakref

    from cuflash.kernels import attention_backward, attention_forward
    from cuflash.kernels import launch

    def check(q, k, v, causal):
        params = AttentionParams(40 ** -0.5, window_right=0 if causal else -1)
        dout = torch.randn_like(q)

        def ours(a, b, c):
            out, lse = attention_forward(a, b, c, params)
            return (out,) + attention_backward(dout, a, b, c, out, lse, params)

        ref = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=causal)[0],
                           q.double(), k.double(), v.double(), dout.double())
        for got, want in zip(ours(q, k, v), ref):
            assert rel_err(got, want) < 1e-5

    launch._plans.clear()
    torch.manual_seed(5)
    first = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
    check(*first, True)
    assert len(launch._plans) == 2  # forward, backward
    watch = weakref.ref(first[0])
    del first
    gc.collect()
    assert watch() is None
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu"), True)  # new data: the same plans
    assert len(launch._plans) == 2
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu"), False)  # another option
    assert len(launch._plans) == 4
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu", layout="bhnd"), True)  # other strides
    assert len(launch._plans) == 6
    q, k, v = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
    shifted = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)  # base 4 bytes past 16-byte alignment
    check(shifted, k, v, True)
    assert len(launch._plans) == 8


def test_deterministic_reaches_the_params(monkeypatch):
    """flash_attn_func's and the explicit backward's deterministic, and torch.use_deterministic_algorithms
    for SDPA, reach AttentionParams (the fused Hopper backward is taken only without it)."""
    from cuflash import interface
    seen = []

    def record(name):
        def op(*args):
            seen.append((name, args[-1].deterministic))
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


@interpret
def test_launch_plan_workspaces_are_fresh_and_zero_filled():
    """A tensor that a plan's build adds to the launch's tensors is a workspace: every later call of
    the signature gets a new zero-filled one (the fused backward's dQ sum), not the first call's."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit
    def increment(Work, Out, N: tl.constexpr):
        offs = tl.arange(0, N)
        work = tl.load(Work + offs) + 1
        tl.store(Work + offs, work)
        tl.store(Out + offs, work)

    def build(tensors):
        tensors["Work"] = torch.zeros(8)
        return [(increment, (1,), dict(Work=tensors["Work"], Out=tensors["Out"], N=8))]

    firsts = []
    for _ in range(3):
        tensors = dict(Out=torch.empty(8))
        launch.launch(("workspace test",), tensors, lambda: build(tensors))
        assert torch.equal(tensors["Out"], torch.ones(8)) and torch.equal(tensors["Work"], torch.ones(8))
        firsts.append(tensors["Work"])
    assert len({w.data_ptr() for w in firsts}) == 3


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it, calls take the custom ops instead of the eager
    autograd.Function (ops._direct)."""

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
    """Plain eager calls bypass the custom op (ops._direct) and give the custom op's results and
    gradients, and refuse a double backward as the op does; FakeTensorMode and meta tensors still go
    through the op (its fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from cuflash import ops
    from cuflash.params import AttentionParams
    q, k, v = make_qkv(1, 19, 23, 4, 2, 16, dtype=torch.float32, device="cpu")
    params = AttentionParams(0.25, window_right=0)
    assert ops._direct(q)
    direct = run_and_grad(lambda *t: ops.forward(*t, params)[0], q, k, v, torch.ones(1, 19, 4, 16))
    through_op = run_and_grad(lambda *t: ops.attention_forward(*t, *params.as_args())[0], q, k, v,
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
        assert not ops._direct(fake)
        assert ops.forward(fake, fake, fake, params)[0].shape == (1, 19, 4, 16)
    monkeypatch.setenv("CUFLASH_BACKEND", "auto")  # meta tensors: shapes only, whatever the backend
    assert cuflash.flash_attn_func(*(t.to("meta") for t in (q, q, q))).device.type == "meta"


def test_cuflash_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "fastest")
    q, k, v = make_qkv(1, 4, 4, 1, 1, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(cuflash.FlashAttentionError) as info:
        cuflash.flash_attn_func(q, k, v)
    assert info.value.code == cuflash.ErrorCode.INVALID_ARGUMENT and "CUFLASH_BACKEND" in str(info.value)
