"""cuflash.bert_padding: unpad_input / pad_input with flash-attn 2.8's return values, values
checked token by token, gradients, and the round trip through the varlen attention; the packing of
concatenated sequences and the row gather / scatter under them."""
import pytest
import torch

import cuflash
from attn_testing import rel_err
from cuflash.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input, \
    unpad_input_for_concatenated_sequences
from cuflash.reference import attention_reference

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_returns_the_kept_tokens_in_order(device):
    torch.manual_seed(0)
    x = torch.randn(3, 6, 2, 4, device=device)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]], device=device)
    tokens, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
    expected = [(b, i) for b in range(3) for i in range(6) if mask[b, i]]
    assert indices.tolist() == [b * 6 + i for b, i in expected]
    assert torch.equal(tokens, torch.stack([x[b, i] for b, i in expected]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 9, 11]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    assert used.dtype == torch.int32 and used.tolist() == [3, 6, 2]


def test_unused_mask_counts_in_cu_seqlens_not_in_used_seqlens():
    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]])
    tokens, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 3, 5, 6]
    assert cu_seqlens.tolist() == [0, 4, 6] and max_seqlen == 4 and used.tolist() == [2, 1]
    assert torch.equal(tokens, x.reshape(10, 3)[indices])


@pytest.mark.parametrize("device", DEVICES)
def test_pad_inverts_unpad_with_gradients(device):
    torch.manual_seed(1)
    x = torch.randn(2, 7, 3, device=device, requires_grad=True)
    mask = torch.rand(2, 7, device=device) > 0.4
    mask[:, 0] = True
    tokens, indices, *_ = unpad_input(x, mask)
    back = pad_input(tokens, indices, 2, 7)
    assert torch.equal(back, torch.where(mask[..., None], x, 0.0))
    back.backward(torch.ones_like(back))
    assert torch.equal(x.grad, mask[..., None].expand_as(x).float())


def test_varlen_attention_through_the_helpers():
    """A padded batch, unpadded, attended with flash_attn_varlen_func and padded back, equals each
    sequence's own attention (float64 oracle) and zero on the padding."""
    torch.manual_seed(2)
    batch, seqlen, nheads, d = 3, 9, 2, 16
    q, k, v = (torch.randn(batch, seqlen, nheads, d) for _ in range(3))
    lengths = [9, 4, 1]
    mask = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    (q_u, idx, cu, max_len, _), (k_u, *_), (v_u, *_) = (unpad_input(t, mask) for t in (q, k, v))
    out = pad_input(cuflash.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_len, max_len, causal=True),
                    idx, batch, seqlen)
    for b, n in enumerate(lengths):
        ref, _ = attention_reference(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        assert rel_err(out[b:b + 1, :n], ref) < 1e-5
        assert (out[b, n:] == 0).all()


def test_bad_mask_names_the_argument():
    with pytest.raises(cuflash.FlashAttentionError, match="attention_mask"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 4))
    with pytest.raises(cuflash.FlashAttentionError, match="unused_mask"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 5), torch.ones(5))


def test_concatenated_sequences_pack_every_sequence_of_every_row():
    """Rows holding several sequences one after the other (flash-attn's example: lengths [2, 3],
    [3, 2] and [6] in rows of 6): the kept tokens are each row's first sum(lengths), and cu_seqlens
    counts every sequence of every row."""
    x = torch.randn(3, 6, 4)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    tokens, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(tokens, x.reshape(18, 4)[indices])
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    with pytest.raises(cuflash.FlashAttentionError, match="attention_mask_in_length"):
        unpad_input_for_concatenated_sequences(x, lengths.float())


def test_row_gather_and_scatter_with_gradients():
    """index_first_axis picks rows (its gradient scatters back, adding rows picked twice);
    index_put_first_axis puts rows into zeros (its gradient gathers them)."""
    torch.manual_seed(3)
    x = torch.randn(5, 2, 3, requires_grad=True)
    rows = torch.tensor([4, 0, 4])
    picked = index_first_axis(x, rows)
    assert torch.equal(picked, torch.stack([x[4], x[0], x[4]]))
    picked.backward(torch.ones_like(picked))
    assert x.grad[:, 0, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 2.0]
    values = torch.randn(2, 3, requires_grad=True)
    out = index_put_first_axis(values, torch.tensor([3, 1]), 5)
    assert torch.equal(out[3], values[0]) and torch.equal(out[1], values[1])
    assert out[[0, 2, 4]].abs().sum() == 0
    out.backward(torch.arange(15.0).view(5, 3))
    assert values.grad.tolist() == [[9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]
    with pytest.raises(cuflash.FlashAttentionError, match="one index per row of values"):
        index_put_first_axis(values, torch.tensor([1]), 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("indices,code,words", [
    ([0, 6], cuflash.ErrorCode.INVALID_ARGUMENT, ["indices", "[0, 6)", "from 0 to 6"]),
    ([-1, 2], cuflash.ErrorCode.INVALID_ARGUMENT, ["indices", "[0, 6)", "from -1 to 2"]),
    (torch.tensor([0.0, 2.0]), cuflash.ErrorCode.UNSUPPORTED_DTYPE, ["indices", "int64", "torch.float32"]),
    (torch.tensor([True, False]), cuflash.ErrorCode.UNSUPPORTED_DTYPE, ["indices", "torch.bool"]),
    ([[0, 2]], cuflash.ErrorCode.SHAPE_MISMATCH, ["indices", "got (1, 2)"]),
], ids=["past_the_end", "negative", "float", "bool", "2d"])
def test_bad_indices_name_the_argument(device, indices, code, words):
    """pad_input, index_put_first_axis and index_first_axis check the indices torch would index with
    (an IndexError for a float dtype or a row past the end, a negative row wrapped around): int64 or
    int32, one per row, in [0, rows); a good call at the bounds passes."""
    indices = torch.as_tensor(indices, device=device)
    values = torch.randn(2, 3, device=device)
    calls = [lambda i: pad_input(values, i, 2, 3), lambda i: index_put_first_axis(values, i, 6),
             lambda i: index_first_axis(torch.randn(6, 3, device=device), i)]
    for call in calls:
        with pytest.raises(cuflash.FlashAttentionError) as info:
            call(indices)
        assert info.value.code == code and all(w in str(info.value) for w in words), str(info.value)
    good = torch.tensor([5, 0], device=device, dtype=torch.int32)
    assert torch.equal(pad_input(values, good, 2, 3)[1, 2], values[0])
    assert torch.equal(index_first_axis(values.repeat(3, 1), good), values.repeat(3, 1)[[5, 0]])
