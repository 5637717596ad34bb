"""cuflash.apply_rotary_emb (flash-attn's signature and semantics) against a float64 oracle written
with complex numbers: both layouts, partial rotary dims, int and per-sequence offsets, varlen,
in place, positions outside the table (refused, or left unrotated), gradients, every dtype; the
torch path and the Triton kernel (through the interpreter on the CPU), and both on the GPU."""
import pytest
import torch

import cuflash
from attn_testing import rel_err, rotary_reference
from cuflash.rotary import RotaryEmbedding, kernel_rotates, rotate

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _table(seqlen_ro, rotary_dim, device):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device=device) * 6.28
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_dense_against_oracle(backend, device, dtype, interleaved, offsets):
    torch.manual_seed(7 * interleaved + len(offsets))
    batch, seqlen, nheads, head_dim, rotary_dim = 3, 17, 2, 40, 24
    x = torch.randn(batch, seqlen, nheads, head_dim, device=device).to(dtype)
    assert kernel_rotates(x) == (backend == "triton")  # the path under test is the one that runs
    cos, sin = _table(64, rotary_dim, device)
    seqlen_offsets = {"zero": 0, "int": 5, "tensor": torch.tensor([0, 9, 40], device=device)}[offsets]
    out = cuflash.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets)
    starts = torch.as_tensor(seqlen_offsets, device=device).expand(batch)
    positions = starts[:, None] + torch.arange(seqlen, device=device)
    ref = rotary_reference(x, cos, sin, positions, interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # the other dims pass through


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen_positions_count_per_sequence(backend, device, interleaved):
    torch.manual_seed(3)
    lengths, nheads, head_dim = [5, 1, 12], 3, 16
    cu_seqlens = torch.tensor([0, 5, 6, 18], dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), nheads, head_dim, device=device)
    cos, sin = _table(20, head_dim, device)
    offsets = torch.tensor([2, 0, 7], device=device)
    out = cuflash.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                                   max_seqlen=12)
    positions = torch.cat([torch.arange(n, device=device) + int(o) for n, o in zip(lengths, offsets)])
    assert rel_err(out, rotary_reference(x, cos, sin, positions, interleaved)) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_is_the_inverse_rotation(backend, device):
    torch.manual_seed(4)
    x = torch.randn(2, 9, 2, 32, device=device, requires_grad=True)
    cos, sin = _table(9, 32, device)
    dout = torch.randn_like(x)
    cuflash.apply_rotary_emb(x, cos, sin).backward(dout)
    positions = torch.arange(9, device=device).expand(2, 9)
    expected = rotary_reference(dout, cos, -sin, positions, False)  # rotation by the opposite angle
    assert rel_err(x.grad, expected) < 1e-6


def test_inplace(backend):
    torch.manual_seed(5)
    x = torch.randn(2, 6, 1, 8)
    cos, sin = _table(8, 8, "cpu")
    offsets = torch.tensor([2, 0])
    expected = rotary_reference(x, cos, sin, offsets[:, None] + torch.arange(6), False)
    y = x.clone()
    result = cuflash.apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=offsets)
    assert result.data_ptr() == y.data_ptr()
    assert rel_err(y, expected) < 1e-6


def test_rotate_leaves_positions_outside_the_table_as_they_are(backend):
    """rotate(), which apply_rotary_emb and flash_attn_with_kvcache share, leaves a token whose
    position falls outside the table unrotated (cos 1, sin 0, as flash-attn's kernel) and reads
    nothing outside it: what a GPU tensor of offsets gets (the rule's one exception)."""
    torch.manual_seed(6)
    x = torch.randn(2, 6, 1, 8)
    cos, sin = _table(8, 8, "cpu")
    positions = torch.stack((torch.arange(4, 10), torch.arange(-2, 4)))
    expected = rotary_reference(x, cos, sin, positions.clamp(0, 7), False)
    outside = (positions < 0) | (positions >= 8)
    expected[outside] = x[outside].double()  # positions 8, 9 and -2, -1
    assert rel_err(rotate(x, cos, sin, positions, False), expected) < 1e-6


@pytest.mark.parametrize("call,position", [
    (dict(seqlen_offsets=7), "up to 12"),
    (dict(seqlen_offsets=torch.tensor([0, 7])), "seqlen_offsets[1] = 7"),
    (dict(seqlen_offsets=torch.tensor([-1, 0])), "seqlen_offsets[0] = -1"),
    (dict(x=torch.randn(18, 2, 16), cu_seqlens=torch.tensor([0, 5, 6, 18], dtype=torch.int32), max_seqlen=12,
          seqlen_offsets=torch.tensor([2, 7, 3])), "seqlen_offsets[2] = 3"),
    (dict(x=torch.randn(18, 2, 16), cu_seqlens=torch.tensor([0, 5, 6, 18], dtype=torch.int32), max_seqlen=12,
          seqlen_offsets=1), "up to 12"),
], ids=["int", "tensor", "negative", "varlen_tensor", "varlen_int"])
def test_positions_outside_the_table_raise(call, position):
    """A token whose position falls outside cos and sin raises naming them wherever the position is
    known on the host: an int offset (o + seqlen <= seqlen_ro, seqlen being max_seqlen with cu_seqlens,
    as flash-attn asserts) and a CPU tensor of offsets, per sequence (its own length); the
    positions through the table's last row pass."""
    cos, sin = _table(12, 16, "cpu")
    args = dict(x=torch.randn(2, 6, 2, 16), cos=cos, sin=sin) | call
    with pytest.raises(cuflash.FlashAttentionError, match="cos, sin") as info:
        cuflash.apply_rotary_emb(**args)
    assert info.value.code == cuflash.ErrorCode.INVALID_ARGUMENT and position in str(info.value)
    cuflash.apply_rotary_emb(torch.randn(2, 6, 2, 16), cos, sin, seqlen_offsets=6)
    cuflash.apply_rotary_emb(torch.randn(2, 6, 2, 16), cos, sin, seqlen_offsets=torch.tensor([6, 0]))
    cu_seqlens = torch.tensor([0, 5, 6, 18], dtype=torch.int32)
    cuflash.apply_rotary_emb(torch.randn(18, 2, 16), cos, sin, cu_seqlens=cu_seqlens, max_seqlen=12,
                             seqlen_offsets=torch.tensor([7, 11, 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensor_offsets_past_the_table_pass_unrotated():
    """The documented exception: a tensor of offsets on the GPU is not read back; a token it puts
    past the table is left as it is, as flash-attn leaves it."""
    torch.manual_seed(11)
    x = torch.randn(1, 6, 1, 8, device="cuda")
    cos, sin = _table(8, 8, "cuda")
    out = cuflash.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([4], device="cuda"))
    expected = rotary_reference(x, cos, sin, torch.arange(4, 10, device="cuda")[None].clamp(max=7), False)
    expected[:, 4:] = x[:, 4:].double()
    assert rel_err(out, expected) < 1e-6


@pytest.mark.parametrize("kwargs,word", [
    (dict(x=torch.randn(2, 4, 1, 8), cos=torch.ones(3, 4), sin=torch.zeros(3, 4)), "seqlen_ro"),
    (dict(x=torch.randn(2, 4, 1, 8), cos=torch.ones(8, 5), sin=torch.zeros(8, 5)), "rotary_dim"),
    (dict(x=torch.randn(2, 4, 1, 8), cos=torch.ones(8, 4), sin=torch.zeros(8, 2)), "sin"),
    (dict(x=torch.randn(2, 4, 1, 8), cos=torch.ones(8, 4), sin=torch.zeros(8, 4), seqlen_offsets=-1),
     "seqlen_offsets"),
    (dict(x=torch.randn(2, 4, 1, 8), cos=torch.ones(8, 4), sin=torch.zeros(8, 4),
          seqlen_offsets=torch.tensor([1, 2, 3])), "seqlen_offsets"),
    (dict(x=torch.randn(8, 1, 8), cos=torch.ones(8, 4), sin=torch.zeros(8, 4),
          cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), "max_seqlen"),
    (dict(x=torch.randn(2, 4, 8), cos=torch.ones(8, 4), sin=torch.zeros(8, 4)), "x"),
])
def test_bad_input_names_the_argument(kwargs, word):
    with pytest.raises(cuflash.FlashAttentionError, match=word):
        cuflash.apply_rotary_emb(**kwargs)


@pytest.mark.parametrize("packing", ["qkv", "qkv_gqa", "kv"])
def test_packed_qkv_and_kv_in_place(backend, packing):
    """apply_rotary_emb_qkv_ / apply_rotary_emb_kv_ rotate the queries and keys of a packed tensor in
    place (the keys by their own tables when given), leave the values alone and return the same
    tensor; values and gradients against the float64 oracle applied to each part."""
    torch.manual_seed(9)
    batch, seqlen, d = 2, 7, 16
    cos, sin = _table(12, 8, "cpu")
    cos_k, sin_k = _table(12, 8, "cpu")
    offsets = torch.tensor([0, 3])
    positions = offsets[:, None] + torch.arange(seqlen)
    # The packed shape, then each part: its index along dim 2 and its rotary table (None: untouched).
    shape, parts = {
        "qkv": ((batch, seqlen, 3, 2, d), [(0, (cos, sin)), (1, (cos_k, sin_k)), (2, None)]),
        "qkv_gqa": ((batch, seqlen, 6, d), [(slice(0, 4), (cos, sin)), (slice(4, 5), (cos, sin)), (slice(5, 6), None)]),
        "kv": ((batch, seqlen, 2, 3, d), [(0, (cos, sin)), (1, None)]),
    }[packing]
    leaf = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
    packed = leaf * 1.0  # an intermediate, as a projection's output would be
    if packing == "qkv":
        out = cuflash.apply_rotary_emb_qkv_(packed, cos, sin, cos_k, sin_k, seqlen_offsets=offsets)
    elif packing == "qkv_gqa":
        out = cuflash.apply_rotary_emb_qkv_(packed, cos, sin, seqlen_offsets=offsets, num_heads_q=4)
    else:
        out = cuflash.apply_rotary_emb_kv_(packed, cos, sin, seqlen_offsets=offsets)
    assert out is packed
    weights = torch.randn(shape)
    (out * weights).sum().backward()
    reference_leaf = leaf.detach().double().requires_grad_()
    loss = 0.0
    for index, table in parts:
        x = reference_leaf[:, :, index]
        expected = x if table is None else rotary_reference(x, *table, positions, False)
        assert rel_err(out[:, :, index], expected) < 1e-6, index
        loss = loss + (expected * weights[:, :, index].double()).sum()
    loss.backward()
    assert rel_err(leaf.grad, reference_leaf.grad) < 1e-6


def test_packed_rotary_errors():
    cos, sin = _table(8, 8, "cpu")
    with pytest.raises(cuflash.FlashAttentionError, match="num_heads_q"):
        cuflash.apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 16), cos, sin)
    with pytest.raises(cuflash.FlashAttentionError, match="twice"):
        cuflash.apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 16), cos, sin, num_heads_q=3)
    with pytest.raises(cuflash.FlashAttentionError, match="kv must be"):
        cuflash.apply_rotary_emb_kv_(torch.randn(1, 4, 3, 2, 16), cos, sin)


def _scaled_rotation(x, cos, sin, positions):
    """x (..., H, D) times cos + i sin (not normalized: xPos scales it) on its first halves, float64."""
    half = cos.shape[1]
    x = x.double()
    z = torch.complex(x[..., :half], x[..., half:2 * half]) * torch.complex(cos, sin)[positions][..., None, :]
    return torch.cat((z.real, z.imag, x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(backend, scale_base):
    """RotaryEmbedding (flash-attn's module): tables from base ** (-2i / dim), with xPos scaling the
    queries' and dividing the keys'; a packed qkv, and q with a packed kv, rotated in place at an
    offset; the tables grow with the positions asked for."""
    torch.manual_seed(10)
    dim, batch, seqlen, d = 8, 2, 5, 16
    module = RotaryEmbedding(dim, base=100.0, scale_base=scale_base)
    positions = 3 + torch.arange(seqlen).expand(batch, seqlen)

    def tables(n):
        angles = torch.arange(n, dtype=torch.float64)[:, None] * 100.0 ** (-torch.arange(0, dim, 2) / dim)
        scale = torch.ones(n, dim // 2, dtype=torch.float64)
        if scale_base is not None:
            scale = ((torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)) ** ((torch.arange(n)[:, None] - n // 2)
                                                                              / scale_base)
        return (angles.cos() * scale, angles.sin() * scale), (angles.cos() / scale, angles.sin() / scale)

    qkv = torch.randn(batch, seqlen, 3, 2, d)
    expected_q, expected_k = (_scaled_rotation(qkv[:, :, i], *t, positions) for i, t in enumerate(tables(8)))
    out = module(qkv.clone(), seqlen_offset=3)
    assert rel_err(out[:, :, 0], expected_q) < 1e-5 and rel_err(out[:, :, 1], expected_k) < 1e-5
    assert torch.equal(out[:, :, 2], qkv[:, :, 2])
    q, kv = torch.randn(batch, seqlen, 4, d), torch.randn(batch, seqlen, 2, 2, d)
    q_out, kv_out = module(q.clone(), kv.clone(), seqlen_offset=torch.tensor([3, 3]), max_seqlen=12)
    (q_tables, k_tables) = tables(12)  # rebuilt for 12 positions: xPos's centre moves with them
    assert rel_err(q_out, _scaled_rotation(q, *q_tables, positions)) < 1e-5
    assert rel_err(kv_out[:, :, 0], _scaled_rotation(kv[:, :, 0], *k_tables, positions)) < 1e-5
    assert torch.equal(kv_out[:, :, 1], kv[:, :, 1])
    with pytest.raises(cuflash.FlashAttentionError, match="max_seqlen"):
        RotaryEmbedding(dim)(q, kv, seqlen_offset=torch.tensor([3, 3]))
