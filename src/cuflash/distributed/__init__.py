"""Attention across processes (context parallelism) on top of torch.distributed: the ring (K/V shards
passed around), the all-to-all (heads exchanged for sequence), their hybrid, and the three over a
DeviceMesh."""
from .mesh import context_parallel_attn_func, context_parallel_attn_varlen_func, context_parallel_shard
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func
from .shards import zigzag_shard, zigzag_unshard
from .ulysses import hybrid_flash_attn_func, hybrid_shard, ulysses_flash_attn_func, ulysses_flash_attn_varlen_func

__all__ = ["context_parallel_attn_func", "context_parallel_attn_varlen_func", "context_parallel_shard",
           "hybrid_flash_attn_func", "hybrid_shard", "ring_flash_attn_func", "ring_flash_attn_varlen_func",
           "ulysses_flash_attn_func", "ulysses_flash_attn_varlen_func", "zigzag_shard", "zigzag_unshard"]
