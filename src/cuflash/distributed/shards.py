"""How a sequence is cut into shards across the ranks of a process group, shared by the ring and the
all-to-all attention.

Layouts of the shards along the sequence (world size W):
- "contiguous": rank r holds chunk r of W.
- "zigzag": the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r, so that
  under a causal mask every rank does the same work in the ring (zigzag_shard / zigzag_unshard).

A packed batch of documents (flash_attn_varlen_func's layout, prefix sums cu_seqlens) is cut along its
tokens:
- "contiguous": rank r holds the r-th of W equal shares of the packed tokens (documents cross the
  shares' edges);
- "zigzag": every document is cut into 2W equal chunks, and rank r holds chunk r of every document, in
  document order, then chunk 2W-1-r of every document (split_packed / join_packed): under a causal mask
  each rank does the same work on every document, as torch's per-document head-tail balancer and
  TransformerEngine's THD layout balance it (they keep each document's two chunks together; here the
  first and the second chunks of all documents are each contiguous, so that each part of a ring step
  is one varlen call). Each document's length must be a multiple of 2W.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ErrorCode, fail
from ..memo import remember

LAYOUTS = ("contiguous", "zigzag")
# The calls check_shards has checked, by what its check reads (the group, the local q and k shapes,
# the options): its all-gather, and the host read of the gathered shapes, run once per entry instead
# of in every layer (a sync, which a CUDA graph cannot hold either). The oldest entries go first.
CHECKED_SHARDS: dict[tuple, bool] = {}
MAX_CHECKED_SHARDS = 256


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of the full tensor x: chunks rank and 2*world_size-1-rank of
    x cut into 2*world_size equal chunks along dim (the sequence dim, 1 in flash-attn's layout)."""
    if x.shape[dim] % (2 * world_size) != 0:
        fail(ErrorCode.SHAPE_MISMATCH, f"zigzag needs the sequence length ({x.shape[dim]} in dim {dim}) to be a "
             f"multiple of 2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of zigzag_shard: gathers every rank's shard and returns the full tensor (on every rank)."""
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return join_sequence(shards, "zigzag", dim)


def split_sequence(x: torch.Tensor, world_size: int, layout: str, dim: int = 1) -> list[torch.Tensor]:
    """The shards of every rank, in rank order, of the whole sequence x (along dim)."""
    if layout == "contiguous":
        return list(x.chunk(world_size, dim=dim))
    return [zigzag_shard(x, r, world_size, dim) for r in range(world_size)]


def join_sequence(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard, in rank order (split_sequence's inverse)."""
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def check_packed_zigzag(bounds: list[int], world_size: int) -> list[int]:
    """The chunk length of each document of a packed batch (prefix sums `bounds`) cut into
    2 * world_size chunks; raises where a document's length is not a multiple of 2 * world_size."""
    parts = 2 * world_size
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    for i, n in enumerate(lengths):
        if n % parts:
            fail(ErrorCode.SHAPE_MISMATCH, f"the packed zigzag layout cuts every document into 2 * world_size = "
                 f"{parts} chunks: document {i} of cu_seqlens has {n} tokens; pad each document to a multiple of "
                 f"{parts}, or take layout='contiguous'")
    return [n // parts for n in lengths]


def _packed_rows(bounds: list[int], rank: int, world_size: int) -> list[tuple[int, int]]:
    """The (start, end) token ranges of rank's packed zigzag shard, in its order."""
    chunks = check_packed_zigzag(bounds, world_size)
    return [(a + i * c, a + (i + 1) * c) for i in (rank, 2 * world_size - 1 - rank) for a, c in zip(bounds, chunks)]


def split_packed(x: torch.Tensor, cu_seqlens, world_size: int, layout: str, dim: int = 0) -> list[torch.Tensor]:
    """Every rank's shard, in rank order, of a packed batch x (its tokens along dim; cu_seqlens the
    prefix sums of its documents, a tensor or a list) in `layout` (the module's doc)."""
    if layout == "contiguous":
        return list(x.chunk(world_size, dim=dim))
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return [torch.cat([x.narrow(dim, a, b - a) for a, b in _packed_rows(bounds, r, world_size)], dim=dim)
            for r in range(world_size)]


def join_packed(shards: list[torch.Tensor], cu_seqlens, layout: str, dim: int = 0) -> torch.Tensor:
    """The whole packed batch from every rank's shard, in rank order (split_packed's inverse)."""
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    pieces: list[tuple[tuple[int, int], torch.Tensor]] = []
    for r, shard in enumerate(shards):
        rows = _packed_rows(bounds, r, len(shards))
        pieces += zip(rows, shard.split([b - a for a, b in rows], dim=dim))
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim=dim)


def require_process_group(name: str, layout: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} needs an initialized torch.distributed process group "
             "(torch.distributed.init_process_group)")
    if layout not in LAYOUTS:
        fail(ErrorCode.INVALID_ARGUMENT, f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")


def check_shards(q, k, group, layout: str, same_positions: bool = True) -> None:
    """Every rank must hold shards of the same shape; all ranks see the same gathered shapes and
    so raise together, instead of one rank raising and the others hanging in a collective.
    same_positions: q and k shards cover the same positions (not for a packed batch whose key count
    differs from its query count).

    Checked once per (group, shapes, options) (CHECKED_SHARDS): ranks that have passed the same
    checks, in the same order, skip the gather together. A rank whose shapes change while the
    others repeat checked ones gathers alone, and waits for them until the group's timeout."""
    size = dist.get_world_size(group)
    key = (group, size, tuple(q.shape), tuple(k.shape), layout, same_positions)
    if key in CHECKED_SHARDS:
        return
    mine = torch.tensor(list(q.shape) + list(k.shape), dtype=torch.int64,
                        device=q.device if dist.get_backend(group) == "nccl" else "cpu")
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    shapes = [tuple(s.tolist()) for s in gathered]
    if len(set(shapes)) != 1:
        listing = ", ".join(f"rank {r}: q {s[:4]}, k {s[4:]}" for r, s in enumerate(shapes))
        fail(ErrorCode.SHAPE_MISMATCH,
             f"context parallelism needs shards of the same shape on every rank; got {listing}")
    if same_positions and q.shape[1] != k.shape[1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"q and k shards must cover the same positions (seqlen {q.shape[1]} vs "
             f"{k.shape[1]})")
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        fail(ErrorCode.SHAPE_MISMATCH, f"a zigzag shard holds two equal chunks; its seqlen {q.shape[1]} is odd")
    remember(CHECKED_SHARDS, key, True, MAX_CHECKED_SHARDS)
