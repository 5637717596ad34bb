"""The public surface as data: flash-attn 2.8's signatures (names, order, defaults) of every function
cuflash mirrors, compared with ours through inspect.signature, and the shapes and dtypes of what
return_attn_probs / return_softmax_lse return."""
import inspect

import pytest
import torch

import cuflash

_REQUIRED = inspect.Parameter.empty
_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_VARLEN = [("cu_seqlens_q", _REQUIRED), ("cu_seqlens_k", _REQUIRED), ("max_seqlen_q", _REQUIRED),
           ("max_seqlen_k", _REQUIRED)]

# flash-attn 2.8.3: flash_attn/__init__.py, flash_attn/bert_padding.py, flash_attn/layers/rotary.py
FLASH_ATTN_2_8 = {
    "flash_attn_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _OPTIONS,
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _OPTIONS,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _OPTIONS,
    "flash_attn_varlen_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _VARLEN + _OPTIONS
    + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQUIRED), ("cu_seqlens", _REQUIRED), ("max_seqlen", _REQUIRED)]
    + _OPTIONS,
    "flash_attn_varlen_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _VARLEN + _OPTIONS,
    "flash_attn_with_kvcache": [
        ("q", _REQUIRED), ("k_cache", _REQUIRED), ("v_cache", _REQUIRED), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False)],
    "bert_padding.unpad_input": [("hidden_states", _REQUIRED), ("attention_mask", _REQUIRED), ("unused_mask", None)],
    "bert_padding.pad_input": [("hidden_states", _REQUIRED), ("indices", _REQUIRED), ("batch", _REQUIRED),
                               ("seqlen", _REQUIRED)],
    "bert_padding.unpad_input_for_concatenated_sequences": [("hidden_states", _REQUIRED),
                                                            ("attention_mask_in_length", _REQUIRED)],
    "apply_rotary_emb": [("x", _REQUIRED), ("cos", _REQUIRED), ("sin", _REQUIRED), ("interleaved", False),
                         ("inplace", False), ("seqlen_offsets", 0), ("cu_seqlens", None), ("max_seqlen", None)],
    "apply_rotary_emb_qkv_": [("qkv", _REQUIRED), ("cos", _REQUIRED), ("sin", _REQUIRED), ("cos_k", None),
                              ("sin_k", None), ("interleaved", False), ("seqlen_offsets", 0), ("num_heads_q", None)],
    "apply_rotary_emb_kv_": [("kv", _REQUIRED), ("cos", _REQUIRED), ("sin", _REQUIRED), ("interleaved", False),
                             ("seqlen_offsets", 0)],
    "RotaryEmbedding": [("dim", _REQUIRED), ("base", 10000.0), ("interleaved", False), ("scale_base", None),
                        ("device", None)],
    "RotaryEmbedding.forward": [("self", _REQUIRED), ("qkv", _REQUIRED), ("kv", None), ("seqlen_offset", 0),
                                ("max_seqlen", None), ("num_heads_q", None)],
}
# Keyword-only arguments after flash-attn 2's: FlashAttention-4's score_mod / mask_mod, FlashAttention-3's
# attention_chunk, on the varlen functions FlashAttention-3's seqused_q / seqused_k, and FlashAttention-4's
# learnable_sink (the only one flash_attn_with_kvcache takes).
MODS = [("score_mod", None), ("mask_mod", None), ("attention_chunk", 0)]
SEQUSED = [("seqused_q", None), ("seqused_k", None)]
SINK = [("learnable_sink", None)]
EXTENSIONS = {name: SINK if "kvcache" in name else MODS + (SEQUSED if "varlen" in name else []) + SINK
              for name in FLASH_ATTN_2_8 if name.startswith("flash_attn_")}
# torch 2.x's torch.nn.functional.scaled_dot_product_attention
SDPA = [("query", _REQUIRED), ("key", _REQUIRED), ("value", _REQUIRED), ("attn_mask", None), ("dropout_p", 0.0),
        ("is_causal", False), ("scale", None), ("enable_gqa", False)]


def _ours(name):
    obj = cuflash
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", FLASH_ATTN_2_8)
def test_signature_matches_flash_attn(name):
    params = inspect.signature(_ours(name)).parameters.values()
    positional = [(p.name, p.default) for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword_only = [(p.name, p.default) for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]
    assert positional == FLASH_ATTN_2_8[name], "flash-attn's arguments, callable positionally"
    assert keyword_only == EXTENSIONS.get(name, [])
    assert len(positional) + len(keyword_only) == len(params)


def test_signature_matches_torch_sdpa():
    params = inspect.signature(cuflash.scaled_dot_product_attention).parameters.values()
    assert [(p.name, p.default) for p in params] == SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_returned_probabilities_and_lse(dtype):
    """flash_attn_func / varlen with return_attn_probs: (out, softmax_lse fp32 (B, H, Nq) or
    (H, total_q), probs (B, H, Nq, Nk) in the input dtype); flash_attn_with_kvcache with
    return_softmax_lse: (out, softmax_lse fp32 (B, H, Sq))."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, 16, dtype=dtype), torch.randn(2, 7, 2, 16, dtype=dtype), \
        torch.randn(2, 7, 2, 16, dtype=dtype)
    out, lse, probs = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert (lse.shape, lse.dtype) == ((2, 4, 5), torch.float32)
    assert (probs.shape, probs.dtype) == ((2, 4, 5, 7), dtype)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
    out, lse, probs = cuflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k,
                                                     5, 7, return_attn_probs=True)
    assert (out.shape, lse.shape, lse.dtype, probs.shape) == ((10, 4, 16), (4, 10), torch.float32, (2, 4, 5, 7))
    out, lse = cuflash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=7, return_softmax_lse=True)
    assert (out.shape, lse.shape, lse.dtype) == ((2, 1, 4, 16), (2, 4, 1), torch.float32)
    # the probabilities are a softmax over the keys: each row sums to one
    assert torch.allclose(probs.float().sum(-1), torch.ones(2, 4, 5), atol=1e-2 if dtype == torch.float16 else 1e-5)
