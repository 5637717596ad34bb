"""Attention across processes (context parallelism) on top of torch.distributed."""
from .ring import ring_flash_attn_func, zigzag_shard, zigzag_unshard

__all__ = ["ring_flash_attn_func", "zigzag_shard", "zigzag_unshard"]
