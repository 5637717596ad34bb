"""FlexAttention's API (torch.nn.attention.flex_attention) on cuflash's attention: flex_attention with
a score_mod and a block mask, eagerly (no torch.compile needed) or under torch.compile, with a
backward on the CPU too, and create_block_mask, which builds torch's own BlockMask without
torch.compile.

The mods a Flex user writes are traced into graphs of elementwise operations (cuflash.mods) and
travel in AttentionParams.mods: the CPU path computes them with torch ops tile by tile, the Triton
kernels compile them (cuflash.kernels.triton.mods)."""
from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import BlockMask

from . import ops
from .backend import backend_name
from .blocks import classify, ordered, transposed
from .errors import ErrorCode, fail
from .mods import BlockSparsity, Mod, Mods, packed
from .mods.compiled import EAGER_REASON, graph_mod, runs_eagerly
from .mods.evaluate import evaluate
from .mods.trace import INDEX_DTYPE
from .params import AttentionParams
from .validate import check_attention_inputs, check_bool, check_tensor, resolve_scale, strided_head_dim

MASK_CHUNK = 1 << 22  # mask elements create_block_mask computes at a time (whole blocks, at least one)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention.flex_attention, eager or compiled (docs/programmable.md), with a
    backward on every backend.

    Args:
        query: (B, Hq, L, E); key: (B, Hkv, S, E); value: (B, Hkv, S, Ev), any strides, fp16/bf16/fp32
            (fp64 on the CPU path). Ev may differ from E (as in torch).
        score_mod: None or score_mod(score, b, h, q_idx, kv_idx) -> score, written in torch ops for one
            score (0-dim tensors): score = scale * q.k in fp32, b the batch index, h the query head,
            q_idx and kv_idx positions (int32). Its captured tensors are read at every call; the
            gradients of those that require grad are computed (a learnable bias).
        block_mask: None or a BlockMask (torch's create_block_mask or cuflash.create_block_mask)
            made for (L, S), its batch and head dims 1 or B and Hq: its mask_mod hides the keys it
            returns False for in the blocks it lists as partial; blocks it lists as full are seen
            whole; the others are skipped.
        scale: default 1/sqrt(E).
        enable_gqa: Hq a multiple of Hkv (without it Hq must equal Hkv, as torch).
        return_lse: also return the log-sum-exp of the scores (natural log), (B, Hq, L) fp32 (fp64
            for fp64 inputs); torch deprecates it for return_aux.
        kernel_options: None (or an empty dict): cuflash tunes its kernels itself and takes none of
            torch's Triton options.
        return_aux: None or AuxRequest(lse=...) (torch's, where it has one): then (out, AuxOutput).
    Returns:
        out (B, Hq, L, Ev); with return_lse (out, lse); with return_aux (out, AuxOutput(lse, None)).
        Rows that see no key give 0, and -inf as lse, as torch.
    """
    if torch.compiler.is_compiling() and runs_eagerly(score_mod, getattr(block_mask, "mask_mod", None)):
        return _flex_attention_eagerly(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                       kernel_options, return_aux=return_aux)
    enable_gqa, return_lse = check_bool("enable_gqa", enable_gqa), check_bool("return_lse", return_lse)
    with_lse = _lse_asked(return_lse, return_aux)
    _check_kernel_options(kernel_options)
    q, k, v = _flash_layout(query, key, value, enable_gqa)
    mods = None
    if score_mod is not None or block_mask is not None:
        mods = _mods(score_mod, block_mask, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
        mods.check(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    params = AttentionParams(resolve_scale(scale, q.shape[-1], "scale"), bottom_right=False,
                             deterministic=torch.are_deterministic_algorithms_enabled(), mods=mods)
    out, lse = ops.forward(q, k, v, params)
    out = out.transpose(1, 2)
    if with_lse:
        lse = torch.where(lse == math.inf, -math.inf, lse)  # rows that see no key (ours say +inf)
    if return_aux is not None:
        return out, torch_flex.AuxOutput(lse=lse if with_lse else None)
    return (out, lse) if return_lse else out


# Under torch.compile, a call whose mods cannot enter the graph (mods/compiled.py) runs eagerly: a graph break.
_flex_attention_eagerly = torch.compiler.disable(flex_attention, reason=EAGER_REASON)


def _lse_asked(return_lse: bool, return_aux) -> bool:
    """Whether the lse is returned: return_lse, or return_aux's lse (an AuxRequest, as torch)."""
    if return_aux is None:
        return return_lse
    request = getattr(torch_flex, "AuxRequest", None)
    if request is None or not isinstance(return_aux, request):
        fail(ErrorCode.INVALID_ARGUMENT, "return_aux must be None or a torch.nn.attention.flex_attention.AuxRequest"
             f"{'' if request else ' (this torch has none)'}, got {return_aux!r}")
    if return_lse:
        fail(ErrorCode.INVALID_ARGUMENT, "pass either return_lse=True or return_aux, not both (as torch)")
    if return_aux.max_scores:
        fail(ErrorCode.UNSUPPORTED_FEATURE, "return_aux=AuxRequest(max_scores=True): the row maxima are not "
             "returned; AuxRequest(lse=True) is")
    return bool(return_aux.lse)


def _check_kernel_options(kernel_options) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, Mapping):
        fail(ErrorCode.INVALID_ARGUMENT, f"kernel_options must be None or a dict, got {type(kernel_options).__name__}")
    if kernel_options:
        torch_keys = list(getattr(getattr(torch_flex, "FlexKernelOptions", None), "__annotations__", {}))
        fail(ErrorCode.UNSUPPORTED_FEATURE, f"kernel_options {sorted(map(str, kernel_options))}: cuflash tunes its "
             "tiles, warps and stages itself, per device, and takes none of the options of torch's Triton "
             f"kernels ({', '.join(torch_keys) or 'BLOCK_M, BLOCK_N, num_warps, num_stages, ...'}, also with a "
             "fwd_ or bwd_ prefix); pass kernel_options=None")


def _flash_layout(query, key, value, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value checked, as (B, N, H, E) views (a strided head dim copied once)."""
    names = ("query", "key", "value")
    tensors = [t.contiguous() if strided_head_dim(t) else t for t in (query, key, value)]
    for name, t in zip(names, tensors):
        check_tensor(name, t, 4, "(batch, nheads, seqlen, headdim)", empty=True)
    query, key, value = tensors
    if not enable_gqa and query.shape[1] != key.shape[1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"query has {query.shape[1]} heads and key {key.shape[1]}; pass "
             "enable_gqa=True for grouped-query attention (query's heads a multiple of key's)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    check_attention_inputs(q, k, v, names, empty=True)
    backend_name(q.device, q.dtype)  # raises where no backend runs
    return q, k, v


def _mods(score_mod, block_mask, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
          device: torch.device) -> Mods:
    """The call's Mods: the traced score_mod, and the block mask's mask_mod and tile lists; under
    torch.compile, packed (mods/compiled.py)."""
    if block_mask is not None:
        _check_block_mask(block_mask, seqlen_q, seqlen_k, device)
    if torch.compiler.is_compiling():
        return Mods(packed=packed(None if score_mod is None else graph_mod(score_mod, "score", device),
                                  None if block_mask is None else graph_mod(block_mask.mask_mod, "mask", device),
                                  None if block_mask is None else block_sparsity(block_mask, batch, nheads)))
    score = None if score_mod is None else traced_mod(score_mod, "score", device)
    if block_mask is None:
        return Mods(score=score)
    mask = traced_mod(block_mask.mask_mod, "mask", device)
    return Mods(score=score, mask=mask, blocks=block_sparsity(block_mask, batch, nheads))


def _check_block_mask(block_mask, seqlen_q: int, seqlen_k: int, device: torch.device) -> None:
    """block_mask is a BlockMask made for these lengths, on this device."""
    if not isinstance(block_mask, BlockMask):
        fail(ErrorCode.INVALID_ARGUMENT, "block_mask must be None or a torch.nn.attention.flex_attention.BlockMask "
             f"(create_block_mask's), got {type(block_mask).__name__}")
    if tuple(block_mask.seq_lengths) != (seqlen_q, seqlen_k):
        fail(ErrorCode.SHAPE_MISMATCH, f"block_mask was made for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)} "
             f"but query has {seqlen_q} positions and key {seqlen_k}: make one for ({seqlen_q}, {seqlen_k})")
    if block_mask.kv_num_blocks.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"block_mask is on {block_mask.kv_num_blocks.device} but query is on "
             f"{device}")


def traced_mod(fn, kind: str, device: torch.device) -> Mod:
    """Mod fn (kind "score" or "mask") traced, with what it captures now, every captured tensor on
    `device` (the attention's)."""
    mod = Mod.of(fn, kind)
    for t in mod.tensors:
        if t.device != device:
            fail(ErrorCode.DEVICE_MISMATCH, f"{mod.graph.kind}_mod {mod.graph.name!r} captures a tensor on "
                 f"{t.device} but the attention runs on {device}")
    return mod


# A BlockMask's checked lists, made once per (batch, nheads) and the versions of its tensors (an
# in-place change to one makes them anew): checking them waits for the GPU, and converting them
# launches a dozen small kernels, each call (1-1.5 ms a call on an H100, more than the attention).
_SPARSITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_sparsity(block_mask: BlockMask, batch: int, nheads: int) -> BlockSparsity:
    """The tile lists of block_mask (made for its seq_lengths), checked, int32, broadcast to
    (batch, nheads, ...); the q_* lists computed from the kv_* ones where it has none. Kept with the
    BlockMask while its tensors are unchanged (eagerly: under torch.compile they are made in the graph,
    their values unchecked)."""
    if torch.compiler.is_compiling():
        return _block_sparsity(block_mask, batch, nheads)
    tensors = [t for t in block_mask.as_tuple() if isinstance(t, torch.Tensor)]
    key = (batch, nheads, tuple(t._version for t in tensors), tuple(id(t) for t in tensors))
    kept = _SPARSITIES.get(block_mask)
    if kept is not None and kept[0] == key:
        return kept[1]
    sparsity = _block_sparsity(block_mask, batch, nheads)
    _SPARSITIES[block_mask] = (key, sparsity)
    return sparsity


def _block_sparsity(block_mask: BlockMask, batch: int, nheads: int) -> BlockSparsity:
    q_block, kv_block = _block_size(block_mask.BLOCK_SIZE, "block_mask.BLOCK_SIZE")
    nrows, ncols = (-(-n // b) for n, b in zip(block_mask.seq_lengths, (q_block, kv_block)))
    kv = _lists("kv", block_mask.kv_num_blocks, block_mask.kv_indices, nrows, ncols, batch, nheads)
    full_kv = _lists("full_kv", block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nrows, ncols,
                     batch, nheads)
    q = _lists("q", block_mask.q_num_blocks, block_mask.q_indices, ncols, nrows, batch, nheads)
    full_q = _lists("full_q", block_mask.full_q_num_blocks, block_mask.full_q_indices, ncols, nrows, batch, nheads)
    assert kv is not None
    if q is None:
        q = transposed(*kv, ncols)
    if full_q is None and full_kv is not None:
        full_q = transposed(*full_kv, ncols)

    def grown(lists):
        if lists is None:
            return None, None
        num, idx = _aligned(*lists)
        return num.expand(batch, nheads, -1), idx.expand(batch, nheads, -1, -1)

    return BlockSparsity(q_block, kv_block, *grown(kv), *grown(full_kv), *grown(q), *grown(full_q))


def _aligned(num: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a list's counts and indices whose strides are multiples of 16 (rows and lists
    padded): Triton compiles a kernel for each class of an int argument (1, a multiple of 16, other),
    so strides that follow the number of blocks would compile the kernels again for lengths that
    differ only by a block."""
    rows, cols = idx.shape[-2], idx.shape[-1]
    padded_rows, padded_cols = -(-rows // 16) * 16, -(-cols // 16) * 16
    num_copy = num.new_zeros(*num.shape[:-1], padded_rows)[..., :rows]
    idx_copy = idx.new_zeros(*idx.shape[:-2], padded_rows, padded_cols)[..., :rows, :cols]
    num_copy.copy_(num)
    idx_copy.copy_(idx)
    return num_copy, idx_copy


def _lists(name: str, num, idx, nrows: int, ncols: int, batch: int,
           nheads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A BlockMask's lists `name` (block_mask.{name}_num_blocks and {name}_indices), checked and cut
    to nrows rows, int32, with leading dims of size 1 added up to (batch or 1, nheads or 1); None if
    absent."""
    if num is None or idx is None:
        return None
    what = f"block_mask.{name}_num_blocks and block_mask.{name}_indices"
    if num.dim() < 1 or num.dim() > 3 or idx.dim() != num.dim() + 1 or idx.shape[:-1] != num.shape:
        fail(ErrorCode.SHAPE_MISMATCH, f"{what} have shapes {tuple(num.shape)} and {tuple(idx.shape)}; expected "
             "(B, H, rows) and (B, H, rows, blocks)")
    num, idx = num.reshape((1,) * (3 - num.dim()) + num.shape), idx.reshape((1,) * (4 - idx.dim()) + idx.shape)
    if num.shape[0] not in (1, batch) or num.shape[1] not in (1, nheads) or num.shape[2] < nrows:
        fail(ErrorCode.SHAPE_MISMATCH, f"{what} have shapes {tuple(num.shape)} and {tuple(idx.shape)}; expected "
             f"(B, H, rows) with B 1 or {batch}, H 1 or {nheads} (the query's heads) and at least {nrows} rows")
    num, idx = num[..., :nrows].to(torch.int32), idx[..., :nrows, :].to(torch.int32)
    if torch.compiler.is_compiling():  # (the values need a host read; a compiled graph trusts them)
        return num, idx
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    if bool(((num < 0) | (num > idx.shape[-1])).any()) or bool((listed & ((idx < 0) | (idx >= ncols))).any()):
        fail(ErrorCode.INVALID_ARGUMENT, f"{what} list blocks outside the {ncols} blocks of each row (or counts "
             f"outside [0, {idx.shape[-1]}])")
    return num, idx


def _block_size(block_size, name: str) -> tuple[int, int]:
    """BLOCK_SIZE, an int or a pair (query block, key block) of ints >= 1, as a pair."""
    pair = (block_size, block_size) if not isinstance(block_size, (tuple, list)) else tuple(block_size)
    if len(pair) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in pair):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be an int >= 1 or a pair of them (query block, key block), "
             f"got {block_size!r}")
    return pair[0], pair[1]


def _size(name: str, value) -> int:
    """create_block_mask's B, H (None: 1), Q_LEN or KV_LEN: an int >= 1."""
    if value is None and name in ("B", "H"):
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be an int >= 1{' or None (1)' if name in ('B', 'H') else ''}, "
             f"got {value!r}")
    return value


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True) -> BlockMask:
    """torch.nn.attention.flex_attention.create_block_mask, without torch.compile: torch's BlockMask of
    mask_mod for B batches (None: 1, for all), H heads (None: 1), Q_LEN queries and KV_LEN keys, with
    the same tile lists as torch's. mask_mod is traced (cuflash.mods) and computed on whole query
    blocks at a time, MASK_CHUNK elements or so, so memory stays bounded however long the sequences.
    device: default CUDA where there is a GPU, else the CPU (torch's current accelerator); _compile:
    accepted for torch's signature (the result is the same). A block is full where mask_mod sees every
    key of it (a ragged last block never is, as torch), partial where it sees some (with
    separate_full_blocks=False: also where it sees all)."""
    if torch.compiler.is_compiling():  # (it traces mask_mod and reads the mask: eagerly, a graph break)
        return _create_block_mask_eagerly(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                          separate_full_blocks)
    batch, nheads = _size("B", B), _size("H", H)
    seqlen_q, seqlen_k = _size("Q_LEN", Q_LEN), _size("KV_LEN", KV_LEN)
    q_block, kv_block = _block_size(BLOCK_SIZE, "BLOCK_SIZE")
    check_bool("_compile", _compile)
    separate = check_bool("separate_full_blocks", separate_full_blocks)
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:  # ("cuda": the current GPU, where its tensors are made)
        device = torch.device("cuda", torch.cuda.current_device())
    mod = traced_mod(mask_mod, "mask", device)
    seen, full = _block_tables(mod, batch, nheads, seqlen_q, seqlen_k, (q_block, kv_block), device)
    kv_num, kv_idx = ordered((seen & ~full if separate else seen).expand(batch, nheads, -1, -1))
    full_num, full_idx = ordered(full.expand(batch, nheads, -1, -1)) if separate else (None, None)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, kv_block),
                                    mask_mod=mask_mod, seq_lengths=(seqlen_q, seqlen_k))


_create_block_mask_eagerly = torch.compiler.disable(
    create_block_mask, reason="cuflash.create_block_mask runs eagerly (it traces mask_mod and reads the mask's "
    "values): make the block mask outside the compiled function")


def _block_tables(mod: Mod, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, block: tuple[int, int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks.classify's (seen, full) tables of mask_mod `mod`, (batch or 1, nheads or 1, query blocks,
    key blocks): 1 where it reads no b (h), whose value then does not matter. Computed on spans of
    whole blocks of about MASK_CHUNK elements (at least one block)."""
    graph = mod.graph
    b = torch.arange(batch if graph.uses("b") else 1, dtype=INDEX_DTYPE, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nheads if graph.uses("h") else 1, dtype=INDEX_DTYPE, device=device).view(1, -1, 1, 1)
    q_block, kv_block = block
    cols = min(-(-seqlen_k // kv_block), max(1, MASK_CHUNK // (b.numel() * h.numel() * q_block * kv_block)))
    rows = max(1, MASK_CHUNK // (b.numel() * h.numel() * q_block * cols * kv_block))
    shape = (b.numel(), h.numel(), -(-seqlen_q // q_block), -(-seqlen_k // kv_block))
    seen = torch.empty(shape, dtype=torch.bool, device=device)
    full = torch.empty_like(seen)
    for i in range(0, shape[2], rows):
        q_idx = torch.arange(i * q_block, min((i + rows) * q_block, seqlen_q), dtype=INDEX_DTYPE, device=device)
        for j in range(0, shape[3], cols):
            kv_idx = torch.arange(j * kv_block, min((j + cols) * kv_block, seqlen_k), dtype=INDEX_DTYPE,
                                  device=device)
            mask = evaluate(graph, (b, h, q_idx[:, None], kv_idx[None, :]), list(mod.tensors), list(mod.scalars))
            seen[:, :, i:i + rows, j:j + cols], full[:, :, i:i + rows, j:j + cols] = classify(mask, q_block, kv_block)
    return seen, full
