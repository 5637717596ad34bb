"""Block masks (FlexAttention's BlockMask) in their two forms: per row of blocks, how many blocks it
sees and which (num, idx: kv_num_blocks and kv_indices, the listed ones first), and a dense table of
the state of every block (seen or not; SKIPPED, PARTIAL or FULL). create_block_mask builds the table
and lists it; the CPU path turns the lists back into a table to find each tile's state."""
from __future__ import annotations

import torch

from .mods import BlockSparsity

SKIPPED, PARTIAL, FULL = 0, 1, 2  # a block's keys: hidden; seen where mask_mod says; all seen


def dense(num: torch.Tensor, idx: torch.Tensor, ncols: int) -> torch.Tensor:
    """The bool table (..., rows, ncols) of the blocks that lists (num (..., rows), idx (..., rows, k))
    name: idx[..., r, :num[..., r]] (the entries after them are not read). Listed entries must be in
    [0, ncols)."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    table = torch.zeros(*idx.shape[:-1], ncols + 1, dtype=torch.bool, device=idx.device)
    # Entries past num land in the extra last column, then dropped.
    table.scatter_(-1, torch.where(listed, idx.long(), ncols), True)
    return table[..., :ncols]


def ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists of a bool table (..., rows, ncols), int32 as torch's: num (..., rows) and idx
    (..., rows, ncols), each row's listed blocks first in ascending order, then the others ascending."""
    num = table.sum(-1, dtype=torch.int32)
    idx = torch.argsort(table, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def transposed(num: torch.Tensor, idx: torch.Tensor, ncols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists per column block of lists per row block (the q_* lists of kv_* ones)."""
    return ordered(dense(num, idx, ncols).transpose(-1, -2))


def states(blocks: BlockSparsity, nrows: int, ncols: int) -> torch.Tensor:
    """The int8 table (batch, nheads, nrows, ncols) of the state of each (query block, key block) that
    blocks' kv lists give: FULL where the full lists name it, else PARTIAL where the partial ones do,
    else SKIPPED."""
    table = dense(blocks.kv_num[..., :nrows], blocks.kv_idx[..., :nrows, :], ncols).to(torch.int8)
    if blocks.full_kv_num is not None and blocks.full_kv_idx is not None:
        full = dense(blocks.full_kv_num[..., :nrows], blocks.full_kv_idx[..., :nrows, :], ncols)
        table = torch.where(full, FULL, table).to(torch.int8)
    return table


def classify(mask: torch.Tensor, q_block: int, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, full): bool tables (..., rows / q_block, cols / kv_block) (rounded up) of the blocks of
    the bool mask (..., rows, cols) in which some key is seen and in which every key is. A ragged last
    block (rows or cols not a multiple of the block) is never full: as torch's create_block_mask, the
    mask is padded with hidden keys."""
    rows, cols = mask.shape[-2:]
    pad_rows, pad_cols = -rows % q_block, -cols % kv_block
    if pad_rows or pad_cols:
        mask = torch.nn.functional.pad(mask, (0, pad_cols, 0, pad_rows))
    # (..., row blocks, q_block, key blocks, kv_block); reductions over outer dims run the fastest.
    blocks = mask.view(torch.uint8).unflatten(-1, (-1, kv_block)).unflatten(-3, (-1, q_block))
    return blocks.amax((-3, -1)).bool(), blocks.amin((-3, -1)).bool()
