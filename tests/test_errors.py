"""Bad input: each case raises FlashAttentionError with its code and a message naming the argument."""
import math

import numpy as np
import pytest
import torch

import cuflash
from attn_testing import raises
from cuflash import ErrorCode
from cuflash.backend import backend_name
from cuflash.reference import attention_reference


def qkv(b=2, n=8, h=4, hk=4, d=16, dtype=torch.float32):
    return torch.randn(b, n, h, d, dtype=dtype), torch.randn(b, n, hk, d, dtype=dtype), \
        torch.randn(b, n, hk, d, dtype=dtype)


def test_wrong_ndim():
    q, k, v = qkv()
    with raises(ErrorCode.INVALID_DIMENSION, "q", "4 dimensions", "3"):
        cuflash.flash_attn_func(q[0], k, v)


def test_batch_mismatch():
    q, k, v = qkv()
    with raises(ErrorCode.SHAPE_MISMATCH, "k", "batch"):
        cuflash.flash_attn_func(q, k[:1], v[:1])


def test_k_v_shape_mismatch():
    q, k, v = qkv()
    with raises(ErrorCode.SHAPE_MISMATCH, "v", "(2, 7, 4, 16)"):
        cuflash.flash_attn_func(q, k, v[:, :7])


def test_head_dim_mismatch():
    q, k, v = qkv()
    with raises(ErrorCode.SHAPE_MISMATCH, "k", "head dim"):
        cuflash.flash_attn_func(q, k[..., :8], v[..., :8])


def test_nheads_not_multiple_of_nheads_k():
    q, k, v = qkv(h=4, hk=3)
    with raises(ErrorCode.SHAPE_MISMATCH, "4 heads", "3 heads", "MQA/GQA"):
        cuflash.flash_attn_func(q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with raises(ErrorCode.DTYPE_MISMATCH, "k", "torch.float16", "torch.float32"):
        cuflash.flash_attn_func(q, k.half(), v)


def test_mixed_devices():
    q, k, v = qkv()
    with raises(ErrorCode.DEVICE_MISMATCH, "v", "meta", "cpu"):
        cuflash.flash_attn_func(q, k, v.to("meta"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    q, k, v = (torch.zeros(1, 4, 1, 8).to(dtype) for _ in range(3))
    with raises(ErrorCode.UNSUPPORTED_DTYPE, "q", str(dtype)):
        cuflash.flash_attn_func(q, k, v)


def test_float64_rejected_by_the_kernels(monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    q, k, v = qkv(dtype=torch.float64)
    with raises(ErrorCode.UNSUPPORTED_DTYPE, "float64"):
        cuflash.flash_attn_func(q, k, v)


def test_head_dim_zero():
    q, k, v = qkv(d=0)
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "q", "head dim 0", "1 to 512"):
        cuflash.flash_attn_func(q, k, v)


def test_head_dim_too_large():
    q, k, v = qkv(d=520)
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "q", "520", "1 to 512"):
        cuflash.flash_attn_func(q, k, v)


def test_empty_tensor():
    """Where no empty result is defined, an empty input raises (the dense and varlen functions and
    SDPA take them: test_empty_inputs in test_attention.py and test_varlen.py)."""
    q, k, v = qkv()
    with raises(ErrorCode.EMPTY_TENSOR, "k", "no elements"):
        cuflash.flash_attn_varlen_func(q[0], k[:0], v[:0], torch.tensor([0, 8], dtype=torch.int32),
                                       torch.tensor([0, 0], dtype=torch.int32), 8, 0,
                                       block_table=torch.zeros(1, 1, dtype=torch.int32))  # a pool of no page
    with raises(ErrorCode.EMPTY_TENSOR, "q", "no elements"):
        cuflash.flash_attn_with_kvcache(q[:, :0], k, v)


def test_none_argument():
    q, k, v = qkv()
    with raises(ErrorCode.NULL_POINTER, "v", "None"):
        cuflash.flash_attn_func(q, k, None)


def test_non_tensor_argument():
    q, k, v = qkv()
    with raises(ErrorCode.INVALID_ARGUMENT, "q", "list"):
        cuflash.flash_attn_func(q.tolist(), k, v)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, "0.5", True, torch.tensor([0.5, 0.5]), 1j])
def test_bad_softmax_scale(scale):
    """Any finite real number is a scale (0 and negative ones too: test_attention.py); NaN, inf, bools
    and non-numbers are not."""
    q, k, v = qkv()
    with raises(ErrorCode.INVALID_ARGUMENT, "softmax_scale", "finite"):
        cuflash.flash_attn_func(q, k, v, softmax_scale=scale)
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))
    with raises(ErrorCode.INVALID_ARGUMENT, "scale", "finite"):
        cuflash.scaled_dot_product_attention(query, key, value, scale=scale)


@pytest.mark.parametrize("scale", [0, -2, 0.25, np.float32(0.25), np.int64(-1), torch.tensor(0.25)])
def test_softmax_scale_takes_any_finite_real_number(scale):
    """Python, numpy and one-element tensor numbers are read as the float they hold (torch SDPA takes
    numpy's too)."""
    q, k, v = qkv()
    expected, _ = attention_reference(q, k, v, float(scale))
    assert (cuflash.flash_attn_func(q, k, v, softmax_scale=scale).double() - expected).abs().max() < 1e-5


def _flag_calls():
    """Every entry point's bool arguments: (name of the argument, a call taking its value)."""
    q, k, v = qkv()
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    cos, sin = torch.ones(8, 8), torch.zeros(8, 8)
    qkv_packed, kv_packed = torch.stack((q, k, v), dim=2), torch.stack((k, v), dim=2)
    calls = []
    for option in ("causal", "deterministic", "return_attn_probs"):
        calls += [
            (option, lambda x, o=option: cuflash.flash_attn_func(q, k, v, **{o: x})),
            (option, lambda x, o=option: cuflash.flash_attn_qkvpacked_func(qkv_packed, **{o: x})),
            (option, lambda x, o=option: cuflash.flash_attn_kvpacked_func(q, kv_packed, **{o: x})),
            (option, lambda x, o=option: cuflash.flash_attn_varlen_func(*flat, cu, cu, 8, 8, **{o: x})),
            (option, lambda x, o=option: cuflash.flash_attn_varlen_qkvpacked_func(
                qkv_packed.flatten(0, 1), cu, 8, **{o: x})),
            (option, lambda x, o=option: cuflash.flash_attn_varlen_kvpacked_func(
                flat[0], kv_packed.flatten(0, 1), cu, cu, 8, 8, **{o: x})),
        ]
    for option in ("causal", "deterministic"):
        calls.append((option, lambda x, o=option: cuflash.backward(q, q, k, v, q, torch.zeros(2, 4, 8), **{o: x})))
    calls += [
        ("causal", lambda x: cuflash.forward(q, k, v, causal=x)),
        ("is_causal", lambda x: cuflash.scaled_dot_product_attention(query, key, value, is_causal=x)),
        ("enable_gqa", lambda x: cuflash.scaled_dot_product_attention(query, key, value, enable_gqa=x)),
        ("is_causal", lambda x: cuflash.scaled_dot_product_attention(query[0, 0], key[0, 0], value[0, 0],
                                                                     is_causal=x)),
        ("interleaved", lambda x: cuflash.apply_rotary_emb(q, cos, sin, interleaved=x)),
        ("inplace", lambda x: cuflash.apply_rotary_emb(q, cos, sin, inplace=x)),
        ("interleaved", lambda x: cuflash.apply_rotary_emb_qkv_(qkv_packed, cos, sin, interleaved=x)),
        ("interleaved", lambda x: cuflash.apply_rotary_emb_kv_(kv_packed, cos, sin, interleaved=x)),
    ]
    return calls


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0, np.bool_(True), torch.tensor(True)],
                         ids=["1", "0", "str", "None", "float", "numpy", "tensor"])
def test_flags_must_be_bools(value):
    """A flag is a Python bool, as torch SDPA's is_causal and enable_gqa are (its schema refuses
    ints, numpy bools and tensors with a TypeError): anything else raises naming the argument,
    through one check (validate.check_bool) at every entry point."""
    for name, call in _flag_calls():
        with raises(ErrorCode.INVALID_ARGUMENT, name, "bool", repr(value)):
            call(value)


def test_flags_take_true_and_false():
    for _, call in _flag_calls():
        for value in (False, True):
            call(value)


def test_last_dim_not_contiguous():
    """flash-attn's API refuses a strided head dim, as flash-attn does (scaled_dot_product_attention
    copies it, as torch takes it: test_attention.py)."""
    q, k, v = qkv()
    with raises(ErrorCode.NOT_CONTIGUOUS, "q", "stride 1", ".contiguous()"):
        cuflash.flash_attn_func(q.transpose(1, 3).contiguous().transpose(1, 3), k, v)
    with raises(ErrorCode.NOT_CONTIGUOUS, "k", "stride 1"):
        cuflash.flash_attn_varlen_func(q[0], torch.randn(8, 4, 32)[..., ::2], v[0],
                                       *[torch.tensor([0, 8], dtype=torch.int32)] * 2, 8, 8)


def test_cuda_tensor_on_a_gpu_too_old(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with raises(ErrorCode.UNSUPPORTED_DEVICE, "Tesla V100", "7.0", "8.0"):
        backend_name(torch.device("cuda"), torch.float16)


def test_cuda_tensor_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with raises(ErrorCode.UNSUPPORTED_DEVICE, "TRITON_INTERPRET", "cuda"):
        backend_name(torch.device("cuda"), torch.float16)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    with raises(ErrorCode.UNSUPPORTED_DEVICE, "TRITON_INTERPRET=1"):
        cuflash.flash_attn_func(q, k, v)


@pytest.mark.parametrize("kwargs,code,words", [
    (dict(dropout_p=1.0), ErrorCode.INVALID_ARGUMENT, ["dropout_p", "[0, 1)"]),
    (dict(dropout_p=-0.1), ErrorCode.INVALID_ARGUMENT, ["dropout_p"]),
    (dict(dropout_p=True), ErrorCode.INVALID_ARGUMENT, ["dropout_p"]),
    (dict(window_size=(-2, 0)), ErrorCode.INVALID_ARGUMENT, ["window_size", ">= -1"]),
    (dict(window_size=(3,)), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=(1.5, 0)), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=(True, 0)), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=torch.tensor([2.0, 0.0])), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=torch.tensor([[2, 0]])), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=torch.tensor([2, 0, 1])), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=(torch.tensor([2]), 0)), ErrorCode.INVALID_ARGUMENT, ["window_size"]),
    (dict(window_size=torch.tensor([-3, 0])), ErrorCode.INVALID_ARGUMENT, ["window_size", ">= -1"]),
    (dict(softcap=-1.0), ErrorCode.INVALID_ARGUMENT, ["softcap"]),
    (dict(softcap=math.nan), ErrorCode.INVALID_ARGUMENT, ["softcap"]),
    (dict(alibi_slopes=torch.ones(3)), ErrorCode.SHAPE_MISMATCH, ["alibi_slopes", "(4,)", "(2, 4)"]),
    (dict(alibi_slopes=torch.ones(2, 4, 1)), ErrorCode.SHAPE_MISMATCH, ["alibi_slopes"]),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), ErrorCode.UNSUPPORTED_DTYPE, ["alibi_slopes", "float32"]),
    (dict(alibi_slopes=[1.0] * 4), ErrorCode.INVALID_ARGUMENT, ["alibi_slopes"]),
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)), ErrorCode.UNSUPPORTED_FEATURE, ["alibi_slopes", "grad"]),
])
def test_bad_options(kwargs, code, words):
    q, k, v = qkv()
    with raises(code, *words):
        cuflash.flash_attn_func(q, k, v, **kwargs)


def _varlen(**overrides):
    """A valid varlen call (3 sequences of 3, 0 and 5 query rows), with some arguments replaced."""
    args = dict(q=torch.randn(8, 2, 16), k=torch.randn(10, 2, 16), v=torch.randn(10, 2, 16),
                cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 4, 6, 10], dtype=torch.int32), max_seqlen_q=5, max_seqlen_k=4)
    args.update(overrides)
    return cuflash.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("overrides,code,words", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 3, 8])), ErrorCode.UNSUPPORTED_DTYPE, ["cu_seqlens_q", "int32"]),
    (dict(cu_seqlens_k=[0, 4, 6, 10]), ErrorCode.INVALID_ARGUMENT, ["cu_seqlens_k", "int32"]),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), ErrorCode.INVALID_ARGUMENT,
     ["cu_seqlens_q", "never decrease"]),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 3, 8], dtype=torch.int32)), ErrorCode.INVALID_ARGUMENT,
     ["cu_seqlens_q", "start at 0"]),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32)), ErrorCode.SHAPE_MISMATCH,
     ["cu_seqlens_k", "same batch"]),
    (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), ErrorCode.SHAPE_MISMATCH, ["cu_seqlens_q"]),
    (dict(cu_seqlens_q=torch.tensor([[0, 3, 3, 8]], dtype=torch.int32)), ErrorCode.SHAPE_MISMATCH,
     ["cu_seqlens_q", "(batch + 1,)"]),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 6, 9], dtype=torch.int32)), ErrorCode.SHAPE_MISMATCH,
     ["cu_seqlens_k", "ends at 9", "10 rows"]),
    (dict(max_seqlen_q=4), ErrorCode.INVALID_ARGUMENT, ["max_seqlen_q=4", "5 tokens"]),
    (dict(max_seqlen_k=0), ErrorCode.INVALID_ARGUMENT, ["max_seqlen_k"]),
    (dict(q=torch.randn(2, 8, 2, 16)), ErrorCode.INVALID_DIMENSION, ["q", "(total_q, nheads, headdim)"]),
    (dict(k=torch.randn(10, 3, 16), v=torch.randn(10, 3, 16)), ErrorCode.SHAPE_MISMATCH, ["heads"]),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ErrorCode.INVALID_DIMENSION,
     ["k", "block_table", "4 dimensions"]),
])
def test_bad_varlen_arguments(overrides, code, words):
    with raises(code, *words):
        _varlen(**overrides)


def test_packed_wrong_size():
    with raises(ErrorCode.SHAPE_MISMATCH, "qkv", "size 3"):
        cuflash.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8))
    with raises(ErrorCode.SHAPE_MISMATCH, "kv", "size 2"):
        cuflash.flash_attn_kvpacked_func(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 3, 2, 8))


def test_sdpa_errors():
    query, key, value = (torch.randn(2, 4, 8, 16) for _ in range(3))
    with raises(ErrorCode.SHAPE_MISMATCH, "attn_mask", "(3, 8)", "broadcast"):
        cuflash.scaled_dot_product_attention(query, key, value, attn_mask=torch.ones(3, 8, dtype=torch.bool))
    with raises(ErrorCode.UNSUPPORTED_DTYPE, "attn_mask", "torch.int64"):
        cuflash.scaled_dot_product_attention(query, key, value, attn_mask=torch.ones(8, 8, dtype=torch.int64))
    with raises(ErrorCode.UNSUPPORTED_FEATURE, "attn_mask", "grad"):
        cuflash.scaled_dot_product_attention(query, key, value, attn_mask=torch.zeros(8, 8, requires_grad=True))
    with raises(ErrorCode.INVALID_ARGUMENT, "attn_mask", "is_causal"):
        cuflash.scaled_dot_product_attention(query, key, value, attn_mask=torch.zeros(8, 8), is_causal=True)
    with raises(ErrorCode.INVALID_ARGUMENT, "dropout_p"):
        cuflash.scaled_dot_product_attention(query, key, value, dropout_p=1.5)
    with raises(ErrorCode.SHAPE_MISMATCH, "enable_gqa"):
        cuflash.scaled_dot_product_attention(query, key[:, :2], value[:, :2])
    with raises(ErrorCode.SHAPE_MISMATCH, "key", "head dim"):
        cuflash.scaled_dot_product_attention(query, key[..., :8], value)
    with raises(ErrorCode.INVALID_DIMENSION, "query"):
        cuflash.scaled_dot_product_attention(query[0, 0], key, value)
    # The rest of a tensor's checks run on the (batch, seqlen, nheads, headdim) views, under torch's names.
    with raises(ErrorCode.NULL_POINTER, "key"):
        cuflash.scaled_dot_product_attention(query, None, value)
    with raises(ErrorCode.UNSUPPORTED_DTYPE, "value", "torch.int32"):
        cuflash.scaled_dot_product_attention(query, key, value.int())
    with raises(ErrorCode.UNSUPPORTED_HEAD_DIM, "query", "(2, 4, 8, 0)"):
        cuflash.scaled_dot_product_attention(query[..., :0], key[..., :0], value[..., :0])
    with raises(ErrorCode.INVALID_ARGUMENT, "scale"):
        cuflash.scaled_dot_product_attention(query, key, value, scale=math.nan)


def test_backward_argument_checks():
    q, k, v = qkv()
    out, lse = cuflash.forward(q, k, v)
    with raises(ErrorCode.SHAPE_MISMATCH, "softmax_lse"):
        cuflash.backward(out, q, k, v, out, lse[:, :, :3])
    with raises(ErrorCode.UNSUPPORTED_DTYPE, "softmax_lse", "float32"):
        cuflash.backward(out, q, k, v, out, lse.double())
    with raises(ErrorCode.DTYPE_MISMATCH, "dout"):
        cuflash.backward(out.half(), q, k, v, out, lse)


def test_flash_attn_func_checks_each_signature_once(monkeypatch):
    """A call signature (shapes, strides, dtypes, devices, options, backend settings) whose checks
    passed is not checked again; a call that differs in any part is, and bad input is still refused
    after a good call of a signature next to it. (scaled_dot_product_attention: the next test.)"""
    from cuflash import interface, memo
    from cuflash.reference import attention_reference

    memo.CHECKED.clear()
    checked = []
    real = interface.check_attention_inputs
    monkeypatch.setattr(interface, "check_attention_inputs", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    for _ in range(2):  # new data, the same signature: checked once, computed each time
        q, k, v = qkv(h=4, hk=2)
        ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
        assert (cuflash.flash_attn_func(q, k, v, causal=True).double() - ref).abs().max() < 1e-5
    assert len(checked) == 1
    cuflash.flash_attn_func(q, k, v, causal=False, window_size=(2, 1))  # other options
    assert len(checked) == 2
    with raises(ErrorCode.DTYPE_MISMATCH, "k"):
        cuflash.flash_attn_func(q, k.double(), v, causal=True)
    with raises(ErrorCode.DEVICE_MISMATCH, "v"):
        cuflash.flash_attn_func(q, k, v.to("meta"), causal=True)
    with raises(ErrorCode.NOT_CONTIGUOUS, "q"):
        cuflash.flash_attn_func(q.transpose(1, 3).contiguous().transpose(1, 3), k, v, causal=True)
    with raises(ErrorCode.SHAPE_MISMATCH, "heads"):
        cuflash.flash_attn_func(q[:, :, :3], k, v, causal=True)
    with raises(ErrorCode.SHAPE_MISMATCH, "v"):
        cuflash.flash_attn_func(q, k, v[:, :5], causal=True)
    with raises(ErrorCode.INVALID_ARGUMENT, "window_size"):
        cuflash.flash_attn_func(q, k, v, window_size=(-2, 0))
    monkeypatch.setenv("CUFLASH_BACKEND", "fastest")
    with raises(ErrorCode.INVALID_ARGUMENT, "CUFLASH_BACKEND"):
        cuflash.flash_attn_func(q, k, v, causal=True)
    monkeypatch.delenv("CUFLASH_BACKEND")
    before = len(checked)
    for _ in range(2):  # per-call tensors (ALiBi slopes, a dropout seed): never remembered
        cuflash.flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(4))
        cuflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.5)
    assert len(checked) == before + 4


def test_sdpa_checks_each_signature_once(monkeypatch):
    """scaled_dot_product_attention remembers its checked calls as flash_attn_func does: once per
    signature, every part of it in the key, masks and dropout never remembered."""
    from cuflash import interface, memo
    from cuflash.reference import attention_reference

    memo.CHECKED.clear()
    checked = []
    real = interface.check_attention_inputs
    monkeypatch.setattr(interface, "check_attention_inputs", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    for _ in range(2):
        q, k, v = (t.transpose(1, 2) for t in qkv(h=4, hk=2))  # (B, H, N, D)
        ref, _ = attention_reference(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)
        out = cuflash.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert (out.transpose(1, 2).double() - ref).abs().max() < 1e-5
    assert len(checked) == 1
    with raises(ErrorCode.SHAPE_MISMATCH, "enable_gqa"):
        cuflash.scaled_dot_product_attention(q, k, v, is_causal=True)
    with raises(ErrorCode.DTYPE_MISMATCH, "key"):
        cuflash.scaled_dot_product_attention(q, k.double(), v, is_causal=True, enable_gqa=True)
    with raises(ErrorCode.SHAPE_MISMATCH, "value"):  # fewer keys than values
        cuflash.scaled_dot_product_attention(q, k, v[:, :, :5], is_causal=True, enable_gqa=True)
    with raises(ErrorCode.INVALID_ARGUMENT, "scale"):
        cuflash.scaled_dot_product_attention(q, k, v, is_causal=True, scale=math.inf, enable_gqa=True)
    before = len(checked)
    for _ in range(2):
        cuflash.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), enable_gqa=True)
        cuflash.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
    assert len(checked) == before + 4
