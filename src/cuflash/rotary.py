"""Rotary position embedding (RoPE), flash-attn compatible: `apply_rotary_emb` as in
`flash_attn.layers.rotary`, and `rotate`, the one implementation that it and
flash_attn_with_kvcache share.

The rotation runs in fp32 whatever the input dtype and is rounded once to it: on the GPU one
Triton kernel (kernels/rotary.py; its gradient is the rotation by the opposite angle), on the CPU
torch ops of the same arithmetic, which autograd differentiates.

Positions outside the table, one rule for apply_rotary_emb and flash_attn_with_kvcache: the
tables cos, sin (rotary_cos, rotary_sin) hold seqlen_ro rows, row p for position p, and a token at
a position outside [0, seqlen_ro) raises FlashAttentionError naming the table wherever the position
is known on the host without waiting for the GPU:
  - apply_rotary_emb: always seqlen <= seqlen_ro, and with an int seqlen_offsets o,
    o + seqlen <= seqlen_ro (seqlen: max_seqlen with cu_seqlens), as flash-attn asserts both; with a
    tensor of offsets on the CPU, each sequence's positions;
  - flash_attn_with_kvcache: cache_seqlens (an int, or a CPU tensor) before the call; on the GPU the
    decode kernel checks them and the error is raised by the next step (see its docstring).
The one exception is a tensor of seqlen_offsets on the GPU in apply_rotary_emb, which is not read
back (that would wait for the GPU): a token whose position falls outside the table is left
unrotated, as flash-attn's kernel leaves it (it masks the table's reads with cos 1, sin 0).
"""
from __future__ import annotations

import torch

from .backend import backend_name
from .errors import ErrorCode, FlashAttentionError, fail
from .validate import KERNEL_DTYPES, check_bool, check_cu_seqlens, check_tensor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool, inplace: bool = False) -> torch.Tensor:
    """x (..., nheads, headdim) rotated on its first 2 * cos.shape[1] dims at `positions` (long,
    shaped like x.shape[:-2]): pairs (2i, 2i + 1) when interleaved (GPT-J), halves
    (i, i + rotary_dim / 2) otherwise (GPT-NeoX). cos, sin: (seqlen_ro, rotary_dim / 2). A position
    past seqlen_ro is left unrotated (cos 1, sin 0), as flash-attn's kernel does, and so is a
    negative one (the callers refuse such positions where they can read them: see the module
    docstring). inplace: into x.
    With the Triton backend (x on the GPU) one kernel rotates; otherwise torch ops do."""
    if kernel_rotates(x):
        return _Rotate.apply(x, cos, sin, positions, interleaved, inplace)
    out = _rotated(x, cos, sin, positions, interleaved)
    return x.copy_(out) if inplace else out


def kernel_rotates(x: torch.Tensor) -> bool:
    """Whether the Triton kernel rotates x: the Triton backend runs its dtype and device (not under
    torch.compile, which traces the torch ops) and x is at most 4-D."""
    if torch.compiler.is_compiling() or x.dim() > 4 or x.dtype not in KERNEL_DTYPES:
        return False
    try:
        return backend_name(x.device, x.dtype) == "triton"
    except FlashAttentionError:  # no Triton here: the torch ops compute it
        return False


class _Rotate(torch.autograd.Function):
    """The kernel's rotation with its gradient: dout rotated by the opposite angles."""

    @staticmethod
    def forward(ctx, x, cos, sin, positions, interleaved, inplace):
        from .kernels.triton.rotary import rotate_inplace
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved = interleaved
        if inplace:
            ctx.mark_dirty(x)
            return rotate_inplace(x, cos, sin, positions, interleaved)
        return rotate_inplace(x.clone(), cos, sin, positions, interleaved)

    @staticmethod
    def backward(ctx, dout):
        from .kernels.triton.rotary import rotate_inplace
        cos, sin, positions = ctx.saved_tensors
        dout = dout.clone() if dout.stride(-1) == 1 else dout.contiguous()
        return rotate_inplace(dout, cos, sin, positions, ctx.interleaved, inverse=True), None, None, None, None, None


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """rotate() in torch ops (differentiable by autograd)."""
    seqlen_ro, half = cos.shape
    inside = ((positions >= 0) & (positions < seqlen_ro))[..., None, None]
    at = positions.clamp(0, seqlen_ro - 1)
    c = torch.where(inside, cos.float()[at][..., None, :], 1.0)  # (..., 1, half)
    s = torch.where(inside, sin.float()[at][..., None, :], 0.0)
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def check_cos_sin(cos, sin, head_dim: int, device: torch.device, names=("cos", "sin")) -> None:
    """cos and sin: equal shapes (seqlen_ro, rotary_dim / 2), 2 * (rotary_dim / 2) <= head_dim."""
    for name, t in zip(names, (cos, sin)):
        check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if t.device != device:
            fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {t.device} but x is on {device}")
    if cos.shape != sin.shape or 2 * cos.shape[1] > head_dim:
        fail(ErrorCode.SHAPE_MISMATCH, f"{names[0]} {tuple(cos.shape)} and {names[1]} {tuple(sin.shape)} must "
             f"have the same shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim {head_dim}")


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotary embedding of x, flash-attn compatible (`flash_attn.layers.rotary.apply_rotary_emb`).

    Args:
        x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
        cos, sin: (seqlen_ro, rotary_dim / 2): row p rotates position p. Only the first rotary_dim
            dims of each head are rotated; the rest pass through.
        interleaved: rotate pairs (0, 1), (2, 3), ... (GPT-J) instead of the halves
            (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
        inplace: write the result into x and return x.
        seqlen_offsets: int or (batch,) int32/int64 tensor: token i of sequence b sits at position
            i + seqlen_offsets[b] (decoding after a KV cache).
        cu_seqlens: (batch + 1,) int32 prefix sums of a varlen batch (positions count from each
            sequence's start); max_seqlen: its longest sequence.
        interleaved and inplace are bools (validate.check_bool).
    Every position must have a row of cos and sin: seqlen <= seqlen_ro, and an int offset o needs
    o + seqlen <= seqlen_ro (as flash-attn asserts); a tensor of offsets on the CPU has each
    sequence's positions checked. Otherwise FlashAttentionError names cos. A tensor of offsets on the
    GPU is not read back (that would wait for the GPU): a token it puts outside the table is left
    unrotated, as flash-attn leaves it. (The module docstring states the rule for
    flash_attn_with_kvcache too.)
    Returns:
        x rotated, with x's shape and dtype (computed in fp32). Differentiable in x.
    """
    interleaved, inplace = check_bool("interleaved", interleaved), check_bool("inplace", inplace)
    if cu_seqlens is None:
        check_tensor("x", x, 4, "(batch, seqlen, nheads, headdim)")
        batch, seqlen = x.shape[:2]
    else:
        check_tensor("x", x, 3, "(total_seqlen, nheads, headdim) with cu_seqlens")
        if max_seqlen is None:
            fail(ErrorCode.INVALID_ARGUMENT, "max_seqlen must be given with cu_seqlens")
        batch = check_cu_seqlens("cu_seqlens", cu_seqlens, "max_seqlen", max_seqlen, x.shape[0], "x", x.device)
        seqlen = max_seqlen
    check_cos_sin(cos, sin, x.shape[-1], x.device)
    seqlen_ro = cos.shape[0]
    if seqlen > seqlen_ro:
        fail(ErrorCode.SHAPE_MISMATCH, f"cos has {seqlen_ro} positions (seqlen_ro) but x has sequences of "
             f"{seqlen} tokens; seqlen_ro must be >= seqlen")
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64) or tuple(seqlen_offsets.shape) != (batch,):
            fail(ErrorCode.INVALID_ARGUMENT, f"seqlen_offsets must be an int or an int32/int64 tensor of shape "
                 f"(batch,) = ({batch},), got {seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            fail(ErrorCode.DEVICE_MISMATCH, f"seqlen_offsets is on {seqlen_offsets.device} but x is on {x.device}")
        offsets = seqlen_offsets.long()
    elif isinstance(seqlen_offsets, int) and not isinstance(seqlen_offsets, bool) and seqlen_offsets >= 0:
        if seqlen_offsets + seqlen > seqlen_ro:
            fail(ErrorCode.INVALID_ARGUMENT, f"seqlen_offsets = {seqlen_offsets} puts tokens of x at positions up to "
                 f"{seqlen_offsets + seqlen - 1}, past the {seqlen_ro} rows of cos, sin (seqlen_ro): "
                 f"seqlen_offsets + seqlen must be <= seqlen_ro")
        offsets = torch.full((batch,), seqlen_offsets, dtype=torch.long, device=x.device)
    else:
        fail(ErrorCode.INVALID_ARGUMENT, f"seqlen_offsets must be an int >= 0 or a (batch,) integer tensor, "
             f"got {seqlen_offsets!r}")
    if cu_seqlens is None:
        lengths: torch.Tensor | int = seqlen
        positions = offsets[:, None] + torch.arange(seqlen, device=x.device)
    else:
        starts = cu_seqlens.long()
        lengths = starts.diff()
        owner = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths, output_size=x.shape[0])
        positions = torch.arange(x.shape[0], device=x.device) - starts[owner] + offsets[owner]
    if isinstance(seqlen_offsets, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling():
        _check_reach(offsets, lengths, seqlen_ro)
    return rotate(x, cos, sin, positions, interleaved, inplace)


def _check_reach(offsets: torch.Tensor, lengths: torch.Tensor | int, seqlen_ro: int) -> None:
    """Sequence b's tokens take positions offsets[b] .. offsets[b] + lengths[b] - 1 (none when it has
    no token; an int: every sequence's length): each within the seqlen_ro rows of cos, or
    FlashAttentionError (CPU tensors: the values are read here)."""
    lengths = torch.as_tensor(lengths).expand_as(offsets)
    outside = (lengths > 0) & ((offsets < 0) | (offsets + lengths > seqlen_ro))
    if outside.any():
        b = int(outside.nonzero()[0, 0])
        first, last = int(offsets[b]), int(offsets[b] + lengths[b] - 1)
        fail(ErrorCode.INVALID_ARGUMENT, f"seqlen_offsets[{b}] = {first} puts sequence {b}'s tokens at positions "
             f"{first} .. {last}, outside the {seqlen_ro} rows of cos, sin (seqlen_ro): every position must lie "
             f"in [0, seqlen_ro)")


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """Rotary embedding of the queries and keys of a packed qkv, in place (flash-attn's
    `flash_attn.layers.rotary.apply_rotary_emb_qkv_`).

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k,
            headdim) with num_heads_q (GQA / MQA: the query heads, then the keys', then the values').
        cos, sin: (seqlen_ro, rotary_dim / 2) for the queries; cos_k, sin_k the keys' (default the
            same); interleaved, seqlen_offsets: as apply_rotary_emb.
    Returns:
        qkv, its queries and keys rotated, its values untouched. Differentiable.
    """
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 5 and qkv.shape[2] == 3:
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    elif isinstance(qkv, torch.Tensor) and qkv.dim() == 4:
        if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int) or not 0 < num_heads_q < qkv.shape[2]:
            fail(ErrorCode.INVALID_ARGUMENT, f"a (batch, seqlen, heads, headdim) qkv needs num_heads_q, the count of "
                 f"its query heads, in 1 .. {qkv.shape[2] - 1}; got {num_heads_q!r}")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_q + 2 * num_heads_k != qkv.shape[2]:
            fail(ErrorCode.SHAPE_MISMATCH, f"qkv has {qkv.shape[2]} heads: not num_heads_q = {num_heads_q} plus "
                 f"twice a count of key heads")
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]
    else:
        fail(ErrorCode.INVALID_DIMENSION, f"qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, "
             f"num_heads_q + 2 * num_heads_k, headdim), got {tuple(getattr(qkv, 'shape', ()))}")
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, True,
                     seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotary embedding of the keys of a packed kv (batch, seqlen, 2, nheads, headdim), in place
    (flash-attn's `flash_attn.layers.rotary.apply_rotary_emb_kv_`); returns kv. Differentiable."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        fail(ErrorCode.INVALID_DIMENSION, f"kv must be (batch, seqlen, 2, nheads, headdim), got "
             f"{tuple(getattr(kv, 'shape', ()))}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's `flash_attn.layers.rotary.RotaryEmbedding`: rotary tables of `dim` dims (the
    frequencies base ** (-2i / dim)), built in fp32 for the positions seen so far and cached in the
    inputs' dtype, applied in place to a packed qkv, or to q and a packed kv.

    interleaved: GPT-J pairs, else GPT-NeoX halves. scale_base: xPos (Sun et al., 2022): the queries'
    tables times, the keys' divided by, ((2i + 0.4 dim) / (1.4 dim)) ** ((p - n // 2) / scale_base)
    at position p of tables built for n positions (flash-attn's rule).
    """

    inv_freq: torch.Tensor  # buffers (not saved in a state dict)
    scale: torch.Tensor | None

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        super().__init__()
        self.dim, self.base, self.interleaved, self.scale_base = dim, float(base), interleaved, scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", None if scale_base is None else self._scale(device), persistent=False)
        self._positions = 0  # how many positions the cached tables hold
        self._tables: tuple | None = None  # cos, sin, and with xPos the keys' cos_k, sin_k

    def _inv_freq(self, device) -> torch.Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _scale(self, device) -> torch.Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update(self, positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Rebuilds the tables for `positions` positions when they hold fewer, live on another device
        or dtype, or were made in inference mode and a training step needs them."""
        cached = self._tables[0] if self._tables is not None else None
        if (cached is not None and positions <= self._positions and cached.device == device and cached.dtype == dtype
                and not (self.training and cached.is_inference())):
            return
        self._positions = positions
        # fp32 throughout, whatever dtype a module-wide .half() gave the buffers: positions are large.
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:
            inv_freq = self._inv_freq(device)
        angles = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = angles.cos(), angles.sin()
        scale = self.scale
        if scale is None:
            self._tables = (cos.to(dtype), sin.to(dtype))
            return
        if scale.dtype != torch.float32:
            scale = self._scale(device)
        power = (torch.arange(positions, device=device, dtype=torch.float32) - positions // 2) / self.scale_base
        scale = scale.to(device) ** power[:, None]
        self._tables = tuple(t.to(dtype) for t in (cos * scale, sin * scale, cos / scale, sin / scale))

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        """qkv: packed as apply_rotary_emb_qkv_ takes it; or, with kv (batch, seqlen, 2, nheads_k,
        headdim), just q (batch, seqlen, nheads, headdim). seqlen_offset: int or (batch,) tensor; a
        tensor needs max_seqlen (the tables are built up to it). Rotates in place; returns qkv, or
        (q, kv)."""
        if max_seqlen is not None:
            self._update(max_seqlen, qkv.device, qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update(qkv.shape[1] + seqlen_offset, qkv.device, qkv.dtype)
        if self._tables is None:
            fail(ErrorCode.INVALID_ARGUMENT, "a tensor seqlen_offset needs max_seqlen, the positions to build the "
                 "rotary tables for")
        cos, sin, *keys = self._tables
        cos_k, sin_k = keys or (None, None)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, cos, sin, self.interleaved, True, seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                                       self.interleaved, seqlen_offset)
