"""Kernel choice: the launch table's candidates and what each kernel family accepts, select()'s
fall-backs and its refusal of tiles that do not fit; on the GPU the table's launches of every length
class."""
import dataclasses

import pytest
import torch

import cuflash
from attn_testing import check_against_oracle, flash_fn, make_qkv, seed_of
from cuflash.builtin_mods import resolved
from cuflash.kernels.plan import Plan
from cuflash.kernels.triton import OneLaunch, SplitOperands, Tiles
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams


LENGTH_CLASS_KEYS = (128, 256, 512, 1024, 2048, 4096)  # the longest (or a long) sequence of each class


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_table_launch_is_accepted_by_its_kernel(arch):
    """Every candidate of the table (each head dim class, v's the same or (256, 128), length class, causal
    or not, dtype) is one its kernel takes: Triton tiles last (they take every call), power-of-two tiles of
    16 to 256 rows, 1-8 warps, warp specialization only with tensor descriptors; Gluon candidates only on
    Hopper for 16-bit inputs at D=64/128/256 and (192, 128) (what the Gluon kernels take), with key tiles
    and buffers that fit
    their shared memory (launch_args validates them). Which candidate wins where is measured, not
    restated here (docs/tuning.md); that each compiles and computes the right thing is
    test_every_length_class_on_gpu below."""
    from cuflash.kernels import gluon
    from cuflash.kernels.gluon import forward as gluon_forward
    from cuflash.kernels.plan import Length, entry
    from cuflash.kernels.variant import problem

    causal, plain = AttentionParams(0.1, window_right=0), AttentionParams(0.1)
    for block_d, block_dv in ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (256, 128), (512, 512)):
        for fp32 in (False, True):
            for length, keys in zip(Length, LENGTH_CLASS_KEYS):
                assert Length.of(keys) == length
                for banded in (False, True):
                    cell = entry(arch, block_d, fp32, False, length, banded, block_dv)
                    for candidates in (cell.forward, cell.dkdv, cell.dq):
                        *first, last = candidates
                        # (Triton tiles last; before them only Triton tiles asking for descriptors, which
                        # yield to the last where the call cannot use descriptors: plan._first)
                        assert isinstance(last, Tiles) and all(c.tma for c in first if isinstance(c, Tiles)), cell
                        for tile in (last.block_m, last.block_n):
                            assert 16 <= tile <= 256 and tile & (tile - 1) == 0, cell
                        assert last.num_warps in (1, 2, 4, 8) and last.num_stages >= 1, cell
                        assert not last.warp_specialize or last.tma, cell
                    # The one-launch backward comes first, on valid tiles that hold the class's keys.
                    assert not any(isinstance(c, OneLaunch) for c in cell.forward + cell.dkdv[1:] + cell.dq), cell
                    if isinstance(cell.dkdv[0], OneLaunch):
                        one = cell.dkdv[0].tiles
                        assert one.block_n >= keys and one.block_m in (16, 32, 64, 128) and not one.tma, cell
                    # (the split-operand dQ pass reads the parts its dK/dV pass's launch made: both or neither)
                    assert (any(isinstance(c, SplitOperands) for c in cell.dkdv)
                            == any(isinstance(c, SplitOperands) for c in cell.dq)), cell
                    if not any(isinstance(c, (gluon.Forward, gluon.Dkdv, gluon.Dq))
                               for c in cell.forward + cell.dkdv + cell.dq):
                        continue
                    # (a Gluon kernel is a candidate where it measured faster; it runs only where it
                    # accepts the call, and the Triton tiles after it elsewhere)
                    assert arch == 90 and not fp32, (block_d, length, banded)
                    if block_d not in (64, 128, 256):
                        continue
                    q = torch.randn(1, keys, 2, block_d if block_d == block_dv else 192, dtype=torch.bfloat16)
                    v = torch.randn(1, keys, 2, block_dv, dtype=torch.bfloat16)
                    params = causal if banded else plain
                    if len(cell.forward) > 1:
                        prob = problem(q, q, v, params)
                        assert gluon.accepts(prob, params)
                        gluon_forward.launch_args(dict(Q=q, K=q, V=v, Out=v, Lse=q), prob, params, cell.forward[0])
                    if len(cell.dkdv) + len(cell.dq) > 2:
                        assert gluon.accepts(problem(q, q, v, params, v), params), (block_d, length, banded)


def test_gluon_kernels_accept_only_what_they_implement(monkeypatch):
    """The Gluon kernels accept only the plain 16-bit attention they implement (the rest takes the
    Triton kernels) and refuse configurations that do not fit them (the kernels run on the GPU only:
    the gpu tests of test_hopper_kernels.py)."""
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
    for params in (AttentionParams(0.1, window_left=64, window_right=0), AttentionParams(0.1, dropout_p=0.1),
                   AttentionParams(0.0)):
        assert not gluon.accepts(problem(q, k, k, params), params)
    for params in (AttentionParams(0.1, softcap=30.0), AttentionParams(0.1, alibi_slopes=torch.ones(4))):
        # (the backends take both as score_mods, builtin_mods.resolved; the Gluon kernels compile those)
        params = resolved(params, q.shape[1], k.shape[1])
        assert params.mods is not None and params.softcap == 0 and params.alibi_slopes is None
        assert gluon.accepts(problem(q, k, k, params), params)
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
    plain, window = AttentionParams(0.1), AttentionParams(0.1, window_left=8)
    assert select(problem(q, q, q, plain), plain, cell) == Plan(gluon.Forward(3, 64, 6))
    assert select(problem(q, q, q, plain, q), plain, cell) == Plan(gluon.Forward(3, 64, 6), gluon.Dkdv(True), None)
    exact = AttentionParams(0.1, deterministic=True)
    assert select(problem(q, q, q, exact, q), exact, cell) == Plan(gluon.Forward(3, 64, 6), gluon.Dkdv(False),
                                                                   gluon.Dq())
    assert select(problem(q, q, q, window, q), window, cell) == Plan(tiles, tiles, tiles)
    asked = AttentionParams(0.1, block_m=32, block_n=16)
    assert select(problem(q, q, q, asked, q), asked) == Plan(*(Tiles(32, 16, 4, 2),) * 3)


def test_long_gqa_backward_unfuses_dq(monkeypatch):
    """The Gluon dK/dV kernel leaves dQ to its own pass under GQA beyond FUSED_DQ_MAX_PAIRS query-key
    pairs a call (where the fused kernel's L2 hit rate collapsed on an H100); MHA and shorter GQA calls
    keep dQ fused."""
    from cuflash.kernels import gluon, plan
    from cuflash.kernels.plan import Entry, select
    from cuflash.kernels.variant import problem

    monkeypatch.setattr(plan.gluon, "accepts", lambda prob, params: True)
    tiles = Tiles(64, 64, 4, 3)
    cell = Entry((gluon.Forward(),), (gluon.Dkdv(fuse_dq=True), tiles), (gluon.Dq(), tiles))
    causal = AttentionParams(0.1, window_right=0)

    def plan_of(batch, heads, heads_k, seqlen_q, seqlen_k=None):
        q = torch.empty(batch, seqlen_q, heads, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(batch, seqlen_k or seqlen_q, heads_k, 128, dtype=torch.bfloat16, device="meta")
        return select(problem(q, k, k, causal, q), causal, cell)

    fused = Plan(gluon.Forward(), gluon.Dkdv(fuse_dq=True), None)
    unfused = Plan(gluon.Forward(), gluon.Dkdv(fuse_dq=False), gluon.Dq())
    for shape in ((1, 32, 8, 2 ** 17), (1, 8, 2, 2 ** 18), (1, 16, 16, 2 ** 18), (1, 64, 64, 2 ** 18),
                  (16, 32, 8, 2 ** 14)):
        assert plan_of(*shape) == fused, shape
    for shape in ((1, 16, 4, 2 ** 18), (1, 32, 8, 2 ** 18), (2, 32, 8, 2 ** 17), (1, 32, 8, 2 ** 17, 2 ** 17 + 64)):
        assert plan_of(*shape) == unfused, shape


def test_descriptor_tiles_yield_to_pointer_tiles_where_descriptors_do_not_take_the_call(monkeypatch):
    """Head dim 512 on Hopper: dK/dV's 64 x 32 descriptor tiles would need 256 KB of shared memory through
    pointers; a call that cannot use descriptors (a length of 1) takes the entry's next Triton tiles, with
    and without mods; one that can keeps them."""
    from cuflash.kernels import plan
    from cuflash.kernels.plan import select
    from cuflash.kernels.variant import problem
    from cuflash.mods import Mod, Mods

    monkeypatch.setattr(plan, "arch", lambda device: 90)
    monkeypatch.setattr(plan, "tma_addressable", lambda *tensors: True, raising=False)
    monkeypatch.setattr(Tiles, "on", lambda self, seqlens, *streamed: self if self.tma and min(seqlens) > 1
                        else dataclasses.replace(self, tma=False, warp_specialize=False))
    plain = AttentionParams(0.1, window_right=0)
    modded = AttentionParams(0.1, mods=Mods(score=Mod.of(lambda s, b, h, q, kv: s * 0.5, "score")))
    for gluon_takes in (False, True):  # (whether Gluon would take the call decides nothing among Triton tiles)
        monkeypatch.setattr(plan.gluon, "accepts", lambda prob, params: gluon_takes)
        for params in (plain, modded):
            for seqlen, dkdv in ((1, Tiles(32, 32, 8, 2)), (300, Tiles(64, 32, 8, 1, tma=True))):
                q = torch.randn(1, seqlen, 2, 512, dtype=torch.bfloat16)
                assert select(problem(q, q, q, params, q), params).dkdv == dkdv, (params, seqlen, gluon_takes)


def test_calls_with_mods_take_the_gluon_kernels_where_the_blocks_fit():
    """With mods the forward keeps its Gluon candidate (two consumers; with a block mask, key tiles within
    a key block, where a work item's 128 query rows lie in one query block and no band is asked for), so
    does dK/dV up to head dim 128 (dQ fused but in a deterministic backward; with a block mask, 128-key
    items within a key block, 64-row query tiles within query blocks); the rest takes Triton tiles within
    the blocks (two stages at head dim 256 where a mod reads a tensor per score or a captured tensor's
    gradient is asked for), or without a block mask
    the one-launch backward where listed."""
    from cuflash.kernels import gluon
    from cuflash.kernels.plan import Entry, select
    from cuflash.kernels.variant import problem
    from cuflash.mods import BlockSparsity, Mod, Mods

    q = torch.randn(1, 512, 2, 64, dtype=torch.bfloat16)
    tiles = Tiles(128, 64, 8, 3)
    cell = Entry((gluon.Forward(3, 128, 3), tiles), (gluon.Dkdv(fuse_dq=False), tiles), (gluon.Dq(), tiles))
    score = Mod.of(lambda score, b, h, q_idx, kv_idx: score * 2, "score")

    def blocks(q_block, kv_block):
        lists = (torch.zeros(1, 2, 4, dtype=torch.int32), torch.zeros(1, 2, 4, 4, dtype=torch.int32))
        return BlockSparsity(q_block, kv_block, *lists, *lists, *lists, *lists)

    def plan(mods, x=q, **options):
        params = AttentionParams(0.1, mods=mods, **options)
        return select(problem(x, x, x, params, x), params, cell)
    fused = gluon.Dkdv(fuse_dq=True)
    assert plan(Mods(score=score)) == Plan(gluon.Forward(2, 128, 3), fused, None)
    assert plan(Mods(score=score), window_right=0) == Plan(gluon.Forward(2, 128, 3), fused, None)
    assert plan(Mods(score=score), deterministic=True) == Plan(gluon.Forward(2, 128, 3), gluon.Dkdv(), tiles)
    assert plan(Mods(score=score, blocks=blocks(128, 128))) == Plan(gluon.Forward(2, 128, 3), fused, None)
    assert plan(Mods(score=score, blocks=blocks(256, 64))) == Plan(gluon.Forward(2, 64, 3), Tiles(128, 64, 8, 3),
                                                                   Tiles(128, 64, 8, 3))
    assert plan(Mods(score=score, blocks=blocks(64, 256))) == Plan(Tiles(64, 64, 8, 3), fused, None)
    assert plan(Mods(score=score, blocks=blocks(384, 96))) == Plan(gluon.Forward(2, 32, 3), Tiles(128, 32, 8, 3),
                                                                   Tiles(128, 32, 8, 3))
    small = Tiles(64, 64, 8, 3)
    assert plan(Mods(score=score, blocks=blocks(64, 128))) == Plan(small, fused, None)  # half a forward item
    assert plan(Mods(score=score, blocks=blocks(128, 16))).forward == Tiles(128, 16, 8, 3)  # tiles under 32 keys
    assert plan(Mods(score=score, blocks=blocks(128, 128)), window_right=0) == Plan(tiles, tiles, tiles)  # a band
    wide = torch.randn(1, 512, 2, 256, dtype=torch.bfloat16)
    assert plan(Mods(score=score), wide) == Plan(gluon.Forward(2, 128, 3), tiles, tiles)
    table = torch.randn(2, 512)  # read per score (ModGraph.gathers): two stages at head dim 256
    bias = Mod.of(lambda score, b, h, q_idx, kv_idx: score + table[h, (q_idx - kv_idx).abs()], "score")
    assert plan(Mods(score=bias), wide) == Plan(gluon.Forward(2, 128, 3), Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2))
    scale = torch.ones(2, requires_grad=True)  # a gradient added per tile: two stages too
    learned = Mod.of(lambda score, b, h, q_idx, kv_idx: score * scale[h], "score")
    assert plan(Mods(score=learned), wide) == Plan(gluon.Forward(2, 128, 3), Tiles(128, 64, 8, 2),
                                                   Tiles(128, 64, 8, 2))
    # the one-launch backward stays first where the table lists it, but not with a block mask (it walks no lists)
    whole = OneLaunch(Tiles(64, 128, 8, 2))
    cell = Entry(cell.forward, (whole, *cell.dkdv), cell.dq)
    short = torch.randn(1, 100, 2, 64, dtype=torch.bfloat16)  # (one key tile holds every key)
    assert plan(Mods(score=score), short).dkdv == whole.tiles.on((100, 100), short, short)
    assert plan(Mods(score=score, blocks=blocks(128, 128)), short).dkdv == fused


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
