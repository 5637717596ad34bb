"""Kernel choice and launch: the table's candidates and what each kernel family accepts, tensor
descriptors, launch plans; on the GPU every length class, the Gluon kernels forced where the table takes
others, and the Triton kernels they fall back to."""
import pytest
import torch

import cuflash
from attn_testing import BOUNDS, check_against_oracle, check_tile_loads, count_plan_lookups, flash_fn, \
    force_candidates, interpret, make_qkv, rel_err, run_and_grad, seed_of, table_cell, varlen_batch
from cuflash.kernels import gluon
from cuflash.kernels.plan import Plan
from cuflash.kernels.triton import OneLaunch, Tiles
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference



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
    16-bit inputs at D=64/128/256 (what the Gluon kernels take), with key tiles and buffers that fit
    their shared memory (launch_args validates them). Which candidate wins where is measured, not
    restated here (docs/tuning.md); that each compiles and computes the right thing is
    test_every_length_class_on_gpu below."""
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
                    # The one-launch backward comes first, on valid tiles that hold the class's keys.
                    assert not any(isinstance(c, OneLaunch) for c in cell.forward + cell.dkdv[1:] + cell.dq), cell
                    if isinstance(cell.dkdv[0], OneLaunch):
                        one = cell.dkdv[0].tiles
                        assert one.block_n >= keys and one.block_m in (16, 32, 64, 128) and not one.tma, cell
                    if not any(isinstance(c, (gluon.Forward, gluon.Dkdv, gluon.Dq))
                               for c in cell.forward + cell.dkdv + cell.dq):
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
    the gpu tests below)."""
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
    with pytest.raises(ValueError, match="early_k"):  # (D=128, 128-key tiles: O leaves through a K tile)
        gluon_forward.launch_args(dict(Q=q, K=k, V=k, Out=q), problem(q, k, k, causal), causal,
                                  gluon.Forward(2, 128, 3, early_k=True))
    wide = torch.randn(2, 600, 4, 256, dtype=torch.bfloat16)  # D=256: one Q buffer, at most 2 K/V buffers of 64 keys
    assert gluon.accepts(problem(wide, wide, wide, causal), causal)
    assert gluon.accepts(problem(wide, wide, wide, causal, wide), causal)  # (dK/dV; dQ stays Triton at D=256)
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


def test_one_launch_backward_only_where_one_key_tile_holds_every_key():
    """A OneLaunch candidate makes the Triton dK/dV kernel the whole backward (dq None), deterministic
    calls too (no atomics), where its key tile holds every key and its programs (batch x KV heads, each
    through its group of query heads) come to at most 4 heads per SM (the interpreter has 4 "SMs");
    elsewhere the next candidates run."""
    from cuflash.kernels.plan import Entry, select
    wide, dq = Tiles(16, 64, 4, 2), Tiles(32, 16, 4, 2)
    cell = Entry((wide,), (OneLaunch(wide), gluon.Dkdv(fuse_dq=False), dq), (dq,))
    for params in (AttentionParams(0.1), AttentionParams(0.1, deterministic=True)):
        for seqlen_q, seqlen_k, batch, nheads, nheads_k, one in (
                (300, 64, 1, 2, 2, True), (1, 1, 1, 2, 2, True), (64, 65, 1, 2, 2, False),  # keys
                (64, 64, 8, 2, 2, True), (64, 64, 9, 2, 2, False),  # 16 programs of one head: 4 per SM
                (64, 64, 1, 16, 4, True), (64, 64, 1, 16, 2, False),  # 4 programs of 4 heads, 2 of 8
                (64, 64, 2, 8, 2, True), (64, 64, 3, 8, 2, False)):  # 1 wave of 4 heads, 2 waves
            q = torch.randn(batch, seqlen_q, nheads, 64, dtype=torch.bfloat16)
            k = torch.randn(batch, seqlen_k, nheads_k, 64, dtype=torch.bfloat16)
            plan = select(problem(q, k, k, params, q), params, cell)
            assert plan == (Plan(wide, wide, None) if one else Plan(wide, gluon.Dkdv(False), dq)), plan
    plain = AttentionParams(0.1)
    for batch, plan in ((1, Plan(wide, wide, None)), (9, Plan(wide, dq, dq))):
        q = torch.randn(batch, 64, 2, 64)  # fp32: no Gluon kernel
        assert select(problem(q, q, q, plain, q), plain, cell) == plan


ONE_LAUNCH_CASES = ["causal, more queries", "window", "varlen, a sequence without keys", "softcap, ALiBi",
                    "dropout, causal"]


@interpret
@pytest.mark.parametrize("head_dim", [32, 40])
@pytest.mark.parametrize("case", ONE_LAUNCH_CASES)
def test_one_launch_backward_writes_every_row(case, head_dim, monkeypatch):
    """The one-launch backward (the interpreter's table takes it up to 32 keys and a few heads): see
    check_one_launch_backward."""
    check_one_launch_backward(case, "cpu", torch.float32, head_dim, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ONE_LAUNCH_CASES)
def test_one_launch_backward_on_gpu(case, dtype, head_dim, monkeypatch):
    """The table's one-launch backward up to 128 keys (D=64/128 tiles, 16-bit): as on the CPU."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the table takes the one-launch backward from sm_90 on")
    check_one_launch_backward(case, "cuda", dtype, head_dim, monkeypatch)


def check_one_launch_backward(case, device, dtype, head_dim, monkeypatch):
    """The one-launch backward computes delta and dQ in the dK/dV kernel: dQ matches float64 (with
    softcap and ALiBi, and with dropout given its keep mask), and rows that see no key (above a causal
    diagonal, outside a window, a varlen sequence with no keys), which no query tile of the kernel's band
    visits, get 0, with dQ's memory poisoned (NaN) before the call. One launch, no workspace."""
    from cuflash import memo
    from cuflash.kernels import attention, launch
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    monkeypatch.setattr(launch, "_plans", {})
    monkeypatch.setattr(memo, "CHECKED", {})

    class Poisoned:  # attention.py's torch, whose empty_like fills with NaN
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(t, **kwargs):
            return torch.full_like(t, float("nan"), **kwargs)

    monkeypatch.setattr(attention, "torch", Poisoned())
    torch.manual_seed(seed_of(case, head_dim))
    if case.startswith("varlen"):
        lens_q, lens_k = [5, 20, 3], [0, 32, 7]
        q, k, v, cu_q, cu_k = varlen_batch(lens_q, lens_k, 4, 2, head_dim, dtype, device)
        dout = torch.randn_like(q)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        # (no band: only the sequence without keys has rows that no query tile visits)
        out = cuflash.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k))
        out.backward(dout)
        for b in range(3):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            ref = run_and_grad(lambda a, c, d: attention_reference(a, c, d)[0], q[None, rows].double(),
                               k[None, keys].double(), v[None, keys].double(), dout[None, rows].double())
            for ours, theirs in zip((out, qg.grad, kg.grad, vg.grad), ref):
                part = ours[rows] if ours.shape[0] == q.shape[0] else ours[keys]
                assert rel_err(part[None], theirs) < BOUNDS[dtype] if theirs.any() else not part.any()
    elif case == "causal, more queries":
        q, k, v = make_qkv(2, 45, 9, 4, 2, head_dim, dtype, device)
        check_against_oracle(flash_fn(True), q, k, v, True, with_sdpa=False)
    elif case == "dropout, causal":  # the oracle given the keep mask, which return_attn_probs reveals
        q, k, v = make_qkv(2, 29, 20, 4, 2, head_dim, dtype, device)
        torch.manual_seed(100)
        probs = cuflash.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)[2]

        def dropped(a, b, c):
            torch.manual_seed(100)  # the same seed draws the same mask
            return cuflash.flash_attn_func(a, b, c, dropout_p=0.3, causal=True)
        check_against_oracle(dropped, q, k, v, True, with_sdpa=False, dropout_p=0.3, dropout_keep=probs >= 0)
    elif case == "window":
        q, k, v = make_qkv(1, 70, 30, 2, 1, head_dim, dtype, device)
        check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, window_size=(3, 2)), q, k, v, False,
                             with_sdpa=False, window_size=(3, 2))
    else:
        q, k, v = make_qkv(1, 33, 17, 2, 2, head_dim, dtype, device)
        slopes = torch.rand(2, device=device)
        check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, softcap=5.0, alibi_slopes=slopes),
                             q, k, v, False, with_sdpa=False, softcap=5.0, alibi_slopes=slopes)
    backward = [p for key, p in launch._plans.items() if key[0][0] is attention.attention_backward]
    assert backward and all(len(p.launches) == 1 and not p.workspaces for p in backward)


def test_user_tiles_that_overflow_shared_memory_are_refused_before_compiling(monkeypatch):
    """Tiles a call asks for whose streamed tiles alone exceed the GPU's shared memory raise a
    FlashAttentionError naming them at planning (a compile of them can run for minutes); the forward
    streams block_n-row key and value tiles, the backward also block_m-row query and dO tiles."""
    from cuflash.kernels import plan
    from cuflash.kernels.plan import select

    monkeypatch.setattr(plan, "max_shared_memory", lambda device: 64 * 1024)  # bytes
    q = torch.randn(1, 64, 2, 256)  # fp32 D=256: a 32-row tile is 32 KiB
    ok = AttentionParams(0.1, block_m=64, block_n=32)
    # 2 x 32 KiB: fits; 8 warps for the 64 x (256 + 32) fp32 accumulators (plan._user_warps)
    assert select(problem(q, q, q, ok), ok).forward == Tiles(64, 32, 8, 2)
    with pytest.raises(cuflash.FlashAttentionError, match=r"block_m=64, block_n=32 .*128 KiB.*smaller blocks"):
        select(problem(q, q, q, ok, q), ok)  # the backward's two 64-row tiles do not
    wide = AttentionParams(0.1, block_m=16, block_n=64)
    with pytest.raises(cuflash.FlashAttentionError, match="block_n=64"):
        select(problem(q, q, q, wide), wide)
    half = q.half()
    assert select(problem(half, half, half, ok, half), ok).dkdv == Tiles(64, 32, 8, 2)  # 2 x 32 KiB in fp16
    small = AttentionParams(0.1, block_m=16, block_n=16)  # 16 x (256 + 16) and 2 x 16 x 256 accumulators: 4 warps
    assert select(problem(half, half, half, small, half), small).dkdv == Tiles(16, 16, 4, 2)


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


@interpret
def test_public_calls_launch_their_signature_plans_directly(monkeypatch):
    """flash_attn_func and scaled_dot_product_attention keep the launch plans of each checked call
    signature (memo.py, ops.forward): a later call of the signature launches them without launch()'s
    lookup, forward and backward, and computes the oracle's values on its own new data; what the
    signature leaves open makes a plan of its own: a base off 16-byte alignment (Triton specializes
    pointers on it) and dO's strides."""
    from cuflash.kernels import attention

    looked_up = count_plan_lookups(monkeypatch, attention)

    def step(q, k, v, dout, sdpa=False):
        if sdpa:
            fn = lambda a, b, c: cuflash.scaled_dot_product_attention(  # noqa: E731
                a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        else:
            fn = lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True)  # noqa: E731
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # (in place: a clone would realign q)
        out = fn(*leaves)
        out.backward(dout)
        got = [out.detach()] + [t.grad for t in leaves]
        offset = 0 if sdpa else k.shape[1] - q.shape[1]
        want = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=True, causal_offset=offset)[0],
                            q.double(), k.double(), v.double(), dout.double())
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-5
        found = list(looked_up)
        looked_up.clear()
        return found

    def fresh():
        q, k, v = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
        return q, k, v, torch.randn_like(q)

    torch.manual_seed(11)
    assert step(*fresh()) == ["attention_forward", "attention_backward"]
    assert step(*fresh()) == []  # new data: the signature's plans, launched directly
    q, k, v, dout = fresh()
    shifted = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)  # base 4 bytes past 16-byte alignment
    assert step(shifted, k, v, dout) == ["attention_forward", "attention_backward"]
    assert step(shifted, k, v, dout) == []
    strided = torch.randn(2, 4, 17, 40).transpose(1, 2)  # dO at other strides
    assert step(q, k, v, strided) == ["attention_backward"]
    q, k, v, dout = fresh()
    assert step(q[:, :16], k, v, dout[:, :16], sdpa=True) == ["attention_forward", "attention_backward"]
    assert step(q[:, 1:], k, v, dout[:, 1:], sdpa=True) == []


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpret), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_sdpa_repeats_launch_their_plan_on_its_own_layout(monkeypatch, device):
    """A repeated scaled_dot_product_attention call that records no graph launches its signature's
    kept forward plan on the (B, H, N, D) inputs themselves (ops.forward_kept): no (B, N, H, D) views
    are made, the output is a (B, H, N, D) view of a (B, N, H, D) buffer as before, and new data gets
    the oracle's values. A base off 16-byte alignment has no kept plan yet and goes through the views
    once; inputs requiring grad always do, with autograd."""
    from cuflash import interface
    from cuflash.kernels import attention

    count_plan_lookups(monkeypatch, attention)
    views = []
    real_view = interface._to_flash
    monkeypatch.setattr(interface, "_to_flash", lambda t: views.append(t) or real_view(t))

    def call(q, k, v, grad=False):
        views.clear()
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = cuflash.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                                enable_gqa=True)
        assert rel_err(out.detach(), want) < 1e-5
        assert out.shape == want.shape and out.transpose(1, 2).is_contiguous()
        if grad:
            dout = torch.randn_like(out)
            out.backward(dout)
            grads = run_and_grad(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=True, enable_gqa=True), q.double(), k.double(), v.double(), dout.double())[1:]
            assert all(rel_err(t.grad, g) < 1e-5 for t, g in zip(leaves, grads))
        return len(views) > 0

    def fresh():
        return tuple(torch.randn(2, h, n, 40, device=device) for h, n in ((4, 17), (2, 23), (2, 23)))

    torch.manual_seed(12)
    assert call(*fresh())  # the first call of the signature makes its plan on the views
    assert not call(*fresh()) and not call(*fresh())
    q, k, v = fresh()
    shifted = torch.empty(q.numel() + 1, device=device)[1:].view(q.shape).copy_(q)  # base 4 bytes off 16-byte alignment
    assert call(shifted, k, v) and not call(shifted, k, v)
    assert call(*fresh(), grad=True) and call(*fresh(), grad=True)


@interpret
def test_signature_plans_keep_the_backend_of_their_settings(monkeypatch):
    """A call signature's plans keep the backend that runs it (ops._call_backend), which the
    signature fixes through CUFLASH_BACKEND: switching the variable back and forth on the same
    inputs runs the backend it names every time, each computing the oracle's values."""
    from cuflash import cpu, memo

    monkeypatch.setattr(memo, "CHECKED", {})
    ran = []
    real = cpu.attention_forward
    monkeypatch.setattr(cpu, "attention_forward", lambda *a, **kw: ran.append("cpu") or real(*a, **kw))
    torch.manual_seed(29)
    q, k, v = make_qkv(1, 9, 9, 2, 2, 16, torch.float32, "cpu")
    want, _ = attention_reference(q, k, v, causal=True)
    for choice in ("cpu", "triton", "cpu", "triton"):
        monkeypatch.setenv("CUFLASH_BACKEND", choice)
        for _ in range(2):
            assert rel_err(cuflash.flash_attn_func(q, k, v, causal=True), want) < 1e-5
    assert ran == ["cpu"] * 4


def test_compiled_launcher_calls_the_launcher_as_the_runner_does(monkeypatch):
    """compat.compiled_launcher passes the compiled kernel's launcher what Triton's runner passes it
    (grid, the current device's stream, the kernel's function and metadata, then the arguments), with
    no launch metadata or hooks while the hook chains are empty, and goes through the runner while a
    hook is set (a profiler's)."""
    from triton import knobs

    from cuflash.kernels.compat import compiled_launcher

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            calls.append(("run", args))

        def __getitem__(self, grid):
            return lambda *args: calls.append(("runner", grid, args))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)  # (absent from CPU builds)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    launch = compiled_launcher(Compiled(), (4, 5, 6))
    launch("a", 7)
    assert calls == [("run", (4, 5, 6, 1003, "function", "metadata", None, None, None, "a", 7))]
    calls.clear()

    def hook(metadata):
        pass
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch("a", 7)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls == [("runner", (4, 5, 6), ("a", 7))]


def test_kernels_compile_for_hopper_without_a_gpu():
    """The kernels an H100 runs for a causal 300-token call compile for sm_90 with the installed
    Triton and its ptxas, outside the interpreter (scripts/compile_check.py's stand-in driver, in a
    process of its own): bf16 takes the Gluon forward and backward (at D=64; at D=256, for 1000
    tokens, the forward with early_k and the split-D dK/dV), fp32 the Triton ones; and a bf16 decode
    step into a paged cache (append, decode, combine). The CPU tests run the Triton kernels through the
    interpreter and the Gluon ones not at all; this is where a kernel that would not compile on the GPU
    shows first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = ("import runpy, torch\n"
              "m = runpy.run_path('scripts/compile_check.py', run_name='compile_check')\n"
              "errors = [m['compile_case'](dtype, 64, 300, 300, 4, 2, 'causal') for dtype in (torch.bfloat16, "
              "torch.float32)]\n"
              "errors.append(m['compile_case'](torch.bfloat16, 256, 1000, 1000, 4, 2, 'causal'))\n"
              "errors.append(m['compile_decode'](torch.bfloat16, 128, True, True))\n"
              "assert errors == [None, None, None, None], errors\n")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


def test_memo_tables_drop_the_oldest_and_stay_bounded_under_threads():
    """The launch plans and the checked call signatures are bounded tables that autograd's backward
    thread and the caller's thread fill at once: dropping the oldest entry must not race (two
    threads dropping the same one raised KeyError)."""
    import sys
    import threading

    from cuflash.memo import remember

    table: dict = {}
    for i in range(5):
        assert remember(table, i, str(i), 3) == str(i)
    assert list(table) == [2, 3, 4]
    errors: list = []

    def fill(thread):
        try:
            for i in range(20000):
                remember(table, (thread, i), i, 8)
        except Exception as e:  # noqa: BLE001 (any error of a thread fails the test)
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two bytecodes, as often as possible
    try:
        threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(table) <= 8 + 3  # concurrent inserts may each find room for one


@interpret
def test_launch_plan_workspaces_are_fresh_and_made_as_asked():
    """A tensor that a plan's build adds to the launch's tensors is a workspace: every later call of
    the signature gets a new one, not the first call's: zero-filled (the fused backward's dQ sum), or
    uninitialized where build asked for that (kernels that write it whole before reading it)."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit
    def increment(Work, Scratch, Out, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Scratch + offs, offs)
        work = tl.load(Work + offs) + tl.load(Scratch + offs)
        tl.store(Work + offs, work)
        tl.store(Out + offs, work)

    def build(tensors):
        tensors["Work"] = launch.workspace((8,), torch.float32, torch.device("cpu"))
        tensors["Scratch"] = launch.workspace((8,), torch.float32, torch.device("cpu"), zeroed=False)
        return [(increment, (1,), dict(Work=tensors["Work"], Scratch=tensors["Scratch"], Out=tensors["Out"], N=8))]

    firsts = []
    for i in range(6):
        tensors = dict(Out=torch.empty(8))
        plan = launch.launch(("workspace test",), tensors, lambda: build(tensors))
        assert torch.equal(tensors["Out"], torch.arange(8.0)) and torch.equal(tensors["Work"], torch.arange(8.0))
        if i < 3:
            firsts.append(tensors["Work"])
        else:  # poisoned and freed: the allocator hands this memory out again
            tensors["Work"].fill_(float("nan"))
            tensors["Scratch"].fill_(float("nan"))
    assert len({w.data_ptr() for w in firsts}) == 3
    assert {name: zeroed for name, (*_, zeroed) in plan.workspaces.items()} == {"Work": True, "Scratch": False}


@interpret
def test_launch_plan_arguments_are_found_by_identity():
    """A kernel's tensor argument takes its place in the plan by identity among the launch's
    tensors, whatever the name (the unsplit decode writes its result through the arguments that
    name the partial buffers); a tensor that is not one of them (a view made in build) would be
    frozen into the plan and raises, as an int argument the kernel specializes on does."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit(do_not_specialize=["add"])
    def copy_add(Src, Dst, add, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Dst + offs, tl.load(Src + offs) + add)

    @triton.jit
    def copy_add_specialized(Src, Dst, add, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Dst + offs, tl.load(Src + offs) + add)

    for add in (1, 2):  # the second call: the first call's plan, new tensors and int
        tensors = dict(In=torch.arange(8.0), Out=torch.empty(8), add=add)
        launch.launch(("identity test",), tensors, lambda: [
            (copy_add, (1,), dict(Src=tensors["In"], Dst=tensors["Out"], add=tensors["add"], N=8))])
        assert torch.equal(tensors["Out"], torch.arange(8.0) + add)
    tensors = dict(In=torch.arange(16.0), Out=torch.empty(8), add=0)
    with pytest.raises(TypeError, match="Src is not one of the launch's tensors"):
        launch.launch(("view test",), tensors, lambda: [
            (copy_add, (1,), dict(Src=tensors["In"][::2], Dst=tensors["Out"], add=0, N=8))])
    with pytest.raises(TypeError, match="add may change"):
        launch.launch(("specialized test",), tensors, lambda: [
            (copy_add_specialized, (1,), dict(Src=tensors["In"], Dst=tensors["Out"], add=0, N=8))])


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [256, 512, 1024, 2048])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_length_class_on_gpu(causal, head_dim, seqlen):
    """The table's launches of the length classes test_against_oracle's lengths leave out (129-256,
    257-512, 513-1024, 1025-2048 keys; Gluon or Triton, as the table picks on this GPU) compile and
    match the oracle, forward and backward, in bf16."""
    torch.manual_seed(seed_of(causal, head_dim, seqlen))
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
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
    cell = table_cell(q, 128, 1500, True)
    check_tile_loads(q, k, v, params, cell.forward[-1], cell.dkdv[-1], cell.dq[-1], tol=1e-4)


@pytest.mark.gpu
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
        check_against_oracle(flash_fn(True), q, k, v, True)
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


@pytest.mark.gpu
def test_inputs_on_a_gpu_other_than_the_current_one():
    """Inputs on cuda:1 while cuda:0 stays current, as in a model split over GPUs in one process
    (transformers' device_map="auto"): the Gluon and Triton kernels, forward and backward, first
    call and the signature's plans after it, match the oracle; a paged decode step, the rotary
    kernel and the teaching methods give what they give with cuda:1 current; cuda:0 stays current."""
    from cuflash import methods
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with torch.cuda.device(0):
        for dtype, seqlen in ((torch.bfloat16, 1100), (torch.float32, 70)):
            torch.manual_seed(seqlen)
            for _ in range(2):
                q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 64, dtype, "cuda:1")
                check_against_oracle(flash_fn(True), q, k, v, True)

        def decode_step(device_index):
            torch.manual_seed(9)
            q1, k1, v1 = (torch.randn(2, 1, 8, 128, device="cuda:1", dtype=torch.bfloat16) for _ in range(3))
            pages = [torch.randn(16, 16, 8, 128, device="cuda:1", dtype=torch.bfloat16) for _ in range(2)]
            table = torch.randperm(16, device="cuda:1", dtype=torch.int32).view(2, 8)
            seqlens = torch.tensor([100, 37], device="cuda:1", dtype=torch.int32)
            with torch.cuda.device(device_index):
                out = cuflash.flash_attn_with_kvcache(q1, *pages, k1, v1, cache_seqlens=seqlens, block_table=table,
                                                      causal=True)
                x = torch.randn(2, 9, 4, 64, device="cuda:1")
                cos, sin = torch.randn(2, 32, 16, device="cuda:1").unbind(0)
                rotated = cuflash.apply_rotary_emb(x, cos, sin)
                fa1 = methods.forward("fa1", *make_qkv(1, 40, 40, 2, 2, 32, torch.float32, "cuda:1"))[0]
            return out, *pages, rotated, fa1

        for ours, theirs in zip(decode_step(0), decode_step(1)):
            assert torch.equal(ours, theirs)
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_launch_plans_call_launch_hooks_on_gpu():
    """A profiler's launch hook (Triton's knobs.runtime.launch_enter_hook) sees the launches of a
    signature's plans too (compat.compiled_launcher goes through Triton's runner while one is set),
    and the results stay the oracle's."""
    from triton import knobs
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    torch.manual_seed(2)
    q, k, v = make_qkv(2, 300, 300, 4, 2, 64, torch.bfloat16, "cuda")
    check_against_oracle(flash_fn(True), q, k, v, True)  # the signature's plans made
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        check_against_oracle(flash_fn(True), q, k, v, True)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert any("attn_fwd" in name for name in seen) and any("bwd" in name for name in seen), seen


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 1000), (1000, 1)])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_length_one_with_descriptor_launches(causal, head_dim, seqlen_q, seqlen_k):
    """Lengths of 1 under launches that ask for tensor descriptors (D=128 dK/dV beyond 512 keys,
    D=256): Triton 3.6 fails to compile the descriptor loops for them (seqlen_q 1 with GQA in the
    dK/dV pipeliner, ptxas on the D=256 causal 1 x 1 forward), so Tiles.on reads through pointers."""
    torch.manual_seed(seqlen_q + seqlen_k + head_dim)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
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
    force_candidates(monkeypatch, forward=(cfg, table_cell(q, head_dim, max(seqlen_q, seqlen_k), causal).forward[-1]))
    launched, launch_args = [], gluon_forward.launch_args
    monkeypatch.setattr(gluon_forward, "launch_args", lambda *args: launched.append(args[-1]) or launch_args(*args))
    check_against_oracle(flash_fn(causal), q, k, v, causal)
    assert launched and set(launched) == {cfg}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, False), (64, True)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 300), (129, 500), (500, 17), (17, 200), (1, 100), (128, 77)])
def test_hopper_short(seqlen_q, seqlen_k, head_dim, causal):
    """Up to 128 keys and queries one Triton launch takes the whole backward; beyond, up to 512 keys,
    the Gluon dK/dV kernel, and at D=128 non-causal from 257 keys (the table's length class 2) the Gluon
    dQ kernel too. The Gluon forward runs but causal up to 64 keys (here 100) and at D=64 causal for
    257-512 keys; with 64-key tiles up to 256 keys (D=64: 512) and causal up to 1k."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (sm_90)")
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = make_qkv(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, "cuda")
    n = max(seqlen_q, seqlen_k)
    cell = table_cell(q, head_dim, n, causal)
    plain = head_dim == 128 and not causal
    assert isinstance(cell.dkdv[0], OneLaunch) == (n <= 128)
    assert cell.dkdv[n <= 128] == gluon.Dkdv(fuse_dq=False)
    assert isinstance(cell.dq[0], gluon.Dq) == (plain and n > 256)
    fwd = cell.forward[0]
    assert isinstance(fwd, gluon.Forward) == (not (causal and (n <= 128 or head_dim == 64 and 256 < n <= 512)))
    assert not isinstance(fwd, gluon.Forward) or fwd.block_n == (64 if n <= 256 or causal or head_dim == 64 else 128)
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
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
    fwd = table_cell(q, 256, max(seqlen_q, seqlen_k), causal).forward
    if torch.cuda.get_device_capability() == (9, 0):
        short = causal or max(seqlen_q, seqlen_k) <= 256
        assert (fwd[-1].block_n, fwd[-1].tma, isinstance(fwd[0], gluon.Forward)) == \
            ((32, False, True) if short else (64, True, True))
    if not gluon_forward:
        force_candidates(monkeypatch, forward=fwd[-1:])
    check_against_oracle(flash_fn(causal), q, k, v, causal)


@pytest.mark.gpu
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
    cell = table_cell(q, head_dim, max(seqlen_q, seqlen_k), causal)
    assert isinstance(cell.dkdv[0], gluon.Dkdv) and isinstance(cell.dq[0], gluon.Dq) == (head_dim == 128)
    assert gluon.accepts(problem(q, k, v, params, torch.empty_like(q)), params)
    if fused:
        force_candidates(monkeypatch, dkdv=(gluon.Dkdv(fuse_dq=True), cell.dkdv[-1]))
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, deterministic=not fused),
                         q, k, v, causal)
    if fused:
        assert any("DQAcc" in plan.workspaces for plan in launch._plans.values())


@pytest.mark.gpu
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
    cell = table_cell(torch.empty(1, dtype=torch.bfloat16), head_dim, 1100, causal)
    force_candidates(monkeypatch, dkdv=(gluon.Dkdv(fuse_dq=fused), cell.dkdv[-1]))
    torch.manual_seed(head_dim)
    q, k, v = make_qkv(2, 1000, 1100, 4, 2, head_dim, torch.bfloat16, "cuda")
    check_against_oracle(lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=causal, deterministic=not fused),
                         q, k, v, causal)
    assert any("DQAcc" in plan.workspaces for plan in launch._plans.values()) == fused


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(3000, 600), (600, 3000)])
def test_hopper_forward_top_left_causal(seqlen_q, seqlen_k):
    """SDPA's causal mask (top-left aligned) through the Gluon forward."""
    torch.manual_seed(seqlen_q)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 4, 128, torch.bfloat16, "cuda", layout="bhnd")
    ours = cuflash.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).double() for x in (q, k, v)),
                                                           is_causal=True)
    assert rel_err(ours, ref) < BOUNDS[torch.bfloat16]
