"""Attention across processes (context parallelism) on top of torch.distributed: the ring (K/V shards
passed around) and the all-to-all (heads exchanged for sequence)."""
from .ring import ring_flash_attn_func
from .shards import zigzag_shard, zigzag_unshard
from .ulysses import ulysses_flash_attn_func

__all__ = ["ring_flash_attn_func", "ulysses_flash_attn_func", "zigzag_shard", "zigzag_unshard"]
