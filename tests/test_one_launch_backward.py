"""The one-launch backward (the Triton dK/dV kernel computing the whole backward): where the table
takes it, and that it writes every row, on the CPU and on the GPU."""
import pytest
import torch

import cuflash
from attn_testing import BOUNDS, check_against_oracle, flash_fn, interpret, make_qkv, poison_allocations, rel_err, \
    run_and_grad, seed_of, varlen_batch
from cuflash.kernels import gluon
from cuflash.kernels.plan import Plan
from cuflash.kernels.triton import OneLaunch, Tiles
from cuflash.kernels.variant import problem
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference


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
    from cuflash.kernels import attention, launch
    poison_allocations(monkeypatch)
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
    backward = [p for key, p in launch.PLANS.items() if key[0][0] is attention.attention_backward]
    assert backward and all(len(p.launches) == 1 and not p.workspaces for p in backward)
