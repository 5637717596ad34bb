"""A value head dim other than the query/key head dim (FlashAttention-3/4's headdim_v; DeepSeek's MLA
takes 192 for q and k, 128 for v): out and dO have v's head dim, dV v's shape. Against the float64
oracle on the CPU path and the Triton kernels through the interpreter, through every entry point that
takes it (flash_attn_func, varlen, paged varlen, the KV cache, the explicit passes, SDPA), with the
options that touch the scores (causal with seqlen_q != seqlen_k, GQA, dropout, softcap, a score_mod);
the checks that name v; and, marked gpu, the compiled kernels of each family in 16-bit."""
import pytest
import torch

import cuflash
from attn_testing import BOUNDS, check_against_oracle, force_candidates, raises, rel_err, seed_of, table_cell, \
    varlen_oracle, varlen_reference
from cuflash.errors import ErrorCode
from cuflash.reference import attention_reference
from cuflash.validate import MAX_HEAD_DIM

# (head dim of q and k, of v): DeepSeek's MLA, v wider and narrower than q, dims that are not powers of two.
PAIRS = [(192, 128), (64, 128), (128, 64), (40, 96), (96, 40)]
# A latent cache read as values (FlashAttention-3's (64, 512)) where the head dims go that far.
WIDE = [(64, 256)] + ([(64, 512)] if MAX_HEAD_DIM >= 512 else [])


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, dims, dtype=torch.float32, device="cpu"):
    d, dv = dims
    return (torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device=device),
            torch.randn(batch, seqlen_k, nheads_k, d, dtype=dtype, device=device),
            torch.randn(batch, seqlen_k, nheads_k, dv, dtype=dtype, device=device))


def _pair_id(dims) -> str:
    return f"{dims[0]}-{dims[1]}"


# (batch, seqlen_q, seqlen_k, nheads, nheads_k): up to 32 keys the interpreter's one-launch backward,
# beyond it the delta, dK/dV and dQ launches; seqlen_q != seqlen_k both ways (causal rows that see no key), GQA.
SHAPES = [(2, 17, 23, 4, 2), (1, 40, 70, 2, 1), (1, 45, 9, 2, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", PAIRS, ids=_pair_id)
def test_flash_attn_func(backend, dims, causal, shape):
    """Output and gradients of q, k, v (dV shaped like v) against the oracle and twice torch SDPA's
    own error, in fp32."""
    torch.manual_seed(seed_of(dims, causal, shape))
    q, k, v = _qkv(*shape, dims)
    out = cuflash.flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (*q.shape[:-1], dims[1])
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)


@pytest.mark.parametrize("dims", [(192, 128), (40, 96)], ids=_pair_id)
def test_fp16(backend, dims):
    torch.manual_seed(seed_of(dims))
    q, k, v = _qkv(2, 33, 47, 4, 2, dims, torch.float16)
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True), q, k, v, True)


@pytest.mark.parametrize("dims", [(192, 128), (96, 40)], ids=_pair_id)
def test_softcap_score_mod_and_window(backend, dims):
    """The score options see q.k (q's head dim) and leave the values alone: softcap, a score_mod (a
    relative bias and, through a captured tensor, a gradient of its own), a sliding window."""
    torch.manual_seed(seed_of(dims, "options"))
    q, k, v = _qkv(1, 30, 37, 4, 2, dims)
    bias = torch.randn(4, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] - 0.05 * (q_idx - kv_idx).abs()

    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, softcap=2.0), q, k, v, False,
                         with_sdpa=False, softcap=2.0)
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True, score_mod=mod), q, k, v,
                         True, with_sdpa=False, score_mod=mod)
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, window_size=(5, 3)), q, k, v, False,
                         with_sdpa=False, window_size=(5, 3))


@pytest.mark.parametrize("dims", [(192, 128), (40, 96)], ids=_pair_id)
def test_dropout(backend, dims):
    """Output and gradients equal the oracle's given the keep mask (which return_attn_probs shows:
    dropped probabilities negated), the same mask with either value head dim."""
    torch.manual_seed(seed_of(dims, "dropout"))
    q, k, v = _qkv(2, 21, 26, 4, 2, dims)
    torch.manual_seed(7)
    _, _, probs = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    keep = probs >= 0

    def ours(a, b, c):
        torch.manual_seed(7)  # the same seed draws the same mask
        return cuflash.flash_attn_func(a, b, c, dropout_p=0.3, causal=True)

    check_against_oracle(ours, q, k, v, True, with_sdpa=False, dropout_p=0.3, dropout_keep=keep)


@pytest.mark.parametrize("dims", [(192, 128), (40, 96), (96, 40)], ids=_pair_id)
def test_varlen(backend, dims):
    """Sequences of any length packed without padding (one without keys, one longer than a tile), causal
    and GQA: output and gradients against the oracle sequence by sequence."""
    torch.manual_seed(seed_of(dims, "varlen"))
    lens_q, lens_k = [5, 1, 40, 3], [9, 0, 70, 3]
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q, k, v = (t[0] for t in _qkv(1, sum(lens_q), sum(lens_k), 4, 2, dims))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cuflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    assert out.shape == (sum(lens_q), 4, dims[1])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    doubles = [t.double().requires_grad_() for t in (q, k, v)]
    ref = varlen_reference(*doubles, cu_q, cu_k, causal=True)
    ref_grads = torch.autograd.grad(ref, doubles, dout.double())
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert ours.shape == theirs.shape and rel_err(ours, theirs) < 1e-5, name


@pytest.mark.parametrize("dims", [(192, 128), (40, 96)], ids=_pair_id)
def test_sink_and_seqused(backend, dims):
    """Beside v's head dim: a learnable sink (its gradient from the delta over v's head dim) and
    seqused_q / seqused_k (the rows past them out 0, no gradient), causal, GQA: output and gradients,
    the sink's too, against the oracle sequence by sequence."""
    torch.manual_seed(seed_of(dims, "sink"))
    lens_q, lens_k, used_q, used_k = [5, 40, 3], [9, 70, 3], [4, 33, 3], [9, 50, 2]
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q, k, v = (t[0] for t in _qkv(1, sum(lens_q), sum(lens_k), 4, 2, dims))
    sink = torch.randn(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out = cuflash.flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         learnable_sink=leaves[3], seqused_q=torch.tensor(used_q, dtype=torch.int32),
                                         seqused_k=torch.tensor(used_k, dtype=torch.int32))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    doubles = [t.double().requires_grad_() for t in (q, k, v, sink)]
    ref = varlen_oracle(*doubles[:3], cu_q.tolist(), cu_k.tolist(), used_q, used_k, causal=True,
                        learnable_sink=doubles[3])[0]
    ref_grads = torch.autograd.grad(ref, doubles, dout.double())
    for name, ours, theirs in zip(("out", "dq", "dk", "dv", "dsink"), (out, *grads), (ref, *ref_grads)):
        assert ours.shape == theirs.shape and rel_err(ours, theirs) < 1e-5, name


def _pages(t: torch.Tensor, cu: torch.Tensor, page: int, order: torch.Tensor, blocks: int) -> torch.Tensor:
    """The rows of t (total, Hk, D) of each sequence of cu laid in pages of a pool of `blocks`, sequence
    b's j-th page at pool block order[b][j]; the rest of the pool random."""
    pool = torch.randn(blocks, page, *t.shape[1:], dtype=t.dtype)
    for b in range(len(cu) - 1):
        rows = t[int(cu[b]):int(cu[b + 1])]
        for j in range(0, rows.shape[0], page):
            pool[order[b][j // page], :min(page, rows.shape[0] - j)] = rows[j:j + page]
    return pool


@pytest.mark.parametrize("dims", [(192, 128), (64, 256)], ids=_pair_id)
def test_paged_varlen(backend, dims):
    """flash_attn_varlen_func with block_table: a key cache and a value cache of their own head dims,
    read in place through one page table."""
    torch.manual_seed(seed_of(dims, "paged"))
    lens_q, lens_k, page = [3, 20], [10, 37], 8
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q, k, v = (t[0] for t in _qkv(1, sum(lens_q), sum(lens_k), 4, 2, dims))
    pages = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(pages) + 2).split(pages + [2])
    table = torch.stack([torch.cat([o, torch.zeros(max(pages) - len(o), dtype=o.dtype)]) for o in order[:2]]).int()
    k_cache, v_cache = (_pages(t, cu_k, page, order, sum(pages) + 2) for t in (k, v))
    out = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         block_table=table)
    assert rel_err(out, varlen_reference(q, k, v, cu_q, cu_k, causal=True)) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dims", [(192, 128), (40, 96)] + WIDE, ids=_pair_id)
def test_kvcache(backend, dims, paged, num_splits):
    """flash_attn_with_kvcache with v_cache (and the new v) of v's head dim: the new keys and values land
    in their caches, and the output (split and combined, or not) is the oracle's on the updated caches,
    GQA packed, causal over two new tokens, with a learnable sink (counted by the decode kernel or the
    combine)."""
    torch.manual_seed(seed_of(dims, paged, num_splits))
    d, dv = dims
    batch, nheads, nheads_k, seqlen_new, capacity, page = 2, 4, 2, 2, 48, 16
    seqlens = torch.tensor([7, 40], dtype=torch.int32)
    rows = batch * capacity // page + 1 if paged else batch
    per_row = page if paged else capacity
    k_cache, v_cache = (torch.randn(rows, per_row, nheads_k, n) for n in (d, dv))
    table = torch.randperm(rows)[:batch * capacity // page].view(batch, -1).int() if paged else None
    q = torch.randn(batch, seqlen_new, nheads, d)
    k_new, v_new = (torch.randn(batch, seqlen_new, nheads_k, n) for n in (d, dv))
    sink = torch.randn(nheads)
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                               block_table=table, causal=True, num_splits=num_splits,
                                               return_softmax_lse=True, learnable_sink=sink)
    assert out.shape == (batch, seqlen_new, nheads, dv)
    for b, n in enumerate(seqlens.tolist()):
        keys, values = ((cache[table[b].long()].flatten(0, 1) if paged else cache[b])[:n + seqlen_new]
                        for cache in (k_cache, v_cache))
        assert torch.equal(keys[n:], k_new[b]) and torch.equal(values[n:], v_new[b])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None], values[None], causal=True, learnable_sink=sink)
        assert rel_err(out[b:b + 1], ref) < 1e-5, b
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=1e-5)


@pytest.mark.parametrize("dims", [(192, 128), (40, 96)], ids=_pair_id)
def test_explicit_passes(backend, dims):
    """cuflash.forward and cuflash.backward: out and the dout they take have v's head dim."""
    torch.manual_seed(seed_of(dims, "explicit"))
    q, k, v = _qkv(2, 19, 25, 4, 2, dims)
    out, lse = cuflash.forward(q, k, v, causal=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True)
    assert rel_err(out, ref) < 1e-5 and torch.allclose(lse.double(), ref_lse, atol=1e-5)
    dout = torch.randn_like(out)
    grads = cuflash.backward(dout, q, k, v, out, lse, causal=True)
    doubles = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_reference(*doubles, causal=True)[0], doubles, dout.double())
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert ours.shape == theirs.shape and rel_err(ours, theirs) < 1e-5, name
    blocks = cuflash.forward(q, k, v, causal=True, block_m=16, block_n=32)[0]  # user tiles
    assert rel_err(blocks, ref) < 1e-5
    for name, bad in (("dout", torch.randn(*q.shape)), ("out", torch.randn(*q.shape[:-1], dims[1] + 1))):
        args = {"dout": dout, "out": out, name: bad}  # (q's head dim, or another: not v's)
        with raises(ErrorCode.SHAPE_MISMATCH, name, str(tuple(out.shape))):
            cuflash.backward(args["dout"], q, k, v, args["out"], lse, causal=True)


@pytest.mark.parametrize("dims", [(192, 128), (16, 40), (40, 16)], ids=_pair_id)
def test_sdpa_runs_without_padding(backend, dims, monkeypatch):
    """scaled_dot_product_attention with Ev != E equals torch's own SDPA (math, float64) in output and
    gradients, with GQA, causal, a mask, and inputs of 3 and 5 dims; the backend gets v as it is, not
    padded to the larger head dim."""
    from cuflash import cpu, kernels
    seen = []
    for module in (cpu, kernels):
        real = module.attention_forward
        monkeypatch.setattr(module, "attention_forward", lambda q, k, v, *a, real=real, **kw:
                            seen.append((q.shape[-1], v.shape[-1])) or real(q, k, v, *a, **kw))
    torch.manual_seed(seed_of(dims, "sdpa"))
    e, ev = dims
    mask = torch.rand(11, 14) > 0.3
    cases = [((2, 4, 11, e), (2, 2, 14, e), (2, 2, 14, ev), dict(is_causal=True, enable_gqa=True)),
             ((3, 11, e), (3, 14, e), (3, 14, ev), dict(attn_mask=mask, scale=0.2)),
             ((2, 1, 3, 11, e), (2, 1, 3, 14, e), (2, 1, 3, 14, ev), dict())]
    for shapes in cases:
        *tensor_shapes, options = shapes
        query, key, value = (torch.randn(*shape, requires_grad=True) for shape in tensor_shapes)
        ours = cuflash.scaled_dot_product_attention(query, key, value, **options)
        doubles = [t.detach().double().requires_grad_() for t in (query, key, value)]
        theirs = torch.nn.functional.scaled_dot_product_attention(*doubles, **options)
        assert ours.shape == theirs.shape == (*query.shape[:-1], ev)
        dout = torch.randn_like(ours)
        grads = torch.autograd.grad(ours, (query, key, value), dout)
        ref_grads = torch.autograd.grad(theirs, doubles, dout.double())
        for name, x, y in zip(("out", "dq", "dk", "dv"), (ours, *grads), (theirs, *ref_grads)):
            assert rel_err(x, y) < 1e-5, (name, options)
    assert seen and set(seen) == {dims}


@pytest.mark.parametrize("dims", [(24, 40), (40, 16)], ids=_pair_id)
def test_flex_attention(backend, dims):
    """flex_attention with Ev != E (torch takes it): a score_mod and a block mask of documents, output and
    gradients against the oracle."""
    torch.manual_seed(seed_of(dims, "flex"))
    q, k, v = _qkv(2, 40, 40, 4, 2, dims)
    docs = torch.arange(40) // 16

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs()

    def same_doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    mask = cuflash.create_block_mask(same_doc, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)

    def ours(a, b, c):
        return cuflash.flex_attention(*(t.transpose(1, 2) for t in (a, b, c)), score_mod=bias, block_mask=mask,
                                      enable_gqa=True).transpose(1, 2)
    assert ours(q, k, v).shape == (2, 40, 4, dims[1])
    check_against_oracle(ours, q, k, v, False, with_sdpa=False, score_mod=bias, mask_mod=same_doc,
                         causal_offset=0)


def test_custom_ops_with_a_value_dim(backend):
    """The custom ops (torch.compile's way in) with Ev != E: their fake implementations give the real
    outputs' shapes (torch.library.opcheck), forward, backward and decode."""
    from cuflash import ops
    from cuflash.params import AttentionParams
    torch.manual_seed(3)
    q, k, v = _qkv(1, 9, 12, 4, 2, (24, 40))
    params = AttentionParams(0.2, window_right=0)
    args = (q, k, v, *ops.op_args(params))
    assert all(r == "SUCCESS" for r in torch.library.opcheck(torch.ops.cuflash.fwd.default, args,
                                                             test_utils=("test_schema", "test_faketensor")).values())
    out, lse = torch.ops.cuflash.fwd(*args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, None, *ops.op_args(params))
    assert all(r == "SUCCESS" for r in torch.library.opcheck(torch.ops.cuflash.bwd.default, bwd_args,
                                                             test_utils=("test_schema", "test_faketensor")).values())
    k_cache, v_cache = torch.randn(1, 16, 2, 24), torch.randn(1, 16, 2, 40)
    decode_args = (q[:, :2], k_cache, v_cache, None, 10, 0, None, None, None, 0, 0.2, -1, 0, 0.0, None, None)
    assert all(r == "SUCCESS" for r in torch.library.opcheck(torch.ops.cuflash.decode.default, decode_args,
                                                             test_utils=("test_schema", "test_faketensor")).values())


def test_checks_name_the_head_dim_at_fault():
    """k's head dim must equal q's (k named); v's may differ, up to MAX_HEAD_DIM (v, v_cache or the new v
    named where it does not); callers that take one head dim (ring attention, Ulysses, the teaching
    methods) refuse a v of another, naming v."""
    q, k, v = _qkv(1, 4, 6, 2, 2, (16, 24))
    with raises(ErrorCode.SHAPE_MISMATCH, "k", "head dim 8", "16"):
        cuflash.flash_attn_func(q, k[..., :8], v)
    too_wide = torch.randn(1, 6, 2, MAX_HEAD_DIM + 8)
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "v", str(MAX_HEAD_DIM + 8), f"1 to {MAX_HEAD_DIM}"):
        cuflash.flash_attn_func(q, k, too_wide)
    with raises(ErrorCode.SHAPE_MISMATCH, "v", "(1, 5, 2, 24)"):
        cuflash.flash_attn_func(q, k, v[:, :5])
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "value", str(MAX_HEAD_DIM + 8)):
        cuflash.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), too_wide.transpose(1, 2))
    k_cache, v_cache = torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 24)
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "v_cache", str(MAX_HEAD_DIM + 8)):
        cuflash.flash_attn_with_kvcache(q, k_cache, torch.zeros(1, 16, 2, MAX_HEAD_DIM + 8), cache_seqlens=3)
    with raises(ErrorCode.SHAPE_MISMATCH, "v_cache", "(1, 8, 2, 24)"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache[:, :8], cache_seqlens=3)
    with raises(ErrorCode.SHAPE_MISMATCH, "v", "v_cache"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k[:, :1], v[:, :1, :, :16], cache_seqlens=3)
    from cuflash import methods
    with raises(ErrorCode.SHAPE_MISMATCH, "v", "one head dim"):
        methods.forward("fa2", q, k, v)
    cuflash.flash_attn_func(q, k, v)  # (the same tensors with v's head dim of its own: accepted)


def test_the_plan_takes_the_tiles_of_the_larger_head_dim():
    """The launch table's Triton tiles are the larger head dim's (at (192, 128) D=256's, at (64, 256) too),
    so that both tiles fit (Hopper's Gluon candidates at (192, 128) are its own); user tiles take their
    warps and their shared memory check from both dims, and a decode step its tiles."""
    from cuflash.kernels import plan
    from cuflash.kernels.variant import problem
    from cuflash.params import AttentionParams
    for arch in (80, 90):
        for (d, dv), width in (((192, 128), 256), ((64, 256), 256), ((128, 64), 128), ((40, 96), 128)):
            q, k, v = _qkv(1, 2, 2, 2, 2, (d, dv), torch.float16)
            prob = problem(q, k, v, AttentionParams(1.0))
            cell = plan.entry(arch, prob.block_d, False, False, plan.Length.LONGER, True, prob.block_dv)
            wide = plan.entry(arch, width, False, False, plan.Length.LONGER, True)
            assert [c[-1] for c in (cell.forward, cell.dkdv, cell.dq)] == \
                [c[-1] for c in (wide.forward, wide.dkdv, wide.dq)], (d, dv)
    # the dK/dV pass's two accumulators: 32 keys x (64 + 256) = 10240 elements > 8192 take 8 warps
    assert plan._user_warps(16, 32, 64, 256) == 8 and plan._user_warps(16, 32, 64, 64) == 4
    q, k, v = _qkv(1, 2, 2, 2, 2, (16, 256), torch.float16)
    tiles = plan.select_decode(q, k, v, None, 1)
    assert tiles.tiles == plan.decode_tiles(q, 256, False, split=False)


def test_packed_functions_keep_one_head_dim():
    """qkvpacked and kvpacked stack k and v, so they share the head dim by construction; the varlen
    packed ones likewise (nothing to choose)."""
    torch.manual_seed(5)
    qkv = torch.randn(1, 6, 3, 2, 16)
    out = cuflash.flash_attn_qkvpacked_func(qkv)
    assert out.shape == (1, 6, 2, 16)


# GPU: the compiled kernels in 16-bit (the interpreter has no bf16 dot).

GPU_PAIRS = [(192, 128), (64, 128), (128, 64), (96, 40), (40, 96), (64, 256), (64, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (300, 700), (700, 129), (1, 2049)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", GPU_PAIRS, ids=_pair_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_kernels_on_gpu(dtype, dims, causal, seqlen_q, seqlen_k, monkeypatch):
    """The Triton forward and backward (delta, dK/dV, dQ; the one-launch backward up to 128 keys) forced
    at each pair, the table's Triton tiles of the larger head dim, against the oracle and 2x torch's error."""
    torch.manual_seed(seed_of(dims, causal, seqlen_q, seqlen_k))
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, dims, dtype, "cuda")
    cell = table_cell(q, max(dims), max(seqlen_q, seqlen_k), causal)
    force_candidates(monkeypatch, forward=cell.forward[-1:], dkdv=cell.dkdv[-1:], dq=cell.dq[-1:])
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", GPU_PAIRS, ids=_pair_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_table_on_gpu(dtype, dims, causal):
    """What the table runs at each pair (on Hopper the Gluon forward and dK/dV at (192, 128), Triton
    elsewhere), at lengths of each class, with varlen for the Triton kernels."""
    for n in (100, 300, 1000, 3000):
        torch.manual_seed(seed_of(dims, causal, n))
        q, k, v = _qkv(2, n, n, 8, 2, dims, dtype, "cuda")
        check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)
    lens = [300, 1, 777]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (t[0] for t in _qkv(1, sum(lens), sum(lens), 8, 2, dims, dtype, "cuda"))
    out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    assert rel_err(out, varlen_reference(q, k, v, cu, cu, causal=causal)) < BOUNDS[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dims", [(192, 128), (40, 96)] + WIDE, ids=_pair_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kvcache_on_gpu(dtype, dims, paged, num_splits):
    """A decode step appending one token per sequence into caches of their own head dims (a latent
    cache's (64, 512) where the head dims go that far), split and combined or not, against the oracle."""
    torch.manual_seed(seed_of(dims, paged, num_splits))
    d, dv = dims
    batch, nheads, nheads_k, capacity, page = 4, 32, 4, 2048, 64
    seqlens = torch.tensor([0, 700, capacity - 1, 255], dtype=torch.int32, device="cuda")
    rows = batch * capacity // page + 3 if paged else batch
    k_cache, v_cache = (torch.randn(rows, page if paged else capacity, nheads_k, n, dtype=dtype, device="cuda")
                        for n in dims)
    table = torch.randperm(rows, device="cuda")[:batch * capacity // page].view(batch, -1).int() if paged else None
    q = torch.randn(batch, 1, nheads, d, dtype=dtype, device="cuda")
    k_new, v_new = (torch.randn(batch, 1, nheads_k, n, dtype=dtype, device="cuda") for n in dims)
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          block_table=table, causal=True, num_splits=num_splits)
    assert out.shape == (batch, 1, nheads, dv)
    for b, n in enumerate(seqlens.tolist()):
        keys, values = ((cache[table[b].long()].flatten(0, 1) if paged else cache[b])[:n + 1]
                        for cache in (k_cache, v_cache))
        ref, _ = attention_reference(q[b:b + 1], keys[None], values[None], causal=True)
        assert rel_err(out[b:b + 1], ref) < BOUNDS[dtype], b


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (129, 77)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("consumers,block_n,stages,early_k", [(2, 128, 2, False), (2, 64, 3, False), (2, 64, 4, False),
                                                              (2, 64, 4, True), (3, 64, 3, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_forward_on_gpu(dtype, consumers, block_n, stages, early_k, causal, seqlen_q, seqlen_k, layout,
                              monkeypatch):
    """The Gluon forward at (192, 128) (Q and K in 128 + 64 columns, the S product accumulating over
    both), forced in each configuration: 128-key tiles in 2 buffers (one Q buffer, O through a K tile),
    64-key tiles in 3 (two Q buffers) or 4 (one, O through it; with early_k, each K buffer released once
    its S products have read it, as the table runs beyond 256 keys), three consumers; ragged tiles, GQA,
    rows that see no key, non-contiguous inputs; the gradients (Triton's backward) check its lse."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import forward as gluon_forward
    from cuflash.kernels.variant import problem
    from cuflash.params import AttentionParams
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (sm_90)")
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, (192, 128), dtype, "cuda")
    if layout == "bhnd":  # (views of (B, H, N, D) buffers, as SDPA's callers hand them)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    params = AttentionParams(192 ** -0.5, window_right=0 if causal else -1)
    assert gluon.accepts(problem(q, k, v, params), params)
    cfg = gluon.Forward(consumers, block_n, stages, early_k)
    force_candidates(monkeypatch, forward=(cfg, table_cell(q, 256, max(seqlen_q, seqlen_k), causal).forward[-1]))
    launched, launch_args = [], gluon_forward.launch_args
    monkeypatch.setattr(gluon_forward, "launch_args", lambda *args: launched.append(args[-1]) or launch_args(*args))
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)
    assert launched and set(launched) == {cfg}


@pytest.mark.gpu
@pytest.mark.parametrize("mods", ["score_mod", "block_mask"])
def test_gluon_forward_with_mods_on_gpu(mods):
    """The Gluon forward at (192, 128) with a score_mod (a relative bias) and a block mask of documents,
    against the oracle (the table keeps the Gluon forward for mods, plan._within_blocks)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (sm_90)")
    torch.manual_seed(11)
    q, k, v = _qkv(2, 1000, 1000, 8, 2, (192, 128), torch.bfloat16, "cuda")
    docs = torch.arange(1000, device="cuda") // 256

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).abs()

    def same_doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    if mods == "score_mod":
        check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, score_mod=bias), q, k, v, False,
                             with_sdpa=False, score_mod=bias)
    else:
        mask = cuflash.create_block_mask(same_doc, None, None, 1000, 1000, device="cuda")
        out = cuflash.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=mask,
                                     enable_gqa=True).transpose(1, 2)
        ref, _ = attention_reference(q, k, v, mask_mod=lambda b, h, i, j: same_doc(b, h, i, j))
        assert rel_err(out, ref) < BOUNDS[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (129, 77)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_dkdv_on_gpu(dtype, stages, causal, seqlen_q, seqlen_k, monkeypatch):
    """The Gluon dK/dV kernel at (192, 128), forced (split-D consumers on one 64-key item: consumer 0 dK's
    first 128 columns, consumer 1 its last 64, each half of dV's; S^T over Q's and K's two parts; 2 or 3
    Q/dO buffers, two K/V buffers or one), beside Triton's dQ, against the oracle: ragged tiles, GQA, rows
    and keys that see nothing, deterministic (no atomics: bitwise the same twice)."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import backward as gluon_backward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (sm_90)")
    torch.manual_seed(seqlen_q + seqlen_k + stages)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, (192, 128), dtype, "cuda")
    cell = table_cell(q, 256, max(seqlen_q, seqlen_k), causal)
    cfg = gluon.Dkdv(stages=stages)
    force_candidates(monkeypatch, forward=cell.forward[-1:], dkdv=(cfg, cell.dkdv[-1]), dq=cell.dq[-1:])
    launched, dkdv_launch = [], gluon_backward.dkdv_launch
    monkeypatch.setattr(gluon_backward, "dkdv_launch", lambda *args: launched.append(args[-1]) or dkdv_launch(*args))

    def fn(a, b, c):
        return cuflash.flash_attn_func(a, b, c, causal=causal)
    check_against_oracle(fn, q, k, v, causal)
    assert launched and set(launched) == {cfg}
    dout = torch.randn(*q.shape[:-1], 128, dtype=dtype, device="cuda")
    grads = [torch.autograd.grad(fn(*leaves), leaves, dout)
             for leaves in [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (129, 77)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gluon_dq_on_gpu(dtype, stages, causal, seqlen_q, seqlen_k, monkeypatch):
    """The Gluon dQ kernel at (192, 128), forced (64-key tiles, S over Q's and K's two parts, dQ in two
    accumulators leaving through each consumer's Q tiles), beside Triton's dK/dV, against the oracle:
    ragged tiles, GQA, rows that see no key."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import backward as gluon_backward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (sm_90)")
    torch.manual_seed(seqlen_q + seqlen_k + stages + 1)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, (192, 128), dtype, "cuda")
    cell = table_cell(q, 256, max(seqlen_q, seqlen_k), causal)
    cfg = gluon.Dq(64, stages)
    force_candidates(monkeypatch, forward=cell.forward[-1:], dkdv=cell.dkdv[-1:], dq=(cfg, cell.dq[-1]))
    launched, dq_launch = [], gluon_backward.dq_launch
    monkeypatch.setattr(gluon_backward, "dq_launch", lambda *args: launched.append(args[-1]) or dq_launch(*args))
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal), q, k, v, causal)
    assert launched and set(launched) == {cfg}
