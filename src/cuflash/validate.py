"""The argument checks every entry point shares: bad input is caught here, before any kernel runs,
as a FlashAttentionError (errors.fail) that names the argument, what it got and what is accepted."""
from __future__ import annotations

import math
import numbers
import operator

import torch

from .errors import ErrorCode, fail


# float64 is accepted on the CPU path only (it is what gradcheck needs).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = KERNEL_DTYPES + (torch.float64,)
# Head dims above 256 (up to 512: Gemma-style global layers) run on the Triton kernels only.
MAX_HEAD_DIM = 512


def check_tensor(name: str, t, ndim: int, layout: str, empty: bool = False) -> None:
    """empty: dims of size 0 (but the head dim) are accepted, where the function computes an empty
    result (torch SDPA's rule; flash-attn's for seqlen_k = 0)."""
    # Runs on every call: the common case reads cheap attributes only (t.device.type costs as much
    # as the rest together).
    if t is None:
        fail(ErrorCode.NULL_POINTER, f"{name} is None; expected a tensor of shape {layout}")
    if not isinstance(t, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT,
             f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.ndim != ndim:
        fail(ErrorCode.INVALID_DIMENSION,
             f"{name} must have {ndim} dimensions {layout}, got {t.ndim} with shape {tuple(t.shape)}")
    head_dim = t.shape[-1]
    if head_dim == 0:
        fail(ErrorCode.UNSUPPORTED_HEAD_DIM,
             f"{name} has head dim 0 (shape {tuple(t.shape)}); supported: 1 to {MAX_HEAD_DIM}")
    if t.numel() == 0 and not empty:
        fail(ErrorCode.EMPTY_TENSOR, f"{name} has no elements (shape {tuple(t.shape)}); every dimension must be >= 1")
    if t.dtype not in KERNEL_DTYPES and not (t.is_cpu and t.dtype in CPU_DTYPES):
        allowed = CPU_DTYPES if t.is_cpu else KERNEL_DTYPES
        fail(ErrorCode.UNSUPPORTED_DTYPE,
             f"{name} has dtype {t.dtype}; accepted on {t.device.type}: {', '.join(str(d) for d in allowed)}")
    if head_dim > 1 and t.stride(-1) != 1:
        fail(ErrorCode.NOT_CONTIGUOUS,
             f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}; "
             f"call .contiguous() on it")


def check_attention_inputs(q, k, v, names=("q", "k", "v"), empty: bool = False, value_dim: bool = True) -> None:
    """Checks q (B, Nq, H, D), k (B, Nk, Hk, D) and v (B, Nk, Hk, Dv) in flash-attn's layout (empty: see
    check_tensor). value_dim: v's head dim Dv may differ from D (FlashAttention-3/4's headdim_v, as
    DeepSeek's MLA (192, 128)), each up to MAX_HEAD_DIM; False for callers that take one head dim."""
    nq, nk, nv = names
    check_tensor(nq, q, 4, "(batch, seqlen_q, nheads, headdim)", empty)
    check_tensor(nk, k, 4, "(batch, seqlen_k, nheads_k, headdim)", empty)
    check_tensor(nv, v, 4, "(batch, seqlen_k, nheads_k, headdim_v)", empty)
    for name, t in ((nk, k), (nv, v)):
        if t.dtype != q.dtype:
            fail(ErrorCode.DTYPE_MISMATCH, f"{name} has dtype {t.dtype} but {nq} has {q.dtype}; all must match")
        if t.device != q.device:
            fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {t.device} but {nq} is on {q.device}; all must match")
    if k.shape[:3] != v.shape[:3]:
        fail(ErrorCode.SHAPE_MISMATCH, f"{nk} has shape {tuple(k.shape)} but {nv} has {tuple(v.shape)}; they must "
             f"match but for the head dim")
    if k.shape[0] != q.shape[0]:
        fail(ErrorCode.SHAPE_MISMATCH, f"{nk} has batch {k.shape[0]} but {nq} has batch {q.shape[0]}")
    head_dim = q.shape[3]
    if k.shape[3] != head_dim:
        fail(ErrorCode.SHAPE_MISMATCH, f"{nk} has head dim {k.shape[3]} but {nq} has {head_dim}; they must match")
    if head_dim > MAX_HEAD_DIM:
        fail(ErrorCode.UNSUPPORTED_HEAD_DIM, f"{nq} has head dim {head_dim}; supported: 1 to {MAX_HEAD_DIM}")
    if v.shape[3] != head_dim and not value_dim:
        fail(ErrorCode.SHAPE_MISMATCH, f"{nv} has head dim {v.shape[3]} but {nq} has {head_dim}; this function "
             f"takes one head dim for all three")
    if v.shape[3] > MAX_HEAD_DIM:
        fail(ErrorCode.UNSUPPORTED_HEAD_DIM, f"{nv} has head dim {v.shape[3]}; supported: 1 to {MAX_HEAD_DIM}")
    if (q.shape[2] % k.shape[2] if k.shape[2] else q.shape[2]) != 0:
        fail(ErrorCode.SHAPE_MISMATCH,
             f"{nq} has {q.shape[2]} heads, not a multiple of the {k.shape[2]} heads of {nk} (MQA/GQA needs one)")


def check_same(name: str, t, like: torch.Tensor, like_name: str, shape=None) -> None:
    """Checks that t matches `like` in dtype and device, and has `shape` (default like's)."""
    shape = tuple(like.shape) if shape is None else tuple(shape)
    check_tensor(name, t, len(shape), str(shape), empty=like.numel() == 0)
    if tuple(t.shape) != shape:
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} has shape {tuple(t.shape)}; expected {shape} to match {like_name}")
    if t.device != like.device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {t.device} but {like_name} is on {like.device}")


def resolve_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """The scale of q.k as a float: None gives 1/sqrt(head_dim); any finite real number is taken as
    it is (a Python or numpy number, or a one-element tensor), as flash-attn and torch SDPA take it:
    0 gives uniform attention over the visible keys, a negative scale favours the keys least like the
    query. NaN, infinities, bools and anything else raise, naming `name`."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = softmax_scale
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be a finite real number (0 and negative ones too) or None, "
             f"got {softmax_scale!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """A flag (causal, deterministic, interleaved, ...): a Python bool, the one type torch SDPA's
    is_causal and enable_gqa take (its schema refuses ints, numpy bools and tensors); anything
    else raises, naming `name`. Every entry point checks its flags here."""
    if type(value) is not bool:
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be a bool (True or False), got {value!r} "
             f"of type {type(value).__name__}")
    return value


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        fail(ErrorCode.INVALID_ARGUMENT, f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _window_bound(w) -> int | None:
    """An integer window bound as flash-attn indexes it (a Python or numpy int, a 0-d integer
    tensor), or None for anything else (bools, floats, tensors of other shapes or dtypes)."""
    if isinstance(w, bool) or (isinstance(w, torch.Tensor) and (w.ndim != 0 or w.dtype == torch.bool)):
        return None
    try:
        return operator.index(w)
    except TypeError:
        return None


def check_window(window_size) -> tuple[int, int]:
    """window_size in any form flash-attn accepts (it reads window_size[0] and window_size[1]): a
    tuple or list of two ints, a 2-element integer tensor or a pair of 0-d integer tensors; each
    bound >= -1 (-1: unbounded). Converted to Python ints here, once."""
    left = right = None
    if isinstance(window_size, (tuple, list)) or (isinstance(window_size, torch.Tensor) and window_size.ndim == 1):
        if len(window_size) == 2:
            left, right = (_window_bound(w) for w in window_size)
    if left is None or right is None or left < -1 or right < -1:
        fail(ErrorCode.INVALID_ARGUMENT,
             f"window_size must be a pair (left, right) of integers >= -1 (-1: unbounded): a tuple, a list or "
             f"an integer tensor of 2 elements, got {window_size!r}")
    return left, right


BLOCK_SIZES = (16, 32, 64, 128)


def check_blocks(block_m, block_n) -> tuple[int, int]:
    """Tile sizes asked for by the user (Br, Bc in the FlashAttention papers): None for the tuned
    table's (0), or powers of two from 16 to 128, both given or neither."""
    if block_m is None and block_n is None:
        return 0, 0
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or value not in BLOCK_SIZES:
            fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be one of {', '.join(map(str, BLOCK_SIZES))} (or both "
                 f"None for the tuned tiles), got {value!r}")
    return block_m, block_n


def check_softcap(softcap) -> float:
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap)
            or softcap < 0):
        fail(ErrorCode.INVALID_ARGUMENT, f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return float(softcap)


def check_alibi(alibi_slopes, batch: int, nheads: int, device: torch.device):
    """alibi_slopes: None, or fp32 of shape (nheads,) or (batch, nheads), without gradient."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"alibi_slopes must be a tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        fail(ErrorCode.SHAPE_MISMATCH, f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected "
             f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})")
    if alibi_slopes.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        fail(ErrorCode.UNSUPPORTED_FEATURE, "alibi_slopes requires grad; its gradient is not computed "
             "(flash-attn does not either): pass alibi_slopes.detach()")
    return alibi_slopes.contiguous()


def check_learnable_sink(learnable_sink, nheads: int, device: torch.device):
    """learnable_sink: None, or a (nheads,) tensor of q's heads in fp32, fp16 or bf16 (fp64 on the CPU
    path), on q's device; it may require grad. Returned contiguous (the kernels read it by position)."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"learnable_sink must be a tensor of shape (nheads,) or None, got "
             f"{type(learnable_sink).__name__}")
    if learnable_sink.dtype not in KERNEL_DTYPES and not (learnable_sink.is_cpu and learnable_sink.dtype in CPU_DTYPES):
        allowed = CPU_DTYPES if learnable_sink.is_cpu else KERNEL_DTYPES
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"learnable_sink has dtype {learnable_sink.dtype}; accepted on "
             f"{learnable_sink.device.type}: {', '.join(str(d) for d in allowed)}")
    if tuple(learnable_sink.shape) != (nheads,):
        fail(ErrorCode.SHAPE_MISMATCH, f"learnable_sink has shape {tuple(learnable_sink.shape)}; expected "
             f"(nheads,) = ({nheads},), one logit per query head")
    if learnable_sink.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"learnable_sink is on {learnable_sink.device} but q is on {device}")
    return learnable_sink.contiguous()


def check_cu_seqlens(name: str, cu_seqlens, max_name: str, max_seqlen, total: int | None, total_name: str,
                     device: torch.device, batch: int | None = None) -> int:
    """Checks int32 prefix sums cu_seqlens (batch + 1,) starting at 0, non-decreasing, ending at
    `total` (the rows of the tensor they index; None: they index none, as a paged cache's key
    counts), the longest sequence <= max_seqlen. Returns batch."""
    if not isinstance(cu_seqlens, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be an int32 tensor of shape (batch + 1,), "
             f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} must have shape (batch + 1,) with batch >= 1, "
             f"got {tuple(cu_seqlens.shape)}")
    if batch is not None and cu_seqlens.numel() != batch + 1:
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} has {cu_seqlens.numel()} entries but cu_seqlens_q has "
             f"{batch + 1}; both describe the same batch")
    if cu_seqlens.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {cu_seqlens.device} but q is on {device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        fail(ErrorCode.INVALID_ARGUMENT, f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    if not torch.compiler.is_compiling():  # the values need a host copy; a compiled graph trusts them
        values = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or min(lengths) < 0:
            fail(ErrorCode.INVALID_ARGUMENT, f"{name} must start at 0 and never decrease, got {values}")
        if total is not None and values[-1] != total:
            fail(ErrorCode.SHAPE_MISMATCH, f"{name} ends at {values[-1]} but {total_name} has {total} rows; "
                 f"they must be equal")
        if max(lengths) > max_seqlen:
            fail(ErrorCode.INVALID_ARGUMENT, f"{max_name}={max_seqlen} but the longest sequence in {name} "
                 f"has {max(lengths)} tokens")
    return cu_seqlens.numel() - 1


def check_block_table(block_table, batch: int, device: torch.device) -> int:
    """block_table (batch, max_blocks_per_seq) int32 on q's device; returns max_blocks_per_seq. Its
    values: check_pages."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
        fail(ErrorCode.SHAPE_MISMATCH, f"block_table must be an int32 tensor (batch, max_blocks_per_seq) with batch "
             f"= {batch}, got {tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
    if block_table.dtype != torch.int32:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"block_table must be int32, got {block_table.dtype}")
    if block_table.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"block_table is on {block_table.device} but q is on {device}")
    return block_table.shape[1]


def check_pages(block_table: torch.Tensor, num_blocks: int, page_block_size: int, lengths: torch.Tensor,
                source: str) -> None:
    """block_table's values: enough columns for each sequence's key count `lengths` ((batch,), given by the
    argument `source`), and the entries a sequence uses inside the pool of num_blocks pages (entries past
    a sequence's last page are never read and may hold anything)."""
    if torch.compiler.is_compiling():  # (the values need a host read; a compiled graph trusts them)
        return
    pages = (lengths.long() + page_block_size - 1) // page_block_size
    most = int(pages.max())
    if most > block_table.shape[1]:
        fail(ErrorCode.SHAPE_MISMATCH, f"block_table has {block_table.shape[1]} columns but sequence "
             f"{int(pages.argmax())} needs {most} pages of {page_block_size} keys ({source})")
    used = torch.arange(block_table.shape[1], device=block_table.device) < pages[:, None]
    outside = ((block_table < 0) | (block_table >= num_blocks)) & used
    if outside.any():
        b, j = (int(i) for i in outside.nonzero()[0])
        fail(ErrorCode.INVALID_ARGUMENT, f"block_table[{b}, {j}] = {int(block_table[b, j])} points outside the "
             f"{num_blocks} pages of k and v")


def check_seqused(name: str, seqused, batch: int, cu_seqlens: torch.Tensor, source: str,
                  device: torch.device) -> torch.Tensor | None:
    """seqused_q / seqused_k (FlashAttention-3's): None, or a (batch,) int32 tensor on q's device whose
    value b is from 0 to the rows sequence b has, as the checked prefix sums cu_seqlens give them (the
    argument `source` gives those). Its values are checked as cu_seqlens' are (check_cu_seqlens: a host
    read, which a compiled graph skips). Returns it contiguous (the kernels address it by position)."""
    if seqused is None:
        return None
    if not isinstance(seqused, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be None or an int32 tensor of shape (batch,) = ({batch},), "
             f"got {type(seqused).__name__}")
    if seqused.dtype != torch.int32:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"{name} must be int32, got {seqused.dtype}")
    if tuple(seqused.shape) != (batch,):
        fail(ErrorCode.SHAPE_MISMATCH, f"{name} must have shape (batch,) = ({batch},), got {tuple(seqused.shape)}")
    if seqused.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"{name} is on {seqused.device} but q is on {device}")
    if not torch.compiler.is_compiling():
        limits = cu_seqlens.diff()
        bad = (seqused < 0) | (seqused > limits)
        if bad.any():
            b = int(bad.nonzero()[0])
            rows = "query rows" if name.endswith("_q") else "keys"
            fail(ErrorCode.INVALID_ARGUMENT, f"{name}[{b}] = {int(seqused[b])} but sequence {b} has "
                 f"{int(limits[b])} {rows} ({source}); {name} must be from 0 to its sequence's {rows}")
    return seqused.contiguous()


def check_max_seqlen(name: str, max_seqlen) -> None:
    """A max_seqlen that the call does not read (no cu_seqlens beside it: FlashAttention-3 ignores it):
    None or an int >= 0."""
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        fail(ErrorCode.INVALID_ARGUMENT, f"{name} must be None or an int >= 0, got {max_seqlen!r}")


def check_attn_mask(attn_mask, shape: tuple, device: torch.device) -> torch.Tensor:
    """attn_mask: bool (True = attend) or floating (added to the logits), broadcastable to `shape`
    (batch, nheads, seqlen_q, seqlen_k); returns the broadcast view (no copy)."""
    if not isinstance(attn_mask, torch.Tensor):
        fail(ErrorCode.INVALID_ARGUMENT, f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        fail(ErrorCode.UNSUPPORTED_DTYPE, f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != device:
        fail(ErrorCode.DEVICE_MISMATCH, f"attn_mask is on {attn_mask.device} but query is on {device}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        fail(ErrorCode.UNSUPPORTED_FEATURE, "attn_mask requires grad; its gradient is not supported: "
             "pass attn_mask.detach()")
    try:
        return attn_mask.expand(shape)
    except RuntimeError:
        fail(ErrorCode.SHAPE_MISMATCH, f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
             f"{tuple(shape)} (..., nheads, seqlen_q, seqlen_k)")


def strided_head_dim(t) -> bool:
    """Whether t is a tensor whose last dim has more than one element and a stride other than 1
    (what check_tensor refuses as NOT_CONTIGUOUS, and torch's SDPA and FlexAttention take)."""
    return isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[-1] > 1 and t.stride(-1) != 1


MAX_ATTENTION_CHUNK = 2**31 - 1  # (an int32, as the kernels compute positions)


def check_attention_chunk(attention_chunk) -> int:
    """FlashAttention-3's attention_chunk: an int >= 0 (0: off), as an int."""
    if (isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int)
            or not 0 <= attention_chunk <= MAX_ATTENTION_CHUNK):
        fail(ErrorCode.INVALID_ARGUMENT, f"attention_chunk must be an int from 0 (off) to {MAX_ATTENTION_CHUNK}, "
             f"got {attention_chunk!r}")
    return attention_chunk
