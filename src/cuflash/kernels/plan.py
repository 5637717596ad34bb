"""Which kernel runs a call and with what launch: `select(problem, params) -> Plan`, from a table per
GPU architecture (no autotuning at run time, so the first call of a new shape only compiles); and a
decode step's launch, `select_decode(...) -> DecodeLaunch`: its tiles, split count and page prefetch.

A table entry lists, for each pass (forward, dK/dV, dQ), candidate configurations in order of
preference; the first whose kernel family accepts the call runs (kernels/gluon/__init__.py says what
the Gluon kernels accept; the Triton kernels take every call, so each list ends with Triton Tiles).
Why each entry is what it is, with the measurements: docs/tuning.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Union

import torch
from triton.runtime.errors import OutOfResources

from ..errors import ErrorCode, fail
from ..params import AttentionParams
from . import gluon
from .device import arch, cdiv, max_shared_memory, next_power_of_2, num_sms, padded_head_dim, tf32
from .triton import DecodeLaunch, OneLaunch, SplitOperands, Tiles
from .variant import Problem

Candidate = Union[Tiles, OneLaunch, SplitOperands, gluon.Forward, gluon.Dkdv, gluon.Dq]


class Length(enum.IntEnum):
    """The sequence-length classes the table distinguishes (the longer of the query and key lengths;
    the longest sequence of a varlen batch)."""
    UP_TO_128 = 0
    UP_TO_256 = 1
    UP_TO_512 = 2
    UP_TO_1K = 3
    UP_TO_2K = 4
    LONGER = 5

    @classmethod
    def of(cls, seqlen: int) -> Length:
        for length, top in zip(cls, (128, 256, 512, 1024, 2048)):
            if seqlen <= top:
                return length
        return cls.LONGER


@dataclass(frozen=True)
class Entry:
    """A table entry: each pass's candidates, in order of preference."""
    forward: tuple[Candidate, ...]
    dkdv: tuple[Candidate, ...]
    dq: tuple[Candidate, ...]


@dataclass(frozen=True)
class Plan:
    """What runs: the forward's launch, and in a backward (the problem has dO) dK/dV's and dQ's;
    dq None: the dK/dV kernel computes dQ (the Gluon one with fuse_dq, the Triton one for OneLaunch)."""
    forward: Tiles | SplitOperands | gluon.Forward
    dkdv: Tiles | SplitOperands | gluon.Dkdv | None = None
    dq: Tiles | SplitOperands | gluon.Dq | None = None


def select(prob: Problem, params: AttentionParams, entry: Entry | None = None, one_launch: bool = True) -> Plan:
    """The plan for a call: the entry's (by default the table's, or the tiles the call asks for)
    first candidate of each pass that its kernel family accepts; one_launch False: not the one-launch
    backward (which computes delta itself: a backward given the lse's gradient needs the delta pass)."""
    entry = entry or table_entry(prob, params)
    if params.mods is not None:
        entry = _within_blocks(entry, params, max(prob.block_d, prob.block_dv))
    seqlens = (prob.seqlen_q, prob.seqlen_k)
    plain = gluon.accepts(prob, params)
    split = SplitOperands.accepts(prob, params)
    streamed = () if params.block_table is not None else (prob.k, prob.v)
    forward = _first(entry.forward, plain, seqlens, streamed, prob, split)
    if prob.dout is None:
        return Plan(forward)
    dkdv = _first(tuple(c for c in entry.dkdv if one_launch or not isinstance(c, OneLaunch)), plain, seqlens,
                  (prob.q, prob.dout), prob, split)
    if isinstance(dkdv, OneLaunch):
        return Plan(forward, dkdv.tiles.on(seqlens, prob.q, prob.dout), None)
    if isinstance(dkdv, SplitOperands):  # (its dQ pass reads the split parts the dK/dV pass's launch made)
        split_dq = [c for c in entry.dq if isinstance(c, SplitOperands)]
        if not split_dq:
            raise ValueError(f"an entry whose dK/dV pass splits its operands lists no SplitOperands dQ: {entry.dq}")
        return Plan(forward, dkdv, split_dq[0])
    if isinstance(dkdv, gluon.Dkdv) and dkdv.fuse_dq:
        if not (params.deterministic or _fused_dq_thrashes(prob)):
            return Plan(forward, dkdv, None)
        dkdv = dataclasses.replace(dkdv, fuse_dq=False)
    return Plan(forward, dkdv, _first(entry.dq, plain, seqlens, (prob.k, prob.v), prob))


# The fused dQ's additions and the query tiles stay in L2 while the dK/dV programs sweep the query rows
# together. Under GQA in calls of more query-key pairs than 32 heads of 128k x 128k, L2's hit rate fell
# from 87% to 58% and the fused backward to 0.68x cuDNN (H100, D=128 causal, 32/8 heads at 256k keys),
# where the dQ pass of its own holds 0.92x; MHA does not fall, nor GQA on K/V repeated to every head
# (why, docs/tuning.md). Measured at batch 1; a batch counts as more heads (its items share the grid as
# the KV heads do), unmeasured.
FUSED_DQ_MAX_PAIRS = 32 * 2 ** 34


def _fused_dq_thrashes(prob: Problem) -> bool:
    return prob.nheads > prob.nheads_k and prob.batch * prob.nheads * prob.seqlen_q * prob.seqlen_k > FUSED_DQ_MAX_PAIRS


def _within_blocks(entry: Entry, params: AttentionParams, block_d: int) -> Entry:
    """The entry for a call with mods: the kernels that compile them, each pass's tiles within one block
    of the call's block mask (a query tile inside one query block, a key tile inside one key block).
    The forward keeps its Gluon candidate, with two consumer warpgroups (the mods' registers beside the
    scores) and, with a block mask, key tiles within a key block, where a work item's 128 query rows lie
    in one query block and no band is asked for (its tile walk is the band's or the block mask's). So
    does the backward's dK/dV up to head dim 128, with dQ fused (unfused in a deterministic backward:
    Triton's dQ), where a work item's 128 keys lie in one key block and its 64-row query tiles in query
    blocks, and no band is asked for; the rest takes Triton tiles (and, without a block mask, the
    one-launch backward first where the table has it). At head dim 256 the Triton tiles buffer
    two stages, not three, where a mod reads a captured tensor per score (ModGraph.gathers) or a captured
    tensor's gradient is asked for: a relative bias's loads and its gradient's took dQ's 128 x 32 tiles to
    256 KB of shared memory; a slope per head (ALiBi) costs none, and the third stage was 9-14% of the
    D=256 backward."""
    blocks = params.mods.blocks if params.mods is not None else None
    mods = params.mods
    # (two stages at head dim 256 where a mod reads a tensor per score or adds a captured tensor's gradient)
    gathers = mods is not None and (any(mod is not None and mod.graph.gathers for mod in (mods.score, mods.mask))
                                    or (mods.score is not None and any(mods.score.requires_grad)))
    if blocks is not None and (blocks.q_block % 16 or blocks.kv_block % 16):
        fail(ErrorCode.INVALID_ARGUMENT, f"block_mask's BLOCK_SIZE is ({blocks.q_block}, {blocks.kv_block}); the "
             "kernels take blocks of a multiple of 16 query rows and keys (torch's default is 128)")

    def fit_tiles(tiles: Tiles) -> Tiles:
        if block_d >= 256 and gathers:
            tiles = dataclasses.replace(tiles, num_stages=min(tiles.num_stages, 2))
        if blocks is None:
            return tiles
        block_m = min(tiles.block_m, blocks.q_block & -blocks.q_block)  # (the largest power of 2 dividing it)
        block_n = min(tiles.block_n, blocks.kv_block & -blocks.kv_block)
        return dataclasses.replace(tiles, block_m=block_m, block_n=block_n, warp_specialize=False)

    def fit(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
        return tuple(fit_tiles(c) for c in candidates if isinstance(c, Tiles))

    def fit_gluon(candidate: Candidate) -> tuple[Candidate, ...]:
        if isinstance(candidate, gluon.Forward):
            if blocks is None:
                return (dataclasses.replace(candidate, consumers=2),)
            block_n = min(candidate.block_n, blocks.kv_block & -blocks.kv_block)
            if blocks.q_block % (2 * gluon.ROWS) or block_n < 32 or params.banded:
                return ()
            return (dataclasses.replace(candidate, consumers=2, block_n=block_n),)
        if isinstance(candidate, gluon.Dkdv) and block_d <= 128 and (
                blocks is None or not (blocks.kv_block % (2 * gluon.ROWS) or blocks.q_block % gluon.ROWS
                                       or params.banded)):
            return (dataclasses.replace(candidate, fuse_dq=True),)
        return ()

    def fitted(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
        # (the one-launch backward walks no lists: it takes mods without a block mask, first where listed)
        whole = tuple(c for c in candidates if isinstance(c, OneLaunch)) if blocks is None else ()
        return (*whole, *(g for c in candidates for g in fit_gluon(c)), *fit(candidates))
    return Entry(fitted(entry.forward), fitted(entry.dkdv), fit(entry.dq))


def _first(candidates: tuple[Candidate, ...], gluon_accepts: bool, seqlens: tuple[int, int],
           streamed: tuple[torch.Tensor, ...], prob: Problem, split_accepts: bool = False):
    """The first candidate that takes the call; Triton tiles asking for tensor descriptors that the call
    cannot use (Tiles.on) yield to the next Triton tiles where the entry lists some (tiles sized for
    pointer loads: at head dim 512 the descriptor tiles' pointer form overflows shared memory)."""
    for i, candidate in enumerate(candidates):
        if isinstance(candidate, Tiles):
            tiles = candidate.on(seqlens, *streamed)
            if tiles.tma == candidate.tma or not any(isinstance(c, Tiles) for c in candidates[i + 1:]):
                return tiles
        elif isinstance(candidate, OneLaunch):
            if candidate.takes(prob.seqlen_k, prob.batch, prob.nheads, prob.nheads_k, num_sms(prob.q.device)):
                return candidate
        elif isinstance(candidate, SplitOperands):
            if split_accepts:
                return candidate
        elif gluon_accepts:
            return candidate
    raise ValueError(f"no candidate takes the call: {candidates} (an entry must end with Triton Tiles)")


def table_entry(prob: Problem, params: AttentionParams) -> Entry:
    """The table's entry for the call, or Triton tiles of the size the call asks for
    (AttentionParams.block_m/_n) for every pass."""
    q = prob.q
    if params.block_m:
        _user_tiles_fit(prob, params)
        warps = _user_warps(params.block_m, params.block_n, prob.block_d, prob.block_dv)
        tiles = Tiles(params.block_m, params.block_n, warps, 2, "tf32" if tf32(q) else "ieee")
        return Entry((tiles,), (tiles,), (tiles,))
    return entry(arch(q.device), prob.block_d, q.dtype == torch.float32, tf32(q),
                 Length.of(max(prob.seqlen_q, prob.seqlen_k)), params.banded, prob.block_dv)


# User tiles whose fp32 accumulators exceed this many elements take 8 warps instead of 4: on 4 warps
# they spill, and the compiler takes minutes over them (docs/tuning.md).
USER_TILE_ELEMENTS_PER_4_WARPS = 8192


def _user_warps(block_m: int, block_n: int, block_d: int, block_dv: int) -> int:
    """The warps of user tiles: the forward holds a block_m x block_dv output and a block_m x block_n
    score tile in fp32, the dK/dV pass a block_n x block_d (dK) and a block_n x block_dv (dV)
    accumulator (block_d: q's and k's head dim, block_dv: v's, as the kernels pad them)."""
    held = max(block_m * (block_dv + block_n), block_n * (block_d + block_dv))
    return 8 if held > USER_TILE_ELEMENTS_PER_4_WARPS else 4


def _user_tiles_fit(prob: Problem, params: AttentionParams) -> None:
    """Refuses, before any compile, user tiles whose streamed tiles alone overflow shared memory: the
    forward stages a key and a value tile (block_n rows each), the backward's dK/dV pass a query and
    a dO tile (block_m rows), the first of q's and k's head dim, the second of v's. A compile of such
    tiles can take minutes before the compiler says the same."""
    q = prob.q
    rows = params.block_n if prob.dout is None else max(params.block_m, params.block_n)
    need = rows * (prob.block_d + prob.block_dv) * q.element_size()
    have = max_shared_memory(q.device)
    if need > have:
        dims = f"head dim {prob.head_dim}" + (f" (v {prob.head_dim_v})" if prob.head_dim_v != prob.head_dim else "")
        fail(ErrorCode.INVALID_ARGUMENT, f"block_m={params.block_m}, block_n={params.block_n} do not fit this GPU at "
             f"{dims} in {str(q.dtype).replace('torch.', '')} ({rows} x {prob.block_d} and {rows} x {prob.block_dv} "
             f"tiles need {need // 1024} KiB of shared memory, it has {have // 1024} KiB); take smaller blocks")


@functools.lru_cache(maxsize=None)
def entry(arch: int, block_d: int, fp32: bool, tf32: bool, length: Length, banded: bool,
          block_dv: int | None = None) -> Entry:
    """The table: arch (10 * compute capability; 0 for Triton's interpreter), the padded head dim of q
    and k, fp32 or 16-bit, TF32 allowed, the length class, banded (causal or a sliding window), and
    v's padded head dim (None: block_d). Its tiles are those of the larger head dim, which leave
    registers and shared memory for the smaller."""
    fwd, dkdv, dq = _table(arch, block_d, block_dv or block_d, fp32, length, banded)
    if tf32:  # the user opted into TF32 matmuls: one TF32 pass per fp32 dot (and no split operands)
        fwd, dkdv, dq = ((dataclasses.replace(c, input_precision="tf32") if isinstance(c, Tiles) else c for c in cs
                          if not isinstance(c, SplitOperands)) for cs in (fwd, dkdv, dq))
    return Entry(tuple(fwd), tuple(dkdv), tuple(dq))


def _table(arch: int, block_d: int, block_dv: int, fp32: bool, length: Length, banded: bool):
    hopper = arch == 90  # wgmma, and with it the Gluon kernels, is Hopper's alone
    if arch >= 90 and not fp32 and (block_d, block_dv) == (256, 128):
        return _hopper_d192(hopper, length, banded)
    block_d = max(block_d, block_dv)  # (the tiles of the larger head dim)
    if arch == 0:
        # Small, unequal tiles: the CPU tests run through the interpreter and must cover the
        # masked/unmasked split with tiles of different heights and widths, and (up to 32 keys and a
        # few heads) the one-launch backward. (The split-operand kernels, three to six times the products
        # through the interpreter, run in the tests that force them: tests/test_exact_fp32.py.)
        dkdv = Tiles(16, 32, 1, 1)
        return (Tiles(32, 16, 1, 1),), (OneLaunch(dkdv), dkdv), (Tiles(32, 16, 1, 1),)
    if block_d > 256:
        return _d512(arch, fp32)
    if fp32:
        return _fp32(arch, block_d)
    if arch < 90:
        # Before Hopper: one generic entry per head dim (not tuned per length).
        if block_d <= 64:
            return (Tiles(128, 64, 4, 3),), (Tiles(32, 128, 4, 2),), (Tiles(128, 32, 4, 2),)
        if block_d <= 128:
            return (Tiles(128, 32, 4, 2),), (Tiles(32, 64, 4, 2),), (Tiles(64, 32, 4, 2),)
        return (Tiles(64, 32, 4, 1),), (Tiles(16, 64, 4, 1),), (Tiles(64, 16, 4, 1),)
    if block_d <= 64:
        return _hopper_d64(hopper, block_d, length, banded)
    if block_d <= 128:
        return _hopper_d128(hopper, length, banded)
    return _hopper_d256(hopper, length, banded)


def _d512(arch: int, fp32: bool):
    """Head dims 257-512, Triton only. 16-bit: 8 warps hold a 64-row tile's 64 x 512 fp32 output (the forward,
    dQ) or a 32-key tile's dK and dV, over 64-row query tiles; one stage of 512-column tiles (two overflow shared
    memory or run slower: docs/tuning.md), K/V (forward) and Q/dO (dK/dV) through tensor descriptors on Hopper.
    fp32 takes IEEE dots in 16-row tiles (tf32x3's split operands double the shared memory)."""
    if fp32:
        tiles = Tiles(16, 16, 4, 1)
        return (tiles,), (tiles,), (tiles,)
    # dK/dV's descriptor tiles through pointers need 256 KB: where descriptors do not take the call (a
    # length of 1, paged keys) 32 x 32 in two stages (130 KB; 0.85x at 4k) runs instead (_first).
    dkdv = (Tiles(64, 32, 8, 1, tma=True), Tiles(32, 32, 8, 2)) if arch >= 90 else (Tiles(32, 32, 8, 2),)
    return (Tiles(64, 64, 8, 1, tma=arch >= 90),), dkdv, (Tiles(64, 32, 8, 1),)


def _fp32(arch: int, block_d: int):
    """fp32: exact dots as three TF32 tensor-core passes (tf32x3) on Hopper, IEEE FMA dots before. On
    Hopper the first candidates split their operands once (SplitOperands: the forward at every head dim,
    the backward up to 128), the rest split every tile in Triton's tf32x3."""
    forward: tuple[Candidate, ...] = ()
    backward: tuple[tuple[Candidate, ...], tuple[Candidate, ...]] = ((), ())
    if arch == 90:
        if block_d <= 64:
            forward = (SplitOperands(Tiles(128, 64, 8, 2)),)
            backward = (SplitOperands(Tiles(64, 128, 8, 2)),), (SplitOperands(Tiles(128, 64, 8, 2)),)
        elif block_d <= 128:
            forward = (SplitOperands(Tiles(128, 64, 8, 1)),)
            backward = (SplitOperands(Tiles(32, 64, 4, 2)),), (SplitOperands(Tiles(64, 32, 4, 2)),)
        else:
            # (the backward's three-part operands at D=256: 32-row tiles whose registers spill, 1 TFLOP/s)
            forward = (SplitOperands(Tiles(64, 32, 4, 1)),)
    if block_d > 128:
        # D=256: a tf32x3 forward; the backward stays IEEE (a tf32x3 one doubled the error of a dQ that
        # cancels to zero); larger tiles run out of shared memory.
        fwd = Tiles(32, 16, 4, 2, "tf32x3") if arch >= 90 else Tiles(16, 16, 4, 1)
        return (*forward, fwd), (Tiles(16, 16, 4, 1),), (Tiles(16, 16, 4, 1),)
    if arch >= 90:
        if block_d <= 64:
            return ((*forward, Tiles(128, 64, 8, 2, "tf32x3")), (*backward[0], Tiles(64, 128, 8, 2, "tf32x3")),
                    (*backward[1], Tiles(128, 64, 8, 2, "tf32x3")))
        # Triton's split operands double the shared memory: D=128 takes small tiles.
        return ((*forward, Tiles(128, 32, 8, 3, "tf32x3")), (*backward[0], Tiles(32, 32, 4, 2, "tf32x3", tma=True)),
                (*backward[1], Tiles(64, 32, 4, 2, "tf32x3")))
    small = Tiles(64, 32, 4, 2) if block_d <= 64 else Tiles(32, 32, 4, 2)  # the forward and dQ
    dkdv = Tiles(32, 64, 4, 2) if block_d <= 64 else Tiles(32, 32, 4, 2)
    return (small,), (dkdv,), (small,)


def _hopper_d64(hopper: bool, block_d: int, length: Length, banded: bool):
    L = Length
    # Triton forward: 128 x 64 tiles without a band; causal 64 x 64 up to 2k keys, beyond with
    # descriptors; causal up to 128 keys at D=64 64 x 32 (Triton 3.6's ptxas crashes on D <= 32 there).
    if not banded:
        fwd = Tiles(128, 64, 8, 3)
    elif length == L.UP_TO_128 and block_d == 64:
        fwd = Tiles(64, 32, 4, 2)
    else:
        fwd = Tiles(64, 64, 4, 3) if length < L.LONGER else Tiles(128, 64, 4, 3, tma=True)
    forward: tuple[Candidate, ...] = (fwd,)
    if hopper and not (banded and length in (L.UP_TO_128, L.UP_TO_512)):
        # Gluon but causal up to 128 and at 257-512 keys: three consumers beyond 2k keys, and without a
        # band at 257-512 and 1025-2048 keys; 64-key tiles in 6 buffers up to 512 keys, and causal up to 1k;
        # the consumers taking turns on 128-key tiles (measured there, docs/tuning.md).
        three = length == L.LONGER or (length in (L.UP_TO_512, L.UP_TO_2K) and not banded)
        short = length <= L.UP_TO_512 or (banded and length == L.UP_TO_1K)
        forward = (gluon.Forward(3 if three else 2, *((64, 6) if short else (128, 3)), turns=not short), fwd)
    # dK/dV: the one-launch backward up to 128 keys (for a few heads per SM), Gluon at every length, with
    # dQ fused from 2k keys (and without a band from 1k).
    if length < L.UP_TO_1K:
        dkdv: tuple[Candidate, ...] = (Tiles(32, 64, 4, 3),)
        fuse = False
    else:
        dkdv = (Tiles(64, 128, 8, 3),)
        fuse = length >= L.UP_TO_2K or not banded
    if hopper:
        dkdv = (gluon.Dkdv(fuse_dq=fuse), *dkdv)
    if length == L.UP_TO_128:
        dkdv = (OneLaunch(Tiles(64, 128, 8, 2)), *dkdv)
    return forward, dkdv, (Tiles(64, 64, 4, 3),)


def _hopper_d128(hopper: bool, length: Length, banded: bool):
    L = Length
    if length == L.UP_TO_128:
        fwd = Tiles(64, 32, 4, 2) if banded else Tiles(128, 32, 4, 4)
    elif banded and length in (L.UP_TO_1K, L.UP_TO_2K):
        fwd = Tiles(64, 64, 4, 3, tma=True)
    else:
        fwd = Tiles(64, 64, 4, 3) if length in (L.UP_TO_256, L.UP_TO_512) else Tiles(128, 64, 8, 3)
    forward: tuple[Candidate, ...] = (fwd,)
    if hopper and (length > L.UP_TO_128 or not banded):
        # Gluon but causal up to 128 keys; 64-key tiles in 5 buffers up to 256 keys, and causal up to 1k;
        # the consumers taking turns on 128-key tiles (measured there, docs/tuning.md).
        short = length <= L.UP_TO_256 or (banded and length <= L.UP_TO_1K)
        forward = (gluon.Forward(2, *((64, 5) if short else (128, 3)), turns=not short), fwd)
    # dK/dV: the one-launch backward up to 128 keys (for a few heads per SM), Gluon at every length, dQ
    # fused beyond 2k keys; dQ: Gluon beyond 512 keys, and without a band from 257.
    long = length > L.UP_TO_512
    dkdv: tuple[Candidate, ...] = (Tiles(64, 128, 8, 2, tma=long, warp_specialize=long),)
    dq: tuple[Candidate, ...] = (Tiles(128, 64, 8, 3),)
    if hopper:
        dkdv = (gluon.Dkdv(fuse_dq=length == L.LONGER), *dkdv)
        if long or (length == L.UP_TO_512 and not banded):
            dq = (gluon.Dq(), *dq)
    if length == L.UP_TO_128:
        dkdv = (OneLaunch(Tiles(64, 128, 8, 2)), *dkdv)
    return forward, dkdv, dq


def _hopper_d256(hopper: bool, length: Length, banded: bool):
    L = Length
    # Triton forward: 32-key tiles through pointers up to 256 keys (causal up to 512), descriptors beyond.
    short = length <= L.UP_TO_256 or (banded and length == L.UP_TO_512)
    fwd = Tiles(128, 32, 8, 3) if short else Tiles(128, 64, 8, 2, tma=True)
    forward: tuple[Candidate, ...] = (fwd,)
    dkdv: tuple[Candidate, ...] = (Tiles(64, 64, 8, 2, tma=True),)
    if hopper:
        # Gluon (two consumers): 64-key tiles in 2 buffers, from 257 keys with early_k (faster than
        # 32-key tiles in 4 buffers, and beyond 2k keys than the Triton forward: docs/tuning.md).
        # dK/dV: Gluon with split-D consumers (dQ unfused); dQ Triton.
        forward = (gluon.Forward(2, 64, 2, early_k=length >= L.UP_TO_512), fwd)
        dkdv = (gluon.Dkdv(), *dkdv)
    return forward, dkdv, (Tiles(128, 32, 8, 3),)


def _hopper_d192(hopper: bool, length: Length, banded: bool):
    """q and k 129-256 wide, v 65-128 (DeepSeek's MLA (192, 128); the Gluon kernels at (192, 128) exactly):
    D=256's Triton tiles, which leave the narrower v room. The Gluon forward on 64-key tiles: 3 buffers
    (two Q buffers) up to 256 keys and causal up to 1k, 4 with early_k beyond (scripts/mla_sweep.py, H100:
    0.96-1.00x D=128 per FLOP at 4k-16k, against 0.81-1.01x for 128-key tiles in 2 buffers; docs/tuning.md);
    the Gluon dK/dV with split-D consumers (as D=256's: dK's 128 + 64 columns, dV's halves); the Gluon dQ
    where D=128 takes it, on 64-key tiles in 3 buffers (dQ leaving through the Q tiles; 2 buffers time the
    same, 4 do not fit)."""
    L = Length
    forward, dkdv, dq = _hopper_d256(hopper, length, banded)
    if hopper:
        short = length <= L.UP_TO_256 or (banded and length <= L.UP_TO_1K)
        forward = (gluon.Forward(2, 64, 3) if short else gluon.Forward(2, 64, 4, early_k=True), forward[-1])
        if length > L.UP_TO_512 or (length == L.UP_TO_512 and not banded):
            dq = (gluon.Dq(64, 3), *dq)
    return forward, dkdv, dq


# The decode step (kernels/triton/decode.py): tiles, split count, page prefetch.
MAX_SPLITS = 64  # the combine kernel holds one row of every split in registers
# The split heuristic's bar (even_splits): the fewest splits whose key tiles load every SM within 10%
# of evenly (the SM with most tiles ends last).
WAVE_EFFICIENCY = 0.9
# Programs an SM from which the grid fills the GPU alone: each sequence is read unsplit (even_splits)
# and without the page prefetch (docs/tuning.md).
FULL = 2
# The most page-table entries a split's keys span where MAX_SPLITS allows: the kernel's check of a
# share's pages before its loop costs nothing up to this many, and slows the decode beyond
# (docs/tuning.md).
MAX_SHARE_PAGES = 2048


def select_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
                  num_splits: int = 0, tiles: Tiles | None = None) -> DecodeLaunch:
    """The launch of a decode step of q (B, Sq, H, D) on the cache k_cache (rows, rows_per_seq, Hk, D)
    and v_cache (rows, rows_per_seq, Hk, Dv), its sequences in rows or in the pages of block_table (B,
    pages): `tiles` or the table's (decode_tiles, for the larger head dim), num_splits splits (0:
    num_splits_for's choice), and the page prefetch where the grid leaves SMs free."""
    batch, seqlen_q, nheads = q.shape[:3]
    nheads_k, rows_per_seq = k_cache.shape[2], k_cache.shape[1]
    block_d = padded_head_dim(max(q.shape[3], v_cache.shape[3]))
    paged = block_table is not None
    cfg = tiles or decode_tiles(q, block_d, paged, split=True)
    rows = seqlen_q * nheads // nheads_k
    block_m = min(cfg.block_m, max(16, next_power_of_2(rows)))
    m_tiles = cdiv(rows, block_m)
    programs = batch * nheads_k * m_tiles
    pages = block_table.shape[1] if block_table is not None else 0
    capacity = rows_per_seq * (pages or 1)
    splits = num_splits_for(programs, capacity, cfg.block_n, q.device, num_splits, pages)
    if tiles is None and splits == 1:  # whole sequences: the table's unsplit launch (same block_m)
        cfg = decode_tiles(q, block_d, paged, split=False)
    share = _share_pages(pages, capacity, splits, cfg.block_n) if paged else 0
    prefetch = programs < FULL * num_sms(q.device)  # the page of each key read a tile ahead
    return DecodeLaunch(cfg, block_m, m_tiles, splits, share, prefetch)


def decode_tiles(q: torch.Tensor, block_d: int, paged: bool, split: bool) -> Tiles:
    """The decode kernel's launch: block_m is the most query rows (tokens x heads of a GQA group)
    per program, block_n the key tile. split: the keys of a sequence are split between programs."""
    precision = "tf32" if tf32(q) else "ieee"
    if arch(q.device) == 0:
        return Tiles(16, 16, 1, 1, precision)
    if block_d > 256:
        return Tiles(16 if q.dtype == torch.float32 else 32, 32, 8, 2, precision)
    if q.dtype == torch.float32 or block_d > 128:
        return Tiles(64, 32, 4, 2, precision)
    # 64-key tiles for a split contiguous cache, 128 for whole sequences and pages (docs/tuning.md).
    return Tiles(64, 64 if split and not paged else 128, 4, 3, precision)


def num_splits_for(programs: int, capacity: int, block_n: int, device: torch.device, requested: int = 0,
                   pages: int = 0) -> int:
    """How many splits of each sequence's keys: `requested`, or (0) even_splits, never more than
    MAX_SPLITS or than the cache has key tiles; with a page table of `pages` entries per sequence, at
    least as many as keep a split's keys within MAX_SHARE_PAGES of them (as far as MAX_SPLITS allows)."""
    tiles = cdiv(capacity, block_n)
    fewest = 1
    while pages and fewest < MAX_SPLITS and _share_pages(pages, capacity, fewest, block_n) > MAX_SHARE_PAGES:
        fewest += 1
    if requested:
        return max(fewest, min(requested, MAX_SPLITS, tiles))
    return even_splits(programs, tiles, num_sms(device), fewest)


def even_splits(programs: int, tiles: int, sms: int, fewest: int = 1) -> int:
    """The fewest splits (from `fewest`) of `programs` alike programs reading `tiles` key tiles each
    that load `sms` SMs within WAVE_EFFICIENCY of evenly (the tiles over sms x the most tiles an SM
    reads), else the most even up to MAX_SPLITS; unsplit from FULL programs an SM. About one program
    an SM reads fastest, and a split whose tiles do not divide evenly ends last (docs/tuning.md)."""
    if programs >= FULL * sms:
        return fewest

    def evenness(splits: int) -> float:
        per_split = cdiv(tiles, splits)
        return programs * tiles / (sms * per_split * cdiv(programs * cdiv(tiles, per_split), sms))
    candidates = range(fewest, max(fewest, min(MAX_SPLITS, tiles)) + 1)
    return next((s for s in candidates if evenness(s) >= WAVE_EFFICIENCY), max(candidates, key=evenness))


def _share_pages(pages: int, capacity: int, splits: int, block_n: int) -> int:
    """The most page-table entries a split's keys span (one more where they straddle a page)."""
    return min(pages, cdiv(cdiv(cdiv(capacity, splits), block_n) * block_n, capacity // pages) + 1)


@contextlib.contextmanager
def user_tiles_checked(params: AttentionParams, head_dim: int, dtype: torch.dtype):
    """Turns a launch that the tiles a call asks for cannot fit (shared memory, registers) into a
    FlashAttentionError naming them; the table's own launches all fit, so anything else propagates."""
    try:
        yield
    except OutOfResources as exc:
        if not params.block_m:
            raise
        fail(ErrorCode.INVALID_ARGUMENT, f"block_m={params.block_m}, block_n={params.block_n} do not fit this GPU at "
             f"head dim {head_dim} in {str(dtype).replace('torch.', '')} ({exc}); take smaller blocks")


__all__ = ["DecodeLaunch", "Entry", "Length", "OneLaunch", "Plan", "Tiles", "decode_tiles", "entry", "even_splits",
           "num_splits_for", "padded_head_dim", "select", "select_decode", "table_entry", "user_tiles_checked"]
