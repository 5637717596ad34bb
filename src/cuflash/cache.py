"""A KV cache's index values: where a position lies in a cache (cache_slot, append_to_cache), what
values a decode step may read (IndexKind, index_violation), and how the bad ones the decode kernel
finds on the GPU reach the user.

On the GPU the decode kernel checks the index tensors (cache_seqlens, cache_leftpad,
cache_batch_idx, block_table) itself, before it reads or writes through them, and leaves a bad value
in a record of pinned host memory. Who raises it depends on the mode (set_decode_errors):

- "raise" (the default): the step waits for the GPU once, after its launch, reads its record and
  raises: the call that received the bad value raises it. That wait is the one host read flash-attn
  pays on its paged path (`max(cache_seqlens)` read before its launch); here every step with an index
  tensor on the GPU pays it, and it covers every value the kernel checks.
- "defer": the step does not wait. Its record is raised by the next deferred step on the device or
  by raise_decode_errors(), naming the step it came from: for eager loops that must not wait for the
  GPU, at the price of learning of a bad value one step late.

A step captured in a CUDA graph (no host read is possible there) always defers: a serving loop that
replays graphs calls raise_decode_errors() itself, e.g. after it reads a step's outputs. A call with
valid inputs never raises another step's error: the steps that raise have records of their own
(one per thread and device) that only they write.
"""
from __future__ import annotations

import ctypes
import enum
import threading

import torch

from .errors import ErrorCode, fail
from .params import per_sequence


class IndexKind(enum.IntEnum):
    """What a decode step's index value breaks, in the order the checks report them (the first
    kind found is the error): index_violation and the decode kernel (kernels/triton/decode.py) name
    them alike."""

    SEQLENS = 0  # cache_seqlens < 0, or the new tokens past the cache's end
    LEFTPAD = 1  # cache_leftpad < 0 or past cache_seqlens
    ROWS = 2  # cache_batch_idx outside the cache's rows
    REPEATED = 3  # cache_batch_idx gives two sequences one row, and new tokens are written
    ROTARY = 4  # cache_seqlens past what rotary_cos covers
    PAGES = 5  # a block_table entry before the sequence's end outside the cache's blocks


def index_error(kind: IndexKind, seq: int | None, value: int, bound: int) -> str:
    """The message of a bad index value: `value` of sequence `seq` (None: an int for all), against
    `bound` (the largest value accepted, or the count the value must stay below)."""
    at = "" if seq is None else f"[{seq}]"
    return {
        IndexKind.SEQLENS: f"cache_seqlens{at} = {value}: it and the new tokens must fit the sequence's cache row "
                           f"or the pages its block_table row lists (cache_seqlens in [0, {bound}])",
        IndexKind.LEFTPAD: f"cache_leftpad{at} = {value} must lie in [0, cache_seqlens{at}]",
        IndexKind.ROWS: f"cache_batch_idx{at} = {value} must be one of the {bound} cache rows",
        IndexKind.REPEATED: f"cache_batch_idx{at} = {value} is another sequence's row too: the rows new tokens "
                            f"are written into must be distinct",
        IndexKind.ROTARY: f"cache_seqlens{at} = {value} reaches past rotary_cos, rotary_sin (cache_seqlens up to "
                          f"{bound} fit their rows)",
        IndexKind.PAGES: f"block_table{at} lists page {value}, outside the {bound} cache blocks",
    }[kind]


def cache_slot(seq: torch.Tensor, positions: torch.Tensor, rows_per_seq: int, table: torch.Tensor | None,
               rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where position `positions` of sequence `seq` lies in a cache (broadcasting long tensors), as
    (index in the cache's first dim, index in its second): through the page table (page, slot in the
    page), or in the sequence's cache row (cache_batch_idx, default its batch index)."""
    if table is not None:
        return table[seq, positions // rows_per_seq].long(), positions % rows_per_seq
    return (seq if rows is None else rows[seq].long()).expand_as(positions), positions


def append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_rows, block_table) -> None:
    """Writes k_new, v_new (B, seqlen_new, Hk, D) into the cache in place at positions cache_seqlens[b] ..
    of each sequence (addressed as decode_forward reads them), as torch ops: the CPU backend's append,
    and the one a traced graph (torch.compile) holds before the decode op."""
    batch, seqlen_new = k_new.shape[:2]
    positions = per_sequence(cache_seqlens, batch, k_new.device)[:, None] + torch.arange(seqlen_new,
                                                                                         device=k_new.device)
    where = cache_slot(torch.arange(batch, device=k_new.device)[:, None], positions, k_cache.shape[1], block_table,
                       cache_rows)
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        cache[where] = new  # any strides: the index pairs address the cache's first two dims


def index_violation(cache_seqlens, seqlen_new: int, leftpad, rows, cache_rows: int, table, rows_per_seq: int,
                    repeats: bool, rotary_end: int | None) -> tuple[IndexKind, int, int, int] | None:
    """The first bad index value of a decode step (IndexKind order, then the first sequence) as
    (kind, sequence, value, bound) for index_error, or None: cache_seqlens (a tensor or an int; with
    seqlen_new new tokens in the cache's capacity), cache_leftpad, cache_batch_idx `rows` of
    cache_rows (repeats: distinct too), the block_table entries before each sequence's end, and
    rotary_end (None: no rotary) the largest cache_seqlens the rotary tables cover. Torch ops on the
    tensors' device (at least one index is a tensor), whose values it reads: the host's check where
    the values are on the CPU."""
    given = next(t for t in (cache_seqlens, leftpad, rows, table) if isinstance(t, torch.Tensor))
    batch, device = given.shape[0], given.device
    seqlens = per_sequence(cache_seqlens, batch, device)
    capacity = rows_per_seq * (1 if table is None else table.shape[1])
    checks = [(IndexKind.SEQLENS, (seqlens < 0) | (seqlens > capacity - seqlen_new), seqlens, capacity - seqlen_new)]
    if leftpad is not None:
        checks.append((IndexKind.LEFTPAD, (leftpad < 0) | (leftpad > seqlens), leftpad, 0))
    if rows is not None:
        checks.append((IndexKind.ROWS, (rows < 0) | (rows >= cache_rows), rows, cache_rows))
        if repeats:
            checks.append((IndexKind.REPEATED, (rows[:, None] == rows[None, :]).sum(1) > 1, rows, 0))
    if rotary_end is not None:
        checks.append((IndexKind.ROTARY, seqlens > rotary_end, seqlens, rotary_end))
    if table is not None:  # the pages before each sequence's end (the others may hold anything)
        positions = torch.arange(0, table.shape[1] * rows_per_seq, rows_per_seq, device=device)
        outside = (positions < (seqlens + seqlen_new)[:, None]) & ((table < 0) | (table >= cache_rows))
        first_outside = table.gather(1, outside.int().argmax(1, keepdim=True))[:, 0]
        checks.append((IndexKind.PAGES, outside.any(1), first_outside, cache_rows))
    for kind, bad, values, bound in checks:
        if bool(bad.any()):
            seq = int(bad.int().argmax())
            return kind, seq, int(values[seq]), bound
    return None


DECODE_ERROR_MODES = ("raise", "defer")
_mode = "raise"
# Steps are numbered per process so that a deferred record can name the one it came from.
_last_step = 0
_captured: set[int] = set()  # the steps launched inside a CUDA-graph capture
RECORD_WORDS = 3  # per IndexKind: (sequence + 1) << 32 | (value as int32), the bound, the step


def set_decode_errors(mode: str) -> str:
    """How flash_attn_with_kvcache on the GPU reports a bad index value (see the module's doc):
    "raise" (the default: the call raises, after one wait for the GPU) or "defer" (no wait: the next
    deferred step on the device or raise_decode_errors() raises it). Process-wide; returns the
    previous mode, so that `previous = set_decode_errors("defer")` ... `set_decode_errors(previous)`
    restores it."""
    global _mode
    if mode not in DECODE_ERROR_MODES:
        fail(ErrorCode.INVALID_ARGUMENT, f"mode must be one of {', '.join(map(repr, DECODE_ERROR_MODES))}, "
             f"got {mode!r}")
    previous, _mode = _mode, mode
    return previous


class _Record:
    """Where the decode kernels of one device leave bad index values: RECORD_WORDS int64 per
    IndexKind. On the GPU pinned host memory, which the kernel writes over the bus and the host reads
    through a ctypes view without waiting for the GPU."""
    __slots__ = ("tensor", "words", "device", "deferred")

    def __init__(self, device: torch.device, deferred: bool):
        self.device, self.deferred = device, deferred
        self.tensor = torch.zeros(RECORD_WORDS * len(IndexKind), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.words = (ctypes.c_int64 * self.tensor.numel()).from_address(self.tensor.data_ptr())

    def raise_found(self) -> None:
        """Raises the first kind's bad value found since the last look, clearing the record."""
        words = self.words
        if not any(words):
            return
        kind = next(k for k in IndexKind if words[RECORD_WORDS * k])
        packed, bound, step = words[RECORD_WORDS * kind: RECORD_WORDS * (kind + 1)]
        value = packed & 0xFFFFFFFF
        value -= value >> 31 << 32  # (int32)
        ctypes.memset(words, 0, ctypes.sizeof(words))
        where = f"decode step {step} on {self.device}" + (" (replayed from a CUDA graph)" if step in _captured else "")
        # (a step that raises its own errors returns no output; a deferred one returned the sequence's as NaN)
        outputs = "that sequence's output and softmax_lse are NaN, and " if self.deferred else ""
        fail(ErrorCode.INVALID_ARGUMENT,
             f"{where} read a bad index value; {outputs}nothing was read or written through the value: "
             f"{index_error(kind, (packed >> 32) - 1, value, bound)}")


# The deferred steps' records, per device; and per thread, per device, the records of the steps that
# raise their own errors (a thread's go with it).
_deferred: dict[torch.device, _Record] = {}
_per_thread = threading.local()


def _record(records: dict, device: torch.device) -> _Record:
    found = records.get(device)
    if found is None:
        found = records[device] = _Record(device, records is _deferred)
    return found


class DecodeStep:
    """One decode step's part in the reporting: the record its kernel writes (`record`, the tensor)
    and its number (`step`), taken before the launch; `done()` after it raises what the step found
    where the step raises its own errors. indexed: the step passes the kernel an index tensor (else
    the kernel has no value to check, and the step never waits)."""
    __slots__ = ("record", "step", "_raised_from")

    def __init__(self, device: torch.device, indexed: bool, launch_blocking: bool = False):
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        global _last_step
        self.step = _last_step = _last_step % (2**31 - 1) + 1  # (an int32 kernel argument)
        if capturing:
            _captured.add(self.step)
        deferred = _mode == "defer" or capturing
        own = None if deferred or not indexed else _record(_per_thread.__dict__, device)
        shared = _record(_deferred, device)
        if deferred and not capturing:  # the next deferred step raises what earlier ones found
            shared.raise_found()
        # Under CUDA_LAUNCH_BLOCKING=1 the launch returns with the kernel done: a deferred step raises
        # its own errors at once too.
        blocking = indexed and launch_blocking and not capturing
        self._raised_from = own if own is not None else (shared if blocking else None)
        self.record = (own or shared).tensor

    def done(self) -> None:
        if self._raised_from is None:
            return
        if self._raised_from.device.type == "cuda":
            torch.cuda.current_stream(self._raised_from.device).synchronize()
        self._raised_from.raise_found()


def last_decode_step() -> int:
    """The number of the latest decode step launched on the GPU kernels (1, 2, ...; per process):
    what an error of a deferred step names it by. A serving loop that defers can keep it beside each
    request to find the one a later error belongs to."""
    return _last_step


def raise_decode_errors(device: torch.device | str | None = None) -> None:
    """Raises FlashAttentionError for a bad index value (cache_seqlens, cache_leftpad,
    cache_batch_idx, block_table) that a deferred or CUDA-graph decode step on `device` (None: any;
    "cuda": any GPU) found since the last look, naming the step, and clears the record. It reads
    what the GPU has written by then: call it after the step's outputs are read (or after a
    synchronize)."""
    wanted = None if device is None else torch.device(device)
    for where, record in list(_deferred.items()):
        if wanted is None or (where.type == wanted.type and wanted.index in (None, where.index)):
            record.raise_found()
