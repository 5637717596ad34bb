"""Tensor descriptors (TMA): where a launch reads its tiles through them, and that their loads give
the pointer loads' results, on the CPU, on the GPU and at lengths of 1."""
import pytest
import torch

from attn_testing import check_against_oracle, check_tile_loads, flash_fn, interpret, make_qkv, table_cell, varlen_batch
from cuflash.kernels.triton import Tiles
from cuflash.params import AttentionParams


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
