"""The Hopper (sm_90) kernels: they compile for sm_90 without a GPU; on the GPU the Gluon forward
and backward, forced where the table takes others, and the Triton kernels they fall back to, against
the oracle."""
import pytest
import torch

import cuflash
from attn_testing import BOUNDS, check_against_oracle, flash_fn, force_candidates, make_qkv, rel_err, table_cell
from cuflash.kernels import gluon
from cuflash.kernels.triton import OneLaunch
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams


def test_kernels_compile_for_hopper_without_a_gpu():
    """The kernels an H100 runs for a causal 300-token call compile for sm_90 with the installed
    Triton and its ptxas, outside the interpreter (scripts/compile_check.py's stand-in driver, in a
    process of its own): bf16 takes the Gluon forward and backward (at D=64; at D=256, for 1000
    tokens, the forward with early_k and the split-D dK/dV; at (192, 128) the forward with Q and K in two
    parts), fp32 the Triton ones; the Gluon forward with a learnable sink (D=64, 1000 tokens); and a bf16
    decode step into a paged cache (append, decode, combine; with a sink split and not). The CPU tests run
    the Triton kernels through the interpreter and the Gluon ones not at all; this is where a kernel that
    would not compile on the GPU shows first."""
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
              "errors.append(m['compile_case'](torch.bfloat16, 64, 1000, 1000, 4, 2, 'sink_causal'))\n"
              "errors.append(m['compile_case'](torch.bfloat16, 192, 1000, 1000, 4, 2, 'plain', 128))\n"
              "errors.append(m['compile_decode'](torch.bfloat16, 128, True, True, True))\n"
              "assert errors == [None] * 6, errors\n")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1025, 1025), (600, 3000), (3000, 600), (1, 2049), (4100, 1)])
@pytest.mark.parametrize("head_dim,causal,consumers,block_n,stages,turns", [
    (128, False, 2, 128, 3, True), (128, True, 2, 128, 3, True), (128, True, 2, 128, 3, False),
    (64, False, 2, 128, 3, True), (64, True, 2, 128, 3, True), (64, False, 3, 128, 3, True),
    (64, True, 3, 128, 3, True), (64, True, 3, 128, 3, False), (128, False, 2, 64, 5, True),
    (128, True, 2, 64, 5, True), (64, True, 2, 64, 5, True), (64, False, 3, 64, 5, True), (64, True, 3, 64, 5, True),
    (128, True, 2, 64, 6, True), (256, False, 2, 64, 2, False), (256, True, 2, 64, 2, False),
    (256, False, 2, 32, 3, False), (256, True, 2, 32, 3, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hopper_forward(dtype, head_dim, causal, consumers, block_n, stages, turns, seqlen_q, seqlen_k, layout,
                        monkeypatch):
    """The Gluon forward (kernels/gluon/forward.py) with 2 or 3 consumer warpgroups, 128-, 64- or 32-key tiles
    and rings of K/V buffers (forced here where the table takes others or the Triton kernel; at D=128 with
    64-key tiles in 5 buffers and D=256 with 32-key ones in 3 the most shared memory that leaves room for two Q
    buffers; at D=128 with 6 and at D=256 with 64-key tiles one Q buffer that O leaves through, causal at D=128
    without the deferred hand-back), the consumers taking turns or not, matches float64 like the Triton kernels:
    ragged tiles, GQA, rows with no visible key (causal, seqlen_q > seqlen_k, where a consumer sees fewer tiles
    than the others and takes turns that issue nothing), non-contiguous inputs; the gradients check its lse."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (sm_90)")
    from cuflash.kernels.gluon import forward as gluon_forward
    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype, "cuda", layout=layout)
    params = AttentionParams(head_dim ** -0.5, window_right=0 if causal else -1)
    assert gluon.accepts(problem(q, k, v, params), params)
    cfg = gluon.Forward(consumers, block_n, stages, turns=turns)
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
        assert any("DQAcc" in plan.workspaces for plan in launch.PLANS.values())


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
    assert any("DQAcc" in plan.workspaces for plan in launch.PLANS.values()) == fused


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
