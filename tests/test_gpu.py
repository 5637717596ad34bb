"""The compiled Triton kernels on a CUDA GPU (marker `gpu`; skipped without one)."""
import dataclasses
import time

import pytest
import torch

import cuflash
from attn_testing import BOUNDS, check_against_oracle, check_tile_loads, make_qkv, paged_cache, rel_err, \
    run_and_grad, seed_of, varlen_batch, varlen_reference
from cuflash.kernels import gluon
from cuflash.kernels.plan import Entry, Length, entry
from cuflash.kernels.triton import Tiles
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _cell(q: torch.Tensor, head_dim: int, seqlen: int, banded: bool) -> Entry:
    """The table's entry for 16-bit q of this head dim and length on this GPU."""
    major, minor = torch.cuda.get_device_capability()
    return entry(10 * major + minor, head_dim, q.dtype == torch.float32, False, Length.of(seqlen), banded)


def _force(monkeypatch, **passes):
    """select() takes these candidates (forward=, dkdv=, dq=) instead of the table's; the plans made
    meanwhile stay in a cache of their own."""
    from cuflash.kernels import launch, plan
    table = plan.table_entry
    monkeypatch.setattr(plan, "table_entry", lambda prob, params: dataclasses.replace(table(prob, params), **passes))
    monkeypatch.setattr(launch, "_plans", {})
HEAD_DIMS = [32, 40, 64, 96, 128, 256]
SEQLENS = [1, 17, 128, 1000, 4096]


@pytest.fixture(autouse=True)
def poison_allocator():
    """Leaves NaN in the memory the caching allocator hands out next, so that any output element
    a kernel fails to write shows up as NaN (the checks reject non-finite values)."""
    if torch.cuda.is_available():
        torch.full((256 * 2**20,), float("nan"), dtype=torch.float32, device="cuda")  # freed at once
    yield


def _flash(causal):
    return lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal)


@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_oracle(dtype, causal, head_dim, seqlen):
    torch.manual_seed(seqlen * 1000 + head_dim)
    batch, nheads = (1, 2) if seqlen >= 1000 else (2, 4)
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("blocks", [(16, 16), (64, 32), (128, 128)])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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


@pytest.mark.parametrize("seqlen", [256, 512, 1024, 2048])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_length_class_on_gpu(causal, head_dim, seqlen):
    """The table's launches of the length classes test_against_oracle's lengths leave out (129-256,
    257-512, 513-1024, 1025-2048 keys; Gluon or Triton, as the table picks on this GPU) compile and
    match the oracle, forward and backward, in bf16."""
    torch.manual_seed(seed_of(causal, head_dim, seqlen))
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1000), (17, 128), (1000, 17), (128, 4096), (4096, 1000)])
@pytest.mark.parametrize("nheads,nheads_k", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_and_unequal_seqlens(dtype, causal, nheads, nheads_k, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q + seqlen_k + nheads)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 64, dtype, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("head_dim", [40, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, head_dim):
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 300, 517, 4, 2, head_dim, dtype, "cuda", layout="bhnd")
    assert not q.is_contiguous()
    check_against_oracle(_flash(True), q, k, v, True)


def test_sdpa_interface_on_gpu():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 8, 1000, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    ours = cuflash.scaled_dot_product_attention(query, key, value, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                           is_causal=True)
    assert ((ours.double() - ref).norm() / ref.norm()).item() < 2e-2


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


def test_deterministic_backward_on_gpu():
    torch.manual_seed(2)
    q, k, v = make_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    out, lse = cuflash.forward(q, k, v, causal=True)
    first = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


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


# --- training variants (issue 4) ---

VARIANTS = {
    "window_causal": dict(causal=True, window_size=(256, 0)),
    "window_two_sided": dict(window_size=(100, 37)),
    "alibi_causal": dict(causal=True, alibi="per_head"),
    "alibi_per_batch": dict(alibi="per_batch"),
    "softcap": dict(softcap=20.0),
    "together": dict(window_size=(300, 0), softcap=30.0, alibi="per_head"),
}


def _options(name, batch, nheads):
    options = dict(VARIANTS[name])
    alibi = options.pop("alibi", None)
    if alibi == "per_head":
        options["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)],
                                               device="cuda")
    elif alibi == "per_batch":
        options["alibi_slopes"] = torch.rand(batch, nheads, device="cuda")
    return options


@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 2, 64), (1, 517, 1030, 4, 4, 128), (2, 300, 300, 2, 1, 256),
                                   (2, 1030, 17, 4, 2, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_variant_against_oracle(dtype, variant, shape):
    torch.manual_seed(seed_of(variant, shape))
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape
    q, k, v = make_qkv(*shape, dtype, "cuda")
    options = _options(variant, batch, nheads)
    causal = options.pop("causal", False)
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, **options),
                         q, k, v, causal, with_sdpa=False, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_on_gpu(dtype, causal):
    torch.manual_seed(20 + causal)
    lens_q, lens_k = [1, 17, 1000, 0, 513, 64], [5, 17, 1000, 9, 1030, 1]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, 128, dtype, "cuda")
    dout = torch.randn_like(q)
    got = run_and_grad(lambda a, b, c: cuflash.flash_attn_varlen_func(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                      causal=causal), q, k, v, dout)
    ref = run_and_grad(lambda a, b, c: varlen_reference(a, b, c, cu_q.tolist(), cu_k.tolist(), causal=causal),
                       q.double(), k.double(), v.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(x, r) < BOUNDS[dtype], name


@pytest.mark.parametrize("page,head_dim,options", [
    (16, 128, dict(causal=True)), (256, 64, dict()), (3, 96, dict(window_size=(100, 7), alibi=True, softcap=8.0)),
    (64, 256, dict(causal=True, interleaved=True))], ids=["p16_d128_causal", "p256_d64", "p3_d96_variants",
                                                          "p64_d256_interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_paged_kv_on_gpu(dtype, page, head_dim, options):
    """flash_attn_varlen_func reading K/V pages in place (GQA 8:2) against the float64 oracle."""
    options = dict(options)
    torch.manual_seed(seed_of(page, head_dim, str(dtype)))
    lens_q, lens_k = [1, 17, 1000, 300, 64], [5, 17, 1000, 1030, 1]
    q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, head_dim, dtype, "cuda")
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page, interleaved=options.pop("interleaved", False))
    slopes = torch.rand(len(lens_q), 8, device="cuda") if options.pop("alibi", False) else None
    out = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                         alibi_slopes=slopes, block_table=table, **options)
    ref = varlen_reference(q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), alibi_slopes=slopes,
                           **options)
    assert rel_err(out, ref) < BOUNDS[dtype]


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tensor_descriptor_loads_on_gpu(dtype, varlen):
    """Every kernel of the table's D=128 launches (head dim 96: zero-filled columns) with tiles
    read through tensor descriptors, the dK/dV loop warp-specialized, against pointer loads;
    varlen descriptors end at each sequence's own end (one sequence has no queries)."""
    torch.manual_seed(22)
    if varlen:
        lens_q, lens_k = [1, 17, 1000, 0, 513, 64], [5, 17, 1000, 9, 1030, 1000]
        q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 8, 2, 96, dtype, "cuda")
        params = AttentionParams(96 ** -0.5, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        q, k, v = make_qkv(2, 700, 1500, 8, 2, 96, dtype, "cuda")
        params = AttentionParams(96 ** -0.5, window_right=0)
    assert Tiles(64, 64, 4, 3, tma=True).on((700, 1000), q, k, v).tma  # what the test compares exists
    cell = _cell(q, 128, 1500, True)
    check_tile_loads(q, k, v, params, cell.forward[-1], cell.dkdv[-1], cell.dq[-1], tol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_launch_plans_on_gpu(head_dim):
    """Calls after a signature's first launch the compiled kernels directly (kernels/launch.py):
    fresh data through the same plans, from the main thread and from another one (descriptor
    kernels need Triton's per-thread scratch allocator set by the plan; D=128 and 256 use
    descriptors at these lengths), must match the oracle every time."""
    import threading

    from cuflash.kernels import launch

    def step(seed):
        torch.manual_seed(seed)
        q, k, v = make_qkv(2, 1100, 1100, 8, 2, head_dim, torch.bfloat16, "cuda")
        check_against_oracle(_flash(True), q, k, v, True)
        return True

    step(1)
    plans = len(launch._plans)
    step(2)
    done = []
    worker = threading.Thread(target=lambda: done.append(step(3)))
    worker.start()
    worker.join()
    assert done == [True], "the step in another thread failed (its traceback is printed above)"
    assert len(launch._plans) == plans  # the later steps reused the first one's plans


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 1000), (1000, 1)])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_length_one_with_descriptor_launches(causal, head_dim, seqlen_q, seqlen_k):
    """Lengths of 1 under launches that ask for tensor descriptors (D=128 dK/dV beyond 512 keys,
    D=256): Triton 3.6 fails to compile the descriptor loops for them (seqlen_q 1 with GQA in the
    dK/dV pipeliner, ptxas on the D=256 causal 1 x 1 forward), so Tiles.on reads through pointers."""
    torch.manual_seed(seqlen_q + seqlen_k + head_dim)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (4100, 1)])
@pytest.mark.parametrize("head_dim,causal,consumers,block_n,stages", [
    (128, False, 2, 128, 3), (128, True, 2, 128, 3), (64, False, 2, 128, 3), (64, True, 2, 128, 3),
    (64, False, 3, 128, 3), (64, True, 3, 128, 3), (128, False, 2, 64, 5), (128, True, 2, 64, 5),
    (64, True, 2, 64, 5), (64, False, 3, 64, 5), (64, True, 3, 64, 5), (128, True, 2, 64, 6), (256, False, 2, 64, 2),
    (256, True, 2, 64, 2), (256, False, 2, 32, 3), (256, True, 2, 32, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hopper_forward(dtype, head_dim, causal, consumers, block_n, stages, seqlen_q, seqlen_k, layout,
                        monkeypatch):
    """The Gluon forward (kernels/gluon/forward.py) with 2 or 3 consumer warpgroups, 128-, 64- or 32-key
    tiles and rings of K/V buffers (forced here where the table takes others or the Triton kernel; at
    D=128 with 64-key tiles in 5 buffers and D=256 with 32-key ones in 3 the most shared memory that leaves
    room for two Q buffers; at D=128 with 6 and at D=256 with 64-key tiles one Q buffer that O leaves
    through, causal at D=128 without the deferred hand-back) matches float64 like the Triton kernels:
    ragged tiles, GQA, rows with no visible key (causal, seqlen_q > seqlen_k), non-contiguous inputs; the
    gradients check its lse."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (sm_90)")
    from cuflash.kernels.gluon import forward as gluon_forward
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype, "cuda", layout=layout)
    params = AttentionParams(head_dim ** -0.5, window_right=0 if causal else -1)
    assert gluon.accepts(problem(q, k, v, params), params)
    cfg = gluon.Forward(consumers, block_n, stages)
    _force(monkeypatch, forward=(cfg, _cell(q, head_dim, max(seqlen_q, seqlen_k), causal).forward[-1]))
    launched, launch_args = [], gluon_forward.launch_args
    monkeypatch.setattr(gluon_forward, "launch_args", lambda *args: launched.append(args[-1]) or launch_args(*args))
    check_against_oracle(_flash(causal), q, k, v, causal)
    assert launched and set(launched) == {cfg}


@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, False), (64, True)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 300), (129, 500), (500, 17), (17, 200), (1, 100)])
def test_hopper_short(seqlen_q, seqlen_k, head_dim, causal):
    """Up to 512 keys the Gluon dK/dV kernel takes the backward, and at D=128 non-causal from 257 keys
    (the table's length class 2) the Gluon dQ kernel too. The Gluon forward runs but causal up to 64 keys
    (here 100) and at D=64 causal for 257-512 keys; with 64-key tiles up to 256 keys (D=64: 512) and causal
    up to 1k."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (sm_90)")
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = make_qkv(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, "cuda")
    n = max(seqlen_q, seqlen_k)
    cell = _cell(q, head_dim, n, causal)
    plain = head_dim == 128 and not causal
    assert cell.dkdv[0] == gluon.Dkdv(fuse_dq=False)
    assert isinstance(cell.dq[0], gluon.Dq) == (plain and n > 256)
    fwd = cell.forward[0]
    assert isinstance(fwd, gluon.Forward) == (not (causal and (n <= 128 or head_dim == 64 and 256 < n <= 512)))
    assert not isinstance(fwd, gluon.Forward) or fwd.block_n == (64 if n <= 256 or causal or head_dim == 64 else 128)
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("gluon_forward", [True, False], ids=["table", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 300), (129, 500), (500, 200), (200, 200)])
def test_d256_short(seqlen_q, seqlen_k, causal, dtype, gluon_forward, monkeypatch):
    """D=256 at 129-512 keys (the table's length classes 1 and 2): on Hopper the plain forward runs the
    Gluon kernel; the Triton launch (windows, ALiBi, ... and forced here) 32-key tiles through pointers up
    to 256 keys and causal up to 512, 64-key tiles through tensor descriptors non-causal beyond 256."""
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 256, dtype, "cuda")
    fwd = _cell(q, 256, max(seqlen_q, seqlen_k), causal).forward
    if torch.cuda.get_device_capability() == (9, 0):
        short = causal or max(seqlen_q, seqlen_k) <= 256
        assert (fwd[-1].block_n, fwd[-1].tma, isinstance(fwd[0], gluon.Forward)) == \
            ((32, False, True) if short else (64, True, True))
    if not gluon_forward:
        _force(monkeypatch, forward=fwd[-1:])
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (4100, 1)])
@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, False), (64, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True])
def test_hopper_backward(fused, dtype, head_dim, causal, seqlen_q, seqlen_k, layout, monkeypatch):
    """The Gluon kernels (kernels/gluon/backward.py) are the ones that run, and the gradients match
    float64 like the Triton kernels': ragged key and query tiles, GQA (dK/dV summed over the
    group), keys no query sees and rows that see no key (causal, seqlen_q != seqlen_k),
    non-contiguous inputs. fused: dQ added by the dK/dV kernel's TMA reductions (forced here
    where the table does not take it); otherwise the two passes (deterministic=True)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (sm_90)")
    from cuflash.kernels import launch
    torch.manual_seed(seqlen_q + seqlen_k + head_dim)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype, "cuda", layout=layout)
    params = AttentionParams(head_dim ** -0.5, window_right=0 if causal else -1)
    cell = _cell(q, head_dim, max(seqlen_q, seqlen_k), causal)
    assert isinstance(cell.dkdv[0], gluon.Dkdv) and isinstance(cell.dq[0], gluon.Dq) == (head_dim == 128)
    assert gluon.accepts(problem(q, k, v, params, torch.empty_like(q)), params)
    if fused:
        _force(monkeypatch, dkdv=(gluon.Dkdv(fuse_dq=True), cell.dkdv[-1]))
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, deterministic=not fused),
                         q, k, v, causal)
    if fused:
        assert any("DQAcc" in workspaces for workspaces, _ in launch._plans.values())


@pytest.mark.parametrize("head_dim,causal,fused", [(64, False, True), (64, True, False), (128, False, False),
                                                (128, True, False), (128, True, True)])
def test_hopper_backward_persistent(head_dim, causal, fused, monkeypatch):
    """The persistent dK/dV and dQ kernels with 3 programs: each runs many pairs of work items, so
    their held buffers, rings and the fused kernel's dS buffers wrap around many times (the other
    tests' shapes give most programs one pair)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (sm_90)")
    from cuflash.kernels import launch
    from cuflash.kernels.gluon import backward as gluon_backward
    monkeypatch.setattr(gluon_backward, "num_sms", lambda device: 3)
    cell = _cell(torch.empty(1, dtype=torch.bfloat16), head_dim, 1100, causal)
    _force(monkeypatch, dkdv=(gluon.Dkdv(fuse_dq=fused), cell.dkdv[-1]))
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 1000, 1100, 4, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, deterministic=not fused),
                         q, k, v, causal)
    assert any("DQAcc" in workspaces for workspaces, _ in launch._plans.values()) == fused


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(3000, 600), (600, 3000)])
def test_hopper_forward_top_left_causal(seqlen_q, seqlen_k):
    """SDPA's causal mask (top-left aligned) through the Gluon forward."""
    torch.manual_seed(seqlen_q)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 4, 128, torch.bfloat16, "cuda", layout="bhnd")
    ours = cuflash.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).double() for x in (q, k, v)),
                                                           is_causal=True)
    assert rel_err(ours, ref) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_on_gpu(dtype):
    torch.manual_seed(21)
    q, k, v = make_qkv(2, 700, 900, 8, 2, 64, dtype, "cuda")
    p = 0.2
    torch.manual_seed(7)
    _, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = probs >= 0
    visible = probs != 0
    kept = keep[visible].float().mean().item()
    assert abs(kept - (1 - p)) < 0.01, f"keep rate {kept:.4f}"

    def ours(a, b, c):
        torch.manual_seed(7)
        return cuflash.flash_attn_func(a, b, c, dropout_p=p, causal=True)

    check_against_oracle(ours, q, k, v, True, with_sdpa=False, dropout_p=p, dropout_keep=keep)


@pytest.mark.parametrize("mask_kind", ["bool_padding", "additive_per_head", "bool_full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_attn_mask_on_gpu(dtype, mask_kind):
    torch.manual_seed(22)
    b, h, hk, lq, lk, d = 2, 8, 2, 1000, 1030, 64
    query = torch.randn(b, h, lq, d, dtype=dtype, device="cuda")
    key, value = (torch.randn(b, hk, lk, d, dtype=dtype, device="cuda") for _ in range(2))
    mask = {
        "bool_padding": torch.arange(lk, device="cuda")[None, None, None, :] < torch.tensor(
            [900, lk], device="cuda")[:, None, None, None],
        "additive_per_head": torch.randn(h, 1, lk, dtype=dtype, device="cuda"),
        "bool_full": torch.rand(b, h, lq, lk, device="cuda") > 0.2,
    }[mask_kind]
    dout = torch.randn_like(query)
    ours = run_and_grad(lambda a, b_, c: cuflash.scaled_dot_product_attention(a, b_, c, attn_mask=mask,
                                                                               enable_gqa=True),
                        query, key, value, dout)
    ref = run_and_grad(lambda a, b_, c: torch.nn.functional.scaled_dot_product_attention(
        a, b_, c, attn_mask=mask if mask.dtype == torch.bool else mask.double(), enable_gqa=True),
        query.double(), key.double(), value.double(), dout.double())
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(x, r) < BOUNDS[dtype], name


def test_deterministic_backward_with_variants():
    """deterministic=True: bitwise identical gradients run to run, here with varlen, a window,
    ALiBi and dropout together."""
    torch.manual_seed(23)
    lens = [300, 1000, 17]
    cu = torch.tensor([0, 300, 1300, 1317], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1317, 8, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    slopes = torch.rand(8, device="cuda")
    dout = torch.randn_like(q)
    grads = []
    for _ in range(3):
        torch.manual_seed(8)
        out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.1, causal=True,
                                             window_size=(128, 0), alibi_slopes=slopes, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again))


def test_sliding_window_cost_follows_the_window():
    """A 256-key window at seqlen 16k visits ~1/18 of the tiles of full causal attention. Timed as
    the fastest of 10 single calls (other test processes share the GPU), it must run at least 3x
    faster: a window computed by masking every tile would take as long as causal attention."""
    q, k, v = make_qkv(1, 16384, 16384, 16, 16, 128, torch.bfloat16, "cuda")

    def fastest_ms(**options):
        times = []
        for _ in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cuflash.flash_attn_func(q, k, v, **options)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return min(times[3:])

    causal, window = fastest_ms(causal=True), fastest_ms(causal=True, window_size=(256, 0))
    assert window < causal / 3, f"window {window:.2f} ms vs causal {causal:.2f} ms"


# --- naive, fa1, fa2 (issue 6) ---

@pytest.mark.parametrize("method", ["naive", "fa1", "fa2"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 4, 64), (2, 17, 300, 4, 40), (1, 1000, 1000, 8, 128),
                                   (1, 517, 129, 2, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_methods_on_gpu(dtype, causal, shape, method):
    from cuflash import methods
    torch.manual_seed(seed_of(shape, method))
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, dtype, "cuda", layout="bhnd")
    check_against_oracle(lambda a, b, c: methods.attention(method, a, b, c, causal), q, k, v, causal)


def test_cli_run_and_check_on_gpu(tmp_path, capsys):
    from cuflash.cli import main
    assert main(["generate", "--batch-size", "2", "--num-heads", "4", "--seq-len", "1000", "--head-dim", "64",
                 "--dtype", "bfloat16", "--output-dir", str(tmp_path)]) == 0
    for method in ("naive", "fa1", "fa2"):
        assert main(["run", "--compute", method, "--mode", "both", "--causal", "--device", "cuda",
                     "--data", str(tmp_path / "B2_H4_S1000_D64")]) == 0
    assert "on cuda" in capsys.readouterr().out
    assert main(["check"]) == 0
    assert "30 of 30 cases within the bounds" in capsys.readouterr().out


# --- KV cache (issue 5): the split-KV decode kernel ---

def _kv_caches(layout, batch, capacity, nheads_k, d, dtype):
    """k_cache, v_cache and block_table (None when contiguous) holding `capacity` keys per sequence."""
    if layout == "contiguous":
        k_cache = torch.randn(batch, capacity, nheads_k, d, dtype=dtype, device="cuda")
        return k_cache, torch.randn_like(k_cache), None
    page = int(layout[5:])
    blocks = batch * capacity // page + 3
    k_cache = torch.randn(blocks, page, nheads_k, d, dtype=dtype, device="cuda")
    table = torch.randperm(blocks, device="cuda")[:batch * capacity // page].view(batch, -1).int()
    return k_cache, torch.randn_like(k_cache), table


def _cached(cache, table, b, n):
    return (cache[table[b].long()].flatten(0, 1) if table is not None else cache[b])[:n]


@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("layout", ["contiguous", "paged256", "paged16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_on_gpu(dtype, seqlen_q, layout, num_splits):
    """Appending seqlen_q tokens per sequence and attending (GQA 32/8, D=128) equals attention over
    the updated cache, output and softmax_lse, for every split count."""
    torch.manual_seed(24)
    batch, nheads, nheads_k, d = 4, 32, 8, 128
    seqlens = torch.tensor([0, 700, 4096 - seqlen_q, 255], dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = _kv_caches(layout, batch, 4096, nheads_k, d, dtype)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, seqlen_q, nheads_k, d, dtype=dtype, device="cuda") for _ in range(2))
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=num_splits, return_softmax_lse=True)
    for b in range(batch):
        n = int(seqlens[b]) + seqlen_q
        keys, values = _cached(k_cache, table, b, n), _cached(v_cache, table, b, n)
        assert torch.equal(keys[-seqlen_q:], k[b]) and torch.equal(values[-seqlen_q:], v[b])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None], values[None], causal=True)
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype]
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-4)


@pytest.mark.parametrize("batch,nheads,nheads_k,d,dtype,layout", [
    (40, 32, 8, 128, torch.bfloat16, "contiguous"),  # fills the GPU unsplit: the 128-key tiles
    (40, 32, 8, 128, torch.float16, "paged16"),
    (3, 8, 8, 256, torch.float16, "paged256"),
    (2, 12, 4, 40, torch.float32, "contiguous"),
    (5, 16, 2, 64, torch.bfloat16, "paged1"),  # a page per key
])
def test_kvcache_launches_on_gpu(batch, nheads, nheads_k, d, dtype, layout):
    """Each launch configuration of the decode kernel (tile per head dim, dtype, layout, grid size)
    against the oracle, on sequences of random lengths."""
    torch.manual_seed(batch + d)
    k_cache, v_cache, table = _kv_caches(layout, batch, 1024, nheads_k, d, dtype)
    seqlens = torch.randint(1, 1025, (batch,), dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    for b in range(batch):
        n = int(seqlens[b])
        keys, values = _cached(k_cache, table, b, n), _cached(v_cache, table, b, n)
        ref, _ = attention_reference(q[b:b + 1], keys[None], values[None])
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype], b


def test_kvcache_decode_step_in_a_cuda_graph():
    """A decode step captured once and replayed with new cache_seqlens values (the validation's
    host read is skipped while capturing) gives what eager calls give."""
    torch.manual_seed(25)
    batch, nheads, nheads_k, d = 2, 16, 4, 64
    k_cache, v_cache, table = _kv_caches("paged16", batch, 1024, nheads_k, d, torch.bfloat16)
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, 1, nheads_k, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([10, 500], dtype=torch.int32, device="cuda")

    def step():
        return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                               causal=True)
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in ([11, 501], [1000, 3]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        assert torch.equal(captured, step())


def test_bench_times_the_device_not_the_host():
    """A call whose host work (3 ms) outlasts its kernel: the bench's device time is the kernel's,
    its host time the 3 ms; timed with events around each call as it runs, it would read ~3 ms."""
    from cuflash.bench.harness import _device_ms_host_us, _median_ms
    x = torch.randn(1 << 20, device="cuda")

    def step(i):
        time.sleep(0.003)
        x.mul_(1.0)

    ms, host_us = _device_ms_host_us(step, 10, 2, torch.device("cuda"))
    assert ms < 0.5 and host_us > 2900, (ms, host_us)
    assert _median_ms(step, 10, 2, torch.device("cuda")) > 2.5  # what the events alone would say


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window_size=(5, 0), softcap=8.0,
                                                             dropout_p=0.2)], ids=["plain", "variants"])
def test_torch_compile_fullgraph_inductor(options):
    """A block with attention under torch.compile(fullgraph=True) with inductor: forward and
    backward equal to eager, no recompilation (test_attention.check_compiled)."""
    from test_attention import check_compiled
    check_compiled("cuda", "inductor", **options)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_compiles_fullgraph_inductor(paged):
    """A decode step (rotary, append, the decode custom op) under torch.compile(fullgraph=True) with
    inductor (test_kvcache.check_decode_compiled)."""
    from test_kvcache import check_decode_compiled
    check_decode_compiled("cuda", "inductor", paged)
