"""Hugging Face transformers with attn_implementation="cuflash": a small Llama-style model built
from a config (random weights, no download) against attn_implementation="sdpa", and a small gpt-oss
(attention sinks, sliding and full attention layers) against "eager"."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import cuflash  # noqa: E402
import cuflash.integrations.transformers as cuflash_hf  # noqa: E402


def _config():
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _models(device, dtype):
    """The sdpa model and the cuflash one with the same weights. Each gets a config of its own:
    _from_config writes attn_implementation into the config it is handed, so one shared config
    would make both models run the implementation built last."""
    cuflash_hf.register()
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa", torch_dtype=dtype)
    ours = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="cuflash", torch_dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return ref.to(device), ours.to(device)


def _gpt_oss_config():
    """A tiny gpt-oss: a sliding-window layer (5 tokens) then a full one, as gpt-oss alternates them, with
    GQA; every token takes both experts (no routing choice for rounding to flip)."""
    return transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                     num_experts_per_tok=2, sliding_window=5,
                                     layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)


def _gpt_oss_models(device, dtype):
    """The eager gpt-oss (sinks concatenated to the logits) and the cuflash one with the same weights,
    sinks of a size that weighs (gpt-oss initializes them near 0)."""
    cuflash_hf.register()
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM._from_config(_gpt_oss_config(), attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    ours = transformers.GptOssForCausalLM._from_config(_gpt_oss_config(), attn_implementation="cuflash", dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "cuflash"  # (not sent to a hub kernel it lists)
    return ref.to(device), ours.to(device)


@pytest.fixture(autouse=True)
def cuflash_calls(monkeypatch):
    """Counts the integration's calls into cuflash, so that each test can assert which model ran it."""
    calls = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        fn = getattr(cuflash_hf, name)
        monkeypatch.setattr(cuflash_hf, name, lambda *a, _fn=fn, **kw: calls.append(_fn) or _fn(*a, **kw))
    return calls


def _run(model, calls, **inputs):
    """model(**inputs), asserting that cuflash ran in every layer of the cuflash model and nowhere else."""
    before = len(calls)
    result = model(**inputs)
    ran = len(calls) - before
    expected = model.config.num_hidden_layers if model.config._attn_implementation == "cuflash" else 0
    assert ran == expected, f"{model.config._attn_implementation} model: {ran} cuflash calls, expected {expected}"
    return result


def _batch(device, padding_side):
    """Three sequences of 21, 13 and 5 tokens padded on padding_side ("none": all of 21 tokens)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 21), device=device)
    mask = torch.ones(3, 21, dtype=torch.long, device=device)
    lengths = [21, 13, 5] if padding_side != "none" else [21, 21, 21]
    for b, n in enumerate(lengths):
        if padding_side == "right":
            mask[b, n:] = 0
        else:
            mask[b, :21 - n] = 0
    return ids, mask


def check_logits_and_grads(device, dtype, padding_side, tol, calls, models=_models):
    ref, ours = models(device, dtype)
    ids, mask = _batch(device, padding_side)
    results = []
    for model in (ref, ours):
        model.zero_grad()
        logits = _run(model, calls, input_ids=ids, attention_mask=mask).logits
        valid = logits[mask.bool()]  # padded positions are not defined the same way by both
        (valid.float().square().mean()).backward()
        results.append((valid.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_logits, ref_grads), (logits, grads) = results
    assert torch.isfinite(logits).all()
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < tol
    for name, g in ref_grads.items():
        assert ((grads[name] - g).norm() / g.norm()).item() < tol * 10, name


def check_generate(device, dtype, calls, models=_models):
    ref, ours = models(device, dtype)
    ids, mask = _batch(device, "left")
    out_ref = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    assert not calls, "the sdpa model ran cuflash"
    out = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                        output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    assert len(calls) == 8 * ours.config.num_hidden_layers  # the prompt and 7 decoding steps, every layer
    assert out.sequences.shape == (3, 29)
    assert torch.equal(out.sequences, out_ref.sequences)
    for a, b in zip(out.scores, out_ref.scores):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_llama_logits_and_gradients_match_sdpa_cpu(padding_side, cuflash_calls):
    check_logits_and_grads("cpu", torch.float32, padding_side, 1e-5, cuflash_calls)


def test_llama_generate_with_kv_cache_cpu(cuflash_calls):
    check_generate("cpu", torch.float32, cuflash_calls)


def test_no_padding_and_full_model_forward_cpu(cuflash_calls):
    ref, ours = _models("cpu", torch.float32)
    ids = torch.randint(0, 97, (2, 17))
    assert torch.allclose(_run(ours, cuflash_calls, input_ids=ids).logits,
                          _run(ref, cuflash_calls, input_ids=ids).logits, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_llama_on_gpu(padding_side, cuflash_calls):
    check_logits_and_grads("cuda", torch.bfloat16, padding_side, 2e-2, cuflash_calls)
    cuflash_calls.clear()
    check_generate("cuda", torch.float32, cuflash_calls)


@pytest.mark.parametrize("padding_side", ["none", "left"])
def test_gpt_oss_logits_and_gradients_match_eager_cpu(padding_side, cuflash_calls):
    """gpt-oss's sinks (s_aux) run as learnable_sink, in the sliding-window layer and the full one, dense
    and (with padding) varlen: logits and every gradient, the sinks' among them, as the eager model's."""
    check_logits_and_grads("cpu", torch.float32, padding_side, 1e-5, cuflash_calls, _gpt_oss_models)


def test_gpt_oss_generate_with_kv_cache_cpu(cuflash_calls):
    check_generate("cpu", torch.float32, cuflash_calls, _gpt_oss_models)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("padding_side", ["none", "left"])
def test_gpt_oss_on_gpu(padding_side, cuflash_calls):
    check_logits_and_grads("cuda", torch.bfloat16, padding_side, 2e-2, cuflash_calls, _gpt_oss_models)
    cuflash_calls.clear()
    check_generate("cuda", torch.float32, cuflash_calls, _gpt_oss_models)


def test_packed_sequences_without_padding_cpu(cuflash_calls):
    """Padding-free training: several sequences in one row with transformers' cu_seq_lens_* kwargs
    give what each sequence gives alone."""
    ref, ours = _models("cpu", torch.float32)
    lengths = [7, 12, 3]
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    cu = torch.tensor([0, 7, 19, 22], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = _run(ours, cuflash_calls, input_ids=torch.cat(seqs, dim=1), position_ids=position_ids,
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12).logits
    alone = torch.cat([_run(ref, cuflash_calls, input_ids=s).logits for s in seqs], dim=1)
    assert torch.allclose(logits, alone, atol=1e-5)


def test_deterministic_reaches_the_kernels(monkeypatch):
    """deterministic=True from the call, FLASH_ATTENTION_DETERMINISTIC=1 or
    torch.use_deterministic_algorithms reaches flash_attn_func (the fused Hopper backward adds dQ
    in a varying order otherwise); the default is the fast backward."""
    seen = []
    monkeypatch.setattr(cuflash_hf, "flash_attn_func", lambda q, k, v, **options: seen.append(options) or q)
    q = torch.randn(1, 4, 5, 16)
    module = torch.nn.Module()
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    cuflash_hf.attention_forward(module, q, q, q, None)
    cuflash_hf.attention_forward(module, q, q, q, None, deterministic=True)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    cuflash_hf.attention_forward(module, q, q, q, None)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        cuflash_hf.attention_forward(module, q, q, q, None)
    finally:
        torch.use_deterministic_algorithms(before)
    assert [options["deterministic"] for options in seen] == [False, True, True, True]


def test_bidirectional_sliding_window_matches_sdpa_cpu(cuflash_calls):
    """An encoder's sliding window (ModernBERT's local layers, is_causal False) bounds both sides: a
    query sees sliding_window - 1 keys either side, as transformers' flash-attn path and its sdpa
    mask have it, with and without padding."""
    def config():
        return transformers.ModernBertConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, local_attention=6, global_attn_every_n_layers=2,
                                             max_position_embeddings=64, pad_token_id=0, sep_token_id=1, cls_token_id=2,
                                             bos_token_id=2, eos_token_id=1)
    cuflash_hf.register()
    torch.manual_seed(0)
    ref = transformers.ModernBertModel._from_config(config(), attn_implementation="sdpa", dtype=torch.float32)
    ours = transformers.ModernBertModel._from_config(config(), attn_implementation="cuflash", dtype=torch.float32)
    ours.load_state_dict(ref.state_dict())
    assert "sliding_attention" in ours.config.layer_types
    ids = torch.randint(3, 97, (2, 20))  # 20 tokens: past the 6-token local window
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 15:] = 0
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
        out = _run(ours, cuflash_calls, **inputs).last_hidden_state
        expected = _run(ref, cuflash_calls, **inputs).last_hidden_state
        valid = mask.bool() if "attention_mask" in inputs else slice(None)
        assert torch.allclose(out[valid], expected[valid], atol=1e-5)


def test_incomplete_packed_kwargs_raise_naming_the_missing_ones():
    """Padding-free kwargs come four together (as transformers passes them); a call with
    cu_seq_lens_q and not the others raises naming those it lacks."""
    q = torch.randn(1, 4, 6, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(cuflash.FlashAttentionError, match="missing: cu_seq_lens_k, max_length_k"):
        cuflash_hf.attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=4)
