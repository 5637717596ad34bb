"""cuflash: exact FlashAttention-2 for PyTorch, forward and backward, in Triton (GPU) and
blocked PyTorch (CPU)."""
from .cache import raise_decode_errors, set_decode_errors
from .errors import ErrorCode, FlashAttentionError
from .flex import create_block_mask, flex_attention
from .interface import (backward, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        forward, scaled_dot_product_attention)
from .kvcache import flash_attn_with_kvcache
from .rotary import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_
from . import bert_padding
from .integrations import sdpa as _sdpa

sdpa_provider_available = _sdpa.available
activate_sdpa_provider = _sdpa.activate
_sdpa.register()  # (torch's SDPA provider "cuflash", never activated on import: docs/api.md)

__version__ = "0.1.0"

__all__ = [
    "ErrorCode", "FlashAttentionError", "flash_attn_func", "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "raise_decode_errors", "set_decode_errors",
    "scaled_dot_product_attention", "forward", "backward", "apply_rotary_emb", "apply_rotary_emb_qkv_",
    "apply_rotary_emb_kv_", "RotaryEmbedding", "bert_padding", "flex_attention", "create_block_mask",
    "sdpa_provider_available", "activate_sdpa_provider", "__version__",
]
