"""Hugging Face transformers: makes "cuflash" a valid `attn_implementation`.

    import cuflash.integrations.transformers as cuflash_hf
    cuflash_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cuflash")

Models then build flash-attn style masks (None without padding, else the 2D (batch, seqlen) padding
mask), and attention runs through flash_attn_func, or, with padding, through
flash_attn_varlen_func on the unpadded tokens: no compute is spent on padding. gpt-oss's attention
sinks (the `s_aux` its attention hands over) run as learnable_sink, with their gradient. The backward is
bitwise reproducible when the call passes deterministic=True, FLASH_ATTENTION_DETERMINISTIC=1 is
set (as with transformers' flash-attn path) or torch.use_deterministic_algorithms is on. Needs
transformers >= 4.56 (AttentionInterface and AttentionMaskInterface); `pip install
cuflash-attn[transformers]`.
"""
from __future__ import annotations

import importlib
import os

import torch

from ..bert_padding import pad_input, unpad_input
from ..errors import ErrorCode, fail
from ..interface import flash_attn_func, flash_attn_varlen_func

NAME = "cuflash"


def register(name: str = NAME) -> None:
    """Registers the attention function and its mask builder under `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _serve_flash_imports(name)
    _declare_compatible(name)


_NAMES: set[str] = set()

# Models that list the flash implementations they run with (transformers' _compatible_flash_implementations)
# and send any other whose name contains "flash" to the first of them, by module and class: those whose needs
# cuflash meets, tested: gpt-oss (its attention sinks, s_aux).
COMPATIBLE_MODELS = (("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssPreTrainedModel"),)


def _declare_compatible(name: str) -> None:
    """Adds `name` to the listed flash implementations of COMPATIBLE_MODELS (through their private class
    attribute; tested with transformers 5.24), so that such a model runs cuflash where it is asked for."""
    for module, class_name in COMPATIBLE_MODELS:
        try:
            model = getattr(importlib.import_module(module), class_name)
        except (ImportError, AttributeError):  # a transformers without the model
            continue
        listed = getattr(model, "_compatible_flash_implementations", None)
        if listed is not None and name not in listed:
            model._compatible_flash_implementations = [*listed, name]


def _serve_flash_imports(name: str) -> None:
    """transformers treats every implementation whose name contains "flash" as a flash-attn kernel
    and, when a model is built, imports its functions from the flash_attn package or the hub. For
    our names, hand it cuflash's flash_attn_func and flash_attn_varlen_func instead (through its
    private `_lazy_imports`; tested with transformers 5.23). Without that hook, nothing is patched."""
    import transformers.modeling_flash_attention_utils as fa_utils
    _NAMES.add(name)
    original = getattr(fa_utils, "_lazy_imports", None)
    if original is None or getattr(original, "serves_cuflash", False):
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _NAMES:
            return flash_attn_func, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
        return original(implementation, *args, **kwargs)

    setattr(_lazy_imports, "serves_cuflash", True)
    fa_utils._lazy_imports = _lazy_imports


def _flash_options(module: torch.nn.Module, scaling: float | None, sliding_window: int | None, softcap: float | None,
                   is_causal: bool | None) -> dict:
    """transformers' attention options as flash-attn's, mapped as transformers' flash-attn path maps
    them: sliding_window w lets a query see w - 1 keys on either side of its own (under the causal
    mask, the w keys up to itself); is_causal from the call, else from the module."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    return dict(softmax_scale=scaling, causal=causal,
                window_size=(sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1),
                softcap=softcap or 0.0)


PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _packed(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """transformers' padding-free kwargs (sequences packed in one row, described by prefix sums) as
    flash_attn_varlen_func's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); None without
    cu_seq_lens_q."""
    if kwargs.get("cu_seq_lens_q") is None:
        return None
    missing = [name for name in PACKED_KWARGS if kwargs.get(name) is None]
    if missing:
        fail(ErrorCode.INVALID_ARGUMENT, f"packed sequences (cu_seq_lens_q) take all of {', '.join(PACKED_KWARGS)}; "
             f"missing: {', '.join(missing)}")
    cu_q, cu_k, max_q, max_k = (kwargs[name] for name in PACKED_KWARGS)
    return cu_q.int(), cu_k.int(), int(max_q), int(max_k)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, Lq, D), key and value (B, Hk, Lk, D),
    attention_mask None or a (B, Lk') bool padding mask (True = token), s_aux gpt-oss's sinks (H,);
    returns (out (B, Lq, H, D), None). Causal attention aligns to the bottom-right corner, so decoding
    with a KV cache works."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # flash layout views
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = (os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
                         or torch.are_deterministic_algorithms_enabled())
    options = dict(_flash_options(module, scaling, sliding_window, softcap, is_causal), dropout_p=dropout,
                   deterministic=deterministic, learnable_sink=s_aux)
    packed = _packed(kwargs)
    if packed is not None and attention_mask is None:  # padding-free training
        return flash_attn_varlen_func(q[0], k[0], v[0], *packed, **options)[None], None
    if attention_mask is None:
        return flash_attn_func(q, k, v, **options), None
    batch, seqlen_q = q.shape[:2]
    mask = attention_mask.bool()
    k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]  # a static cache's mask covers the filled part
    k_tokens, k_indices, cu_seqlens_k, max_seqlen_k, _ = unpad_input(k, mask)
    v_tokens = v.reshape(-1, *v.shape[2:])[k_indices]
    q_tokens, q_indices, cu_seqlens_q, max_seqlen_q, _ = unpad_input(q, mask[:, -seqlen_q:])
    out_tokens = flash_attn_varlen_func(q_tokens, k_tokens, v_tokens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, **options)
    return pad_input(out_tokens, q_indices, batch, seqlen_q), None


def register_context_parallel(mesh, name: str = "cuflash_cp", layout: str = "contiguous", mode: str = "auto") -> None:
    """Registers `name` as an attention implementation that attends across the context-parallel
    DeviceMesh `mesh` (cuflash.distributed.context_parallel_attn_func): each rank runs the model on
    its shard of the sequence (cuflash.distributed.context_parallel_shard of the input ids and of the
    global position ids), causal over the global positions. sliding_window and softcap as
    attention_forward, in every mode. Packed sequences (transformers' cu_seq_lens_q, cu_seq_lens_k,
    max_length_q, max_length_k of the whole packed row, the same on every rank) run on a 1-D mesh
    (context_parallel_attn_varlen_func), each rank's tokens, positions and labels cut by
    context_parallel_shard(t, mesh, layout, dim=1, cu_seqlens=cu_seq_lens_q): layout "zigzag" cuts
    every document into 2W chunks (lengths multiples of 2W), which balances the ring's causal work
    over long documents. No padding mask (train on packed or full-length sequences) and no attention
    dropout; gpt-oss's sinks (s_aux) as learnable_sink in every mode and layout. What the attention
    cannot do raises FlashAttentionError naming it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from ..distributed import context_parallel_attn_func, context_parallel_attn_varlen_func

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                  s_aux: torch.Tensor | None = None, **kwargs):
        if attention_mask is not None:
            fail(ErrorCode.UNSUPPORTED_FEATURE, f"{name}: context parallelism takes no padding mask (attention_mask); "
                 "pass full-length or packed sequences")
        if dropout:
            fail(ErrorCode.UNSUPPORTED_FEATURE, f"{name}: dropout={dropout}: context-parallel attention has no "
                 "attention dropout (set the model's attention_dropout to 0)")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        options = dict(_flash_options(module, scaling, sliding_window, softcap, is_causal), learnable_sink=s_aux)
        packed = _packed(kwargs)
        if packed is None:
            return context_parallel_attn_func(q, k, v, mesh, layout=layout, mode=mode, **options), None
        return context_parallel_attn_varlen_func(q[0], k[0], v[0], *packed, mesh, mode=mode, layout=layout,
                                                 **options)[None], None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)
