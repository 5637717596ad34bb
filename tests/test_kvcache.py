"""flash_attn_with_kvcache on the CPU (blocked path and the Triton kernels through the
interpreter): in-place append, rotary, paged caches, cache_batch_idx, cache_leftpad, against the
float64 oracle computed on the updated cache; bad input leaves the cache untouched."""
import pytest
import torch

import cuflash
from attn_testing import rel_err
from cuflash.reference import attention_reference


def _rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding written with complex numbers (independent of the implementation's form)."""
    half = cos.shape[1]
    x = x.double()
    rot = x[..., :2 * half]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(rot[..., :half], rot[..., half:])
    angle = torch.polar(torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double()))[positions][:, :, None]
    z = z * angle
    out = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, x[..., 2 * half:]), dim=-1)


def _expected(q, k_seqs, v_seqs, causal, **options):
    """The oracle, sequence by sequence: (B, Sq, H, D) float64."""
    return torch.cat([attention_reference(q[b:b + 1], k_seqs[b][None], v_seqs[b][None], causal=causal,
                                          **options)[0] for b in range(q.shape[0])])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_append_rotary_and_attend(backend, paged, seqlen_q, rotary):
    torch.manual_seed(seqlen_q + 2 * paged)
    batch, nheads, nheads_k, d, page = 3, 4, 2, 32, 16
    cache_seqlens = torch.tensor([5, 0, 37], dtype=torch.int32)
    capacity = 64
    if paged:
        num_blocks = 16
        k_cache = torch.randn(num_blocks, page, nheads_k, d)
        block_table = torch.randperm(num_blocks)[:batch * 4].view(batch, 4).int()
    else:
        k_cache = torch.randn(batch, capacity, nheads_k, d)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads, d)
    k, v = (torch.randn(batch, seqlen_q, nheads_k, d) for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(80, 8) * 6.28
        cos, sin = angles.cos(), angles.sin()

    def logical(cache, b):  # sequence b's positions 0..capacity-1 as a (capacity, Hk, D) tensor
        return cache[block_table[b].long()].flatten(0, 1) if paged else cache[b]

    before_k = [logical(k_cache, b).clone() for b in range(batch)]
    before_v = [logical(v_cache, b).clone() for b in range(batch)]
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=cache_seqlens, block_table=block_table, causal=True,
                                               rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    k_seqs, v_seqs = [], []
    q_ref = q.double()
    for b in range(batch):
        n = int(cache_seqlens[b])
        new_pos = torch.arange(n, n + seqlen_q)[None]
        k_new = _rotary(k[b:b + 1], cos, sin, new_pos, rotary == "interleaved")[0] if rotary else k[b].double()
        # the cache now holds the (rotated) new keys right after the old ones, and nothing else changed
        assert torch.allclose(logical(k_cache, b)[n:n + seqlen_q].double(), k_new, atol=1e-6)
        assert torch.equal(logical(v_cache, b)[n:n + seqlen_q], v[b])
        assert torch.equal(logical(k_cache, b)[:n], before_k[b][:n])
        assert torch.equal(logical(k_cache, b)[n + seqlen_q:], before_k[b][n + seqlen_q:])
        assert torch.equal(logical(v_cache, b)[:n], before_v[b][:n])
        k_seqs.append(logical(k_cache, b)[:n + seqlen_q].double())
        v_seqs.append(logical(v_cache, b)[:n + seqlen_q].double())
        if rotary:
            q_ref[b:b + 1] = _rotary(q[b:b + 1], cos, sin, new_pos, rotary == "interleaved")
    ref = _expected(q_ref, k_seqs, v_seqs, True)
    assert out.shape == q.shape and lse.shape == (batch, nheads, seqlen_q)
    assert rel_err(out, ref) < 1e-5


def test_batch_idx_leftpad_window_and_no_new_tokens(backend):
    torch.manual_seed(3)
    batch_cache, batch, nheads, d = 4, 2, 2, 16
    k_cache, v_cache = (torch.randn(batch_cache, 40, nheads, d) for _ in range(2))
    q = torch.randn(batch, 2, nheads, d)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    seqlens = torch.tensor([30, 9], dtype=torch.int32)
    leftpad = torch.tensor([4, 0], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.1])
    saved = k_cache.clone()
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=idx,
                                         cache_leftpad=leftpad, causal=True, window_size=(10, 0), softcap=5.0,
                                         alibi_slopes=slopes)
    assert torch.equal(k_cache, saved)  # no new tokens: nothing written
    k_seqs = [k_cache[3, 4:30].double(), k_cache[1, :9].double()]
    v_seqs = [v_cache[3, 4:30].double(), v_cache[1, :9].double()]
    ref = _expected(q.double(), k_seqs, v_seqs, True, window_size=(10, 0), softcap=5.0, alibi_slopes=slopes)
    assert rel_err(out, ref) < 1e-5


def test_decode_matches_full_attention(backend):
    """Token by token decoding through the cache gives causal attention over the whole sequence."""
    torch.manual_seed(4)
    n, nheads, d = 12, 2, 16
    q, k, v = (torch.randn(1, n, nheads, d) for _ in range(3))
    k_cache, v_cache = (torch.zeros(1, 16, nheads, d) for _ in range(2))
    outs = [cuflash.flash_attn_with_kvcache(q[:, i:i + 1], k_cache, v_cache, k[:, i:i + 1], v[:, i:i + 1],
                                            cache_seqlens=i, causal=True) for i in range(n)]
    full = cuflash.flash_attn_func(q, k, v, causal=True)
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)


def _call(**overrides):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(2, 32, 2, 16), v_cache=torch.randn(2, 32, 2, 16),
                k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
                cache_seqlens=torch.tensor([3, 31], dtype=torch.int32))
    args.update(overrides)
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    saved = (k_cache.clone(), v_cache.clone())
    with pytest.raises(cuflash.FlashAttentionError) as info:
        cuflash.flash_attn_with_kvcache(**args)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1]), "the cache must stay untouched"
    return info.value


@pytest.mark.parametrize("overrides,code,word", [
    (dict(cache_seqlens=torch.tensor([3, 32], dtype=torch.int32)), "INVALID_ARGUMENT", "must fit"),
    (dict(cache_seqlens=torch.tensor([3, 31])), "UNSUPPORTED_DTYPE", "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), "SHAPE_MISMATCH", "cache_seqlens"),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),  # sequence 0 reaches page 9
          block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32),
          cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), "INVALID_ARGUMENT", "block_table"),
    (dict(k_cache=torch.randn(8, 12, 2, 16), v_cache=torch.randn(8, 12, 2, 16),
          block_table=torch.tensor([[0, 3, 4], [1, 2, 5]], dtype=torch.int32)), "UNSUPPORTED_FEATURE",
     "page_block_size 12"),
    (dict(k=torch.randn(2, 1, 2, 16).half()), "DTYPE_MISMATCH", "k"),
    (dict(v=None), "INVALID_ARGUMENT", "both k and v"),
    (dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_batch_idx"),
    (dict(cache_leftpad=torch.tensor([5, 0], dtype=torch.int32)), "INVALID_ARGUMENT", "cache_leftpad"),
    (dict(rotary_cos=torch.ones(8, 8), rotary_sin=torch.zeros(8, 8)), "INVALID_ARGUMENT", "rotary_cos"),
    (dict(rotary_cos=torch.ones(40, 12), rotary_sin=torch.zeros(40, 12)), "SHAPE_MISMATCH", "rotary"),
    (dict(k_cache=torch.randn(4, 32, 2, 16)[::2]), "NOT_CONTIGUOUS", "k_cache"),
    (dict(num_splits=-1), "INVALID_ARGUMENT", "num_splits"),
    (dict(v_cache=torch.randn(2, 32, 16)), "INVALID_DIMENSION", "v_cache"),
])
def test_bad_input_leaves_the_cache_untouched(overrides, code, word):
    err = _call(**overrides)
    assert err.code.name == code and word in str(err), str(err)


def test_unused_block_table_entries_are_not_read(backend):
    """Entries past a sequence's last page may hold anything (flash-attn's contract too)."""
    k_cache, v_cache = (torch.randn(4, 16, 1, 16) for _ in range(2))
    table = torch.tensor([[2, 99]], dtype=torch.int32)
    out = cuflash.flash_attn_with_kvcache(torch.randn(1, 1, 1, 16), k_cache, v_cache, cache_seqlens=10,
                                         block_table=table)
    assert torch.isfinite(out).all()
