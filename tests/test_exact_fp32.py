"""The exact fp32 forward and backward on split operands (kernels/triton/exact.py): which calls they
take, and their values and gradients against the float64 oracle (through Triton's interpreter on the
CPU, on the GPU where the table picks them: Hopper)."""
import functools

import pytest
import torch

import cuflash
from attn_testing import check_against_oracle, flash_fn, force_candidates, interpret, make_qkv, rel_err, seed_of
from cuflash.builtin_mods import resolved
from cuflash.kernels.plan import Entry, Length, entry, select
from cuflash.kernels.triton import SplitOperands, Tiles
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, causal)
SHAPES = [(1, 1, 1, 2, 2, 64, 64, False), (2, 17, 17, 4, 2, 40, 40, True), (1, 17, 300, 2, 1, 96, 96, True),
          (1, 300, 17, 2, 2, 64, 64, True), (1, 65, 130, 2, 2, 128, 64, True), (1, 33, 48, 2, 2, 256, 256, False),
          (1, 1, 33, 4, 1, 64, 64, False)]


def _shape_id(shape) -> str:
    b, nq, nk, h, hk, d, dv, causal = shape
    return f"{b}x{nq}x{nk}-h{h}/{hk}-d{d}/{dv}" + ("-causal" if causal else "")


def _force_split(monkeypatch):
    """The interpreter's table lists Triton tiles only (plan.py): the CPU tests here force split operands,
    with the interpreter's tile sizes."""
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    dkdv, dq = Tiles(16, 32, 1, 1), Tiles(32, 16, 1, 1)
    force_candidates(monkeypatch, forward=(SplitOperands(dq), dq), dkdv=(SplitOperands(dkdv), dkdv),
                     dq=(SplitOperands(dq), dq))


def _check(shape, device, layout="bnhd"):
    b, nq, nk, h, hk, d, dv, causal = shape
    torch.manual_seed(seed_of(shape, layout))
    q, k, _ = make_qkv(b, nq, nk, h, hk, d, torch.float32, device, layout)
    v = torch.randn(b, nk, hk, dv, device=device)
    check_against_oracle(flash_fn(causal), q, k, v, causal, with_sdpa=False)


@interpret
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_split_operands_against_oracle(shape, monkeypatch):
    """Odd lengths and head dims, causal with seqlen_q != seqlen_k (rows that see no key), GQA, a v of
    its own head dim, a query of one row: output and gradients within 2x the error of the same attention
    in fp32 torch ops."""
    _force_split(monkeypatch)
    _check(shape, "cpu")


@interpret
def test_strided_inputs_window_and_sink(monkeypatch):
    """Non-contiguous q, k, v (SDPA's layout), a sliding window and a learnable sink, on split operands;
    softmax_lse against the oracle's too."""
    _force_split(monkeypatch)
    _check((2, 40, 70, 4, 2, 64, 64, True), "cpu", layout="bhnd")
    torch.manual_seed(1)
    q, k, v = make_qkv(1, 50, 90, 2, 1, 64, torch.float32, "cpu", layout="bhnd")
    sink = torch.randn(2)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, window_size=(20, 0), learnable_sink=sink,
                                          return_attn_probs=True)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, window_size=(20, 0),
                                       learnable_sink=sink.double())
    assert rel_err(out, ref) < 2e-6
    assert rel_err(lse, ref_lse) < 1e-6


@interpret
def test_sink_and_lse_gradient(monkeypatch):
    """A learnable sink and a loss with a gradient of softmax_lse (the backward's delta less dlse, dsink
    reduced from it), GQA, causal with more keys than queries, on split operands: out, lse and every
    gradient against the float64 oracle."""
    from test_sinks import _flash, check_sink
    _force_split(monkeypatch)
    torch.manual_seed(2)
    q, k, v = make_qkv(1, 40, 70, 4, 2, 64, torch.float32, "cpu")
    check_sink(functools.partial(_flash, causal=True), q, k, v, torch.randn(4) * 2, causal=True)


def _plan(q, params, arch=90, tf32=False, backward=False):
    prob = problem(q, q, q, params, q if backward else None)
    cell = entry(arch, prob.block_d, q.dtype == torch.float32, tf32, Length.of(q.shape[1]), params.banded)
    plan = select(prob, params, cell)
    return (plan.dkdv, plan.dq) if backward else plan.forward


def test_which_calls_take_split_operands():
    """fp32 calls without attn_mask, dropout, mods, varlen or pages take the split-operand forward and
    (up to head dim 128) backward on Hopper; the rest, 16-bit calls and TF32 ones (allow_tf32) take
    Triton tiles (or Gluon), as head dims over 256 and the backward at 256 do."""
    q = torch.zeros(1, 300, 2, 64)
    plain = AttentionParams(0.125)
    assert isinstance(_plan(q, plain), SplitOperands)
    assert isinstance(_plan(q, AttentionParams(0.125, window_left=8, window_right=0)), SplitOperands)
    assert isinstance(_plan(torch.zeros(1, 300, 2, 512), plain), Tiles)
    assert _plan(q, plain, tf32=True) == Tiles(128, 64, 8, 2, "tf32")
    assert isinstance(_plan(q, plain, arch=80), Tiles)
    assert all(isinstance(c, SplitOperands) for c in _plan(q, plain, backward=True))
    assert all(isinstance(c, Tiles) for c in _plan(torch.zeros(1, 300, 2, 256), plain, backward=True))
    assert isinstance(_plan(q, plain, arch=0), Tiles)  # (the interpreter's: the tests above force them)
    tiles = Tiles(64, 64, 4, 2)
    lone = Entry((tiles,), (SplitOperands(tiles), tiles), (tiles,))  # (no split dQ to read its parts)
    with pytest.raises(ValueError, match="SplitOperands dQ"):
        select(problem(q, q, q, plain, q), plain, lone)
    assert all(isinstance(c, Tiles) for c in _plan(q, plain, tf32=True, backward=True))
    assert not isinstance(_plan(q.half(), plain), SplitOperands)
    for options in (dict(dropout_p=0.1, rng_seed=torch.zeros(2, dtype=torch.int64)),
                    dict(attn_mask=torch.ones(1, 2, 300, 300, dtype=torch.bool)), dict(softcap=5.0)):
        params = AttentionParams(0.125, **options)
        assert isinstance(_plan(q, resolved(params, 300, 300)), Tiles), options


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(2, 1000, 1000, 4, 2, 128, 128, True)], ids=_shape_id)
def test_split_operands_on_gpu(shape):
    """The same on the GPU (Hopper takes the split operands; other GPUs Triton tiles)."""
    _check(shape, "cuda")
