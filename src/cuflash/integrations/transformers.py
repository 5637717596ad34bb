"""Hugging Face transformers: makes "cuflash" a valid `attn_implementation`.

    import cuflash.integrations.transformers as cuflash_hf
    cuflash_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cuflash")

Models then build flash-attn style masks (None without padding, else the 2D (batch, seqlen) padding
mask), and attention runs through flash_attn_func, or, with padding, through
flash_attn_varlen_func on the unpadded tokens: no compute is spent on padding. The backward is
bitwise reproducible when the call passes deterministic=True, FLASH_ATTENTION_DETERMINISTIC=1 is
set (as with transformers' flash-attn path) or torch.use_deterministic_algorithms is on. Needs
transformers >= 4.56 (AttentionInterface and AttentionMaskInterface); `pip install
cuflash-attn[transformers]`.
"""
from __future__ import annotations

import os

import torch

from ..bert_padding import pad_input, unpad_input
from ..interface import flash_attn_func, flash_attn_varlen_func

NAME = "cuflash"


def register(name: str = NAME) -> None:
    """Registers the attention function and its mask builder under `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _serve_flash_imports(name)


_NAMES: set[str] = set()


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


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, Lq, D), key and value (B, Hk, Lk, D),
    attention_mask None or a (B, Lk') bool padding mask (True = token); returns (out (B, Lq, H, D),
    None). Causal attention aligns to the bottom-right corner, so decoding with a KV cache works."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # flash layout views
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = (os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
                         or torch.are_deterministic_algorithms_enabled())
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal,
                   window_size=(sliding_window - 1, -1) if sliding_window else (-1, -1), softcap=softcap or 0.0,
                   deterministic=deterministic)
    cu_seqlens_q = kwargs.get("cu_seq_lens_q")
    if cu_seqlens_q is not None and attention_mask is None:
        # Padding-free training: sequences packed in one row, described by transformers' prefix sums.
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q.int(), kwargs["cu_seq_lens_k"].int(),
                                     int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), **options)
        return out[None], None
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
    global position ids), causal over the global positions. No padding mask (train on packed or
    full-length sequences)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from ..distributed import context_parallel_attn_func

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        if attention_mask is not None:
            raise ValueError(f"{name}: context parallelism takes no padding mask; pass full-length sequences")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        causal = bool(getattr(module, "is_causal", True))
        return context_parallel_attn_func(q, k, v, mesh, softmax_scale=scaling, causal=causal, layout=layout,
                                          mode=mode), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)
