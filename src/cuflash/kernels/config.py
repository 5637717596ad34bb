"""Launch configurations (tile shapes, warps, pipeline depth), chosen from a table per GPU
architecture: no autotuning at run time, so the first call on a new shape only compiles."""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..errors import ErrorCode, fail


@dataclasses.dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    input_precision: str = "ieee"  # of fp32 dots: ieee, tf32x3 (both exact) or tf32 (allow_tf32)
    tma: bool = False  # stream the loop's tiles through tensor descriptors (Hopper and later)
    warp_specialize: bool = False  # the unmasked loop split into producer and consumer warps
    # The Gluon kernel for Hopper (kernels/hopper_forward.py, hopper_backward.py; their own fixed
    # tiles) where it accepts the input; the Triton kernel with this launch's tiles elsewhere.
    gluon: bool = False
    # (forward launches with gluon) consumer warpgroups, 64 query rows each: 2, or 3 at D=64 (at D=128
    # three would spill their registers).
    consumers: int = 2
    # (forward launches with gluon) the Gluon forward's key tile (128, or 64: fewer keys past a short
    # sequence's end and under a causal mask less of the diagonal computed, at twice the tiles; 64 or 32
    # at D=256) and its ring of K/V buffers.
    gluon_block_n: int = 128
    gluon_stages: int = 3
    # (dK/dV launches with gluon) The Gluon dK/dV kernel also adds dQ to an fp32 workspace by TMA
    # reductions, replacing the dQ launch, unless the call asks for a deterministic backward.
    fuse_dq: bool = False


def with_user_tiles(cfg: Launch, block_m: int, block_n: int) -> Launch:
    """The table's launch with the tiles a call asks for (AttentionParams.block_m/_n; 0: the table's),
    on the Triton kernel with pointer loads: the Gluon kernels and tensor descriptors keep their own tiles."""
    if not block_m:
        return cfg
    return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, tma=False,
                               warp_specialize=False, gluon=False, fuse_dq=False)


@contextlib.contextmanager
def user_tiles_checked(block_m: int, block_n: int, head_dim: int, dtype: torch.dtype):
    """Turns a launch that the tiles a call asks for cannot fit (shared memory, registers) into a
    FlashAttentionError naming them; the table's own launches all fit, so anything else propagates."""
    try:
        yield
    except OutOfResources as exc:
        if not block_m:
            raise
        fail(ErrorCode.INVALID_ARGUMENT, f"block_m={block_m}, block_n={block_n} do not fit this GPU at head dim "
             f"{head_dim} in {str(dtype).replace('torch.', '')} ({exc}); take smaller blocks")


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Global memory where the kernels write their tensor descriptors (128 bytes each, per program).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma(cfg: Launch, seqlens: tuple[int, int], *tensors: torch.Tensor) -> bool:
    """Whether a launch streams these tensors through tensor descriptors: the configuration asks
    for it, neither sequence length is 1 and each tensor is one the copy engine can address
    (16-byte aligned base and strides, rows at a positive stride). Installs the allocator the
    descriptors need (global scratch from torch's caching allocator) when it is used.
    Length 1: Triton specializes an argument equal to 1 into a constant, and with it Triton 3.6
    fails to compile descriptor loops (the dK/dV pipeliner for seqlen_q 1 with GQA, ptxas crashing
    on the D=256 causal forward for 1 x 1), so those launches read through pointers."""
    if not cfg.tma or min(seqlens) == 1 or not tma_addressable(*tensors):
        return False
    if tensors[0].is_cuda:
        triton.set_allocator(scratch)
    return True


def tma_addressable(*tensors: torch.Tensor) -> bool:
    """16-byte aligned bases and strides, rows at positive strides: what a descriptor can read."""
    for t in tensors:
        unit = 16 // t.element_size()
        if t.data_ptr() % 16 or any(stride % unit or (stride <= 0 and n > 1)
                                    for n, stride in zip(t.shape[:-1], t.stride()[:-1])):
            return False
    return True


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (triton.cdiv is a JIT-callable costing microseconds per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The kernels' BLOCK_D: the head dim rounded up to a power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


@functools.lru_cache(maxsize=None)
def _arch(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # Triton's interpreter on CPU tensors
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if _arch(device) == 0:
        return 4  # the interpreter: a few "SMs", so that the CPU tests see the decode kernel's splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def _length(seqlen: int) -> int:
    """The sequence-length classes the table distinguishes: 0 up to 128, 1 up to 256, 2 up to 512,
    3 up to 1024, 4 up to 2048, 5 beyond."""
    return (0 if seqlen <= 128 else 1 if seqlen <= 256 else 2 if seqlen <= 512 else 3 if seqlen <= 1024
            else 4 if seqlen <= 2048 else 5)


# (arch, block_d, fp32?, length class, banded?) -> forward, backward dK/dV, backward dQ launches.
# banded: causal or a sliding window. Measured on an H200 (see docs/perf-notes.md); other GPUs
# take the generic entries.
def _table(arch: int, block_d: int, fp32: bool, length: int, banded: bool):
    if arch == 0:
        # Small, unequal tiles: the CPU tests run through the interpreter and must cover the
        # masked/unmasked split with tiles of different heights and widths.
        return Launch(32, 16, 1, 1), Launch(16, 32, 1, 1), Launch(32, 16, 1, 1)
    if fp32:
        if block_d > 128:
            # D=256 on Hopper: a tf32x3 forward, 2.7x IEEE (tune_fp32_d256.log); larger tiles run
            # out of shared memory. A tf32x3 backward (1.6x) left dQ at seqlen 1, where it cancels
            # to zero, at 2.04x torch's error: the backward stays IEEE.
            fwd = Launch(32, 16, 4, 2, "tf32x3") if arch >= 90 else Launch(16, 16, 4, 1)
            return fwd, Launch(16, 16, 4, 1), Launch(16, 16, 4, 1)
        if arch >= 90:
            # Exact fp32 dots as three TF32 tensor-core passes (tf32x3) on Hopper: 4.4x IEEE FMA
            # dots in the forward, 3x (D=128) to 5x (D=64) in the backward; errors against
            # float64 at or below the IEEE kernels' and torch's efficient kernel's, but where a
            # gradient cancels to exactly zero (one key): 1.5x torch's there (2026-11-22-h200-fp32).
            # The split operands double the shared memory: D=128 takes small tiles only.
            if block_d <= 64:
                return (Launch(128, 64, 8, 2, "tf32x3"), Launch(64, 128, 8, 2, "tf32x3"),
                        Launch(128, 64, 8, 2, "tf32x3"))
            return (Launch(128, 32, 8, 3, "tf32x3"), Launch(32, 32, 4, 2, "tf32x3", tma=True),
                    Launch(64, 32, 4, 2, "tf32x3"))
        # Before Hopper: IEEE FMA dots (tf32x3 not measured there).
        small = Launch(64, 32, 4, 2) if block_d <= 64 else Launch(32, 32, 4, 2)  # the forward and dQ
        dkdv = Launch(32, 64, 4, 2) if block_d <= 64 else Launch(32, 32, 4, 2)
        return small, dkdv, small
    if arch >= 90:
        # 64 x 64 forward tiles: causal up to 2k keys (+2..23% at D=64/128), D=128 non-causal up
        # to 512 (+9..15%); the 128-row tiles win beyond (tune_short.log). Up to 128 keys, shallower
        # pipelines for the causal and D=128 forwards (+5..11%, tune_fwd_short.log, table_n128.txt).
        # Tensor descriptors (tma) and warp specialization only where they measured faster in
        # every round (2026-11-22-h200-tma): elsewhere they cost up to 7%.
        small_fwd = Launch(64, 64, 4, 3)
        if block_d <= 64:
            if not banded:
                fwd = Launch(128, 64, 8, 3)
            elif length == 0 and block_d == 64:  # (Triton 3.6's ptxas crashes on D <= 32, length 1)
                fwd = Launch(64, 32, 4, 2)
            else:
                fwd = small_fwd if length < 5 else Launch(128, 64, 4, 3, tma=True)
            if arch == 90 and not (banded and length in (0, 2)):
                # The Gluon forward (see D=128), side by side (ab_pairs.log): non-causal 0.87-0.95x
                # cuDNN from 1k, level with these launches up to 8k and +5% at 16k; causal 0.82-0.94x
                # from 2k against 0.78-0.87x, but 0.66x against 0.71x at 1k. Beyond 2k keys with three
                # consumer warpgroups: +3..10% non-causal over two, causal +3..7% from 8k, level at 4k;
                # at 1k -10% non-causal, causal -30% (2026-11-22-h100-fwd-consumers/ab_fwd_mine.log).
                # Causal 1025-2048 keys: +8..9% over these launches at 2k, -16% at 1k
                # (2026-11-22-h100-fwd-o-kv/ab_fwd_round2.log). Non-causal there three consumers: +5..7%
                # at 1536 and 2048 keys, causal -15..-26% (2026-11-22-h100-session11/
                # tune_d64_consumers_class4.log, two rounds).
                # Non-causal 257-512 keys: three consumers with 64-key tiles, over the Triton forward +22% at
                # 320 keys, +10% at 384, -1% at 448, +3% at 512 (two consumers with 128-key tiles -16..+8%;
                # with 64-key tiles +0..5%). Three against two elsewhere up to 1k: -13..+10% at 144-256
                # keys (64-key tiles), -15..+7% at 640-1024 (128-key tiles) (2026-11-23-h100-session14/
                # ab_fwd_tiles_d64_class2.log, ab_fwd_tiles_d64_g3.log, two rounds each).
                three = length == 5 or (length in (2, 4) and not banded)
                fwd = dataclasses.replace(fwd, gluon=True, consumers=3 if three else 2)
                if length <= 2 or (banded and length == 3):
                    # Up to 512 keys, and causal up to 1k: 64-key tiles (fewer keys past the end, less
                    # of the diagonal computed, at twice the tiles) in 6 buffers. Over the Triton forward
                    # (2026-11-23-h100-session14/ab_fwd_tiles_*.log, two rounds each): non-causal +32% at
                    # 64 keys, +2% at 128, +6..20% at 144-256; causal +2..10% at 160-256 and 512-1024
                    # keys; but causal -14% at 64 and -10..-15% at 320-448 (those classes, 0 and 2,
                    # stay Triton under a causal mask).
                    fwd = dataclasses.replace(fwd, gluon_block_n=64, gluon_stages=6)
            # The Gluon dK/dV beyond 512 keys: whole backward +1..+17% (2026-11-22-h100-gluon-bwd/
            # ab_dkdv.log); its dQ measured up to 14% slower than this one at D=64 up to 4k. With dQ
            # fused into it, against these two passes (2026-11-22-h100-fused-bwd/ab_fused_split.log,
            # two rounds): +10..+19% from 4k, +4..5% at 1k non-causal, -2..3% at 1k causal; causal at
            # 1025-2048 keys, against the persistent kernels: +8..9% at 2k, -2..3% at 1k
            # (2026-11-22-h100-session11/tune_d64_dq.log, two rounds).
            # Up to 512 keys the Gluon dK/dV too, since its accumulators start at -lse and -delta:
            # whole backward over these launches +18..21% non-causal, +18..34% causal at 384-512 keys
            # (the fused kernel less: -9..+17%), +6..25% at 192-256, +6..14% at 128 and causal 64,
            # -3% at 64 non-causal (2026-11-23-h100-session13/tune_bwd_class{0,1,2}.log, two rounds).
            fuse = arch == 90 and (length >= 4 or not banded)
            dkdv = (Launch(32, 64, 4, 3, gluon=arch == 90) if length < 3
                    else Launch(64, 128, 8, 3, gluon=arch == 90, fuse_dq=fuse))
            return fwd, dkdv, Launch(64, 64, 4, 3)
        if block_d <= 128:
            if length == 0:
                fwd = Launch(64, 32, 4, 2) if banded else Launch(128, 32, 4, 4)
            elif banded and length in (3, 4):
                fwd = Launch(64, 64, 4, 3, tma=True)
            else:
                fwd = small_fwd if length in (1, 2) else Launch(128, 64, 8, 3)
            if arch == 90 and (length > 0 or not banded):
                # The Gluon forward beyond 512 keys (wgmma is Hopper's alone): 0.85-1.03x cuDNN
                # non-causal, 0.79-1.04x causal, where these launches reach 0.64-0.83x
                # (2026-11-22-h100-gluon/ab_pairs.log). Non-causal from 257 keys too: +14..26% at
                # 384 and 512; at 256 one of two rounds 26% slower, causal there -6..-14%
                # (2026-11-22-h100-short-gluon/ab_short_rotated.log, tune_short.log).
                fwd = dataclasses.replace(fwd, gluon=True)
                if length <= 1 or (banded and length <= 3):
                    # Up to 256 keys, and causal up to 1k: 64-key tiles (fewer keys past the end, less of
                    # the diagonal computed, at twice the tiles) in 5 buffers (and two Q buffers, which
                    # then fit). Over the Triton forward (2026-11-23-h100-session14/ab_fwd_tiles_*.log,
                    # two rounds each): non-causal +13% at 64 keys, +1% at 128, +15..25% at 144-256;
                    # causal +3..13% at 160-256, +1% at 384, +22% at 512, over 128-key tiles +8..19% at
                    # 640-896 and level at 1k; causal at 64 keys -8% (class 0 causal stays Triton).
                    fwd = dataclasses.replace(fwd, gluon_block_n=64, gluon_stages=5)
            # The Gluon dK/dV and dQ beyond 512 keys (2026-11-22-h100-gluon-bwd): whole backward
            # +7..+18% for the dK/dV (ab_dkdv.log), then +5..+8% for the dQ from 4k (causal 4k and
            # 1k within -2..+1%; ab_bwd.log). Non-causal from 257 keys too: at 384 / 512 keys the
            # dK/dV +3% / +6%, the dQ +1% / +2..4% (causal -2..-7%; 2026-11-22-h100-short-gluon/
            # tune_bwd_class2.log, two rounds).
            gluon_dq = arch == 90 and (length > 2 or (length == 2 and not banded))
            # The Gluon dK/dV at every length, since its accumulators start at -lse and -delta:
            # whole backward +15..31% at 384-512 keys causal, +21..27% at 192-256, +14..22% at 64-128
            # (2026-11-23-h100-session13/tune_bwd_class{0,1,2}.log, two rounds).
            # dQ fused into the Gluon dK/dV beyond 2k keys: since its accumulators start at -lse and
            # -delta (no spills in its loop), whole backward +3..11% over the two passes at 4k and
            # 16k, causal or not, +0..2% at 3k; at 2k +2..4% non-causal but -3% causal, at 1-1.5k
            # level to -5% non-causal, -7..-16% causal (2026-11-23-h100-session13/
            # tune_d128_fused.log, tune_d128_fused_2k.log, two rounds each).
            dkdv = Launch(64, 128, 8, 2, tma=length > 2, warp_specialize=length > 2, gluon=arch == 90,
                          fuse_dq=length == 5)
            return fwd, dkdv, Launch(128, 64, 8, 3, gluon=gluon_dq)
        # D=256 at 4k (tune_d256.log): 1.8-1.9x the forward, 2.1-2.4x dK/dV and 1.2x dQ of the
        # untuned (64,64,4,2) / (32,64,4,2) / (64,32,4,2). The banded forward at 129-512 keys with
        # 32-key tiles through pointers: causal +8% at 256 and 384 (one round), +4..5% at 512 (two
        # rounds), -2% at 1k (2026-11-23-h100-session15/tune_d256_fwd_short*.log); the same up to 256
        # keys without a band: +5% at 128 and 256 keys, causal at 128 +6% (2026-11-24-h100-session16/
        # tune_d256_fwd_short.log; non-causal at 384-512 -2..+2%).
        short = length <= 1 or (banded and length == 2)
        fwd = Launch(128, 32, 8, 3) if short else Launch(128, 64, 8, 2, tma=True)
        if arch == 90 and (banded or length <= 4):
            # The Gluon forward (two consumers; 32- or 64-key tiles, as many K/V buffers as fit beside
            # one Q buffer) over these launches (2026-11-24-h100-session16/ab_fwd_d256.log): 64-key tiles
            # +18% at 128 keys, causal +4% at 256 and +15% / +6% at 4k / 16k (non-causal level at 256 and
            # 16k, -3% at 4k: beyond 2k it stays Triton); 32-key tiles in 4 buffers +21..25% at 512,
            # +14..36% at 1k, +5% / +27% at 2k (non-causal / causal).
            tiles, buffers = (32, 4) if 2 <= length <= 4 else (64, 2)
            fwd = dataclasses.replace(fwd, gluon=True, gluon_block_n=tiles, gluon_stages=buffers)
        return fwd, Launch(64, 64, 8, 2, tma=True), Launch(128, 32, 8, 3)
    if block_d <= 64:
        return Launch(128, 64, 4, 3), Launch(32, 128, 4, 2), Launch(128, 32, 4, 2)
    if block_d <= 128:
        return Launch(128, 32, 4, 2), Launch(32, 64, 4, 2), Launch(64, 32, 4, 2)
    return Launch(64, 32, 4, 1), Launch(16, 64, 4, 1), Launch(64, 16, 4, 1)


def tf32(q: torch.Tensor) -> bool:
    """fp32 stays exact unless the user opted into TF32 for matmuls, as torch does."""
    return q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


@functools.lru_cache(maxsize=None)
def _launches(arch: int, block_d: int, fp32: bool, tf32: bool, length: int,
              banded: bool) -> tuple[Launch, Launch, Launch]:
    configs = _table(arch, block_d, fp32, length, banded)
    if tf32:  # the user opted into TF32 matmuls: one TF32 pass per fp32 dot
        return tuple(dataclasses.replace(c, input_precision="tf32") for c in configs)
    return configs


def _configs(q: torch.Tensor, block_d: int, seqlen: int, banded: bool) -> tuple[Launch, Launch, Launch]:
    return _launches(_arch(q.device), block_d, q.dtype == torch.float32, tf32(q), _length(seqlen), banded)


def forward_config(q: torch.Tensor, block_d: int, seqlen: int, banded: bool) -> Launch:
    """seqlen: the longer of the query and key lengths (the longest sequence when varlen)."""
    return _configs(q, block_d, seqlen, banded)[0]


def decode_config(q: torch.Tensor, block_d: int, paged: bool, fills_gpu: bool) -> Launch:
    """The decode kernel's launch: block_m is the most query rows (tokens x heads of a GQA group)
    per program, block_n the key tile. fills_gpu: the sequences x KV heads alone give every SM its
    programs, so the cache is read unsplit. Measured on an H200 (docs/perf-notes.md)."""
    arch = _arch(q.device)
    precision = "tf32" if tf32(q) else "ieee"
    if arch == 0:
        return Launch(16, 16, 1, 1, precision)
    if q.dtype == torch.float32 or block_d > 128:
        return Launch(64, 32, 4, 2, precision)
    # Many unsplit contiguous sequences read in lock-step: 128-key tiles +18% (batch 64).
    return Launch(64, 128 if fills_gpu and not paged else 64, 4, 3, precision)


def backward_configs(q: torch.Tensor, block_d: int, seqlen: int, banded: bool) -> tuple[Launch, Launch]:
    return _configs(q, block_d, seqlen, banded)[1:]
