"""Dropout's keep mask with torch ops: the same bits as the kernels' counter-based hash
(kernels/triton/common.py: dropout_key, dropout_keep), so that the CPU path, the Triton kernels and
`return_attn_probs` agree on which probabilities a seed drops."""
from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF


def draw_seed(device: torch.device) -> torch.Tensor:
    """Two int64 words in [0, 2^31) from torch's generator for `device`: torch.manual_seed
    reproduces a run."""
    return torch.randint(0, 2**31, (2,), dtype=torch.int64, device=device)


def head_ids(first_batch: int, batch: int, nheads: int, device) -> torch.Tensor:
    """(batch, nheads) tensor of batch_index * nheads + head, batches counted from first_batch: the
    dropout stream of each head (varlen sequences count as batches)."""
    return (torch.arange(first_batch, first_batch + batch, device=device)[:, None] * nheads
            + torch.arange(nheads, device=device))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for x < 2^32 in int64 without overflow: split c into 16-bit halves.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _U32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x735A2D97)
    return x ^ (x >> 15)


def keep_mask(rng_seed, off_bh: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              dropout_p: float) -> torch.Tensor:
    """True where the probability of (batch * nheads + head = off_bh, query row, key col) is kept.
    rng_seed: the two seed words (a tensor or a pair of ints); the index tensors broadcast; rows
    and cols count from the start of their sequence."""
    seed0, seed1 = (int(s) for s in (rng_seed.tolist() if torch.is_tensor(rng_seed) else rng_seed))
    key = _mix32(seed0 ^ _mix32((seed1 + off_bh.to(torch.int64)) & _U32))
    u = _mix32(_mix32(key ^ rows.to(torch.int64)) ^ cols.to(torch.int64))
    return (u >> 1) >= int(dropout_p * 2**31)
