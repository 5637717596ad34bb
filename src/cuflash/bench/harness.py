"""Times cuflash and torch SDPA's backends on the same inputs, in one run, on one device.

FLOPs follow the FlashAttention papers: forward 4*B*H*Nq*Nk*D (halved when causal), backward 2.5x
forward; with v's head dim Dv apart (as FlashAttention-3 counts them), forward 2*B*H*Nq*Nk*(D + Dv) and
backward 2*B*H*Nq*Nk*(3D + 2Dv) (S, dQ and dK over D; dP and dV over Dv). Times are medians of
CUDA-event timings after warm-up, cycling through enough input sets that the L2 cache does not flatter small
problems. They time the device's work: the stream first sleeps long enough for the host to enqueue every
timed call, so that a short call whose host work outlasts its kernels is not timed as its host's (that,
the host's time to enqueue a call, is a column of its own).
"""
from __future__ import annotations

import contextlib
import csv
import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import cuflash
from cuflash import methods
from cuflash.reference import attention_reference

SDPA_BACKENDS = {
    "sdpa": None,  # torch's own choice (on the CPU, its flash kernel)
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
# naive and fa1 (cuflash.methods) time the algorithms FlashAttention-2 replaced; plain attention only.
# fa4: FlashAttention-4 (flash-attn-4's CuTe-DSL kernels), where `flash_attn.cute` imports.
PROVIDERS = ("cuflash", "naive", "fa1", "fa4") + tuple(SDPA_BACKENDS)
CUDA_ONLY = ("fa4", "sdpa-cudnn", "sdpa-efficient")  # no CPU kernel of these


# Variants (issue 4): cuflash's option against the same computation in torch SDPA where SDPA can
# express it (window and ALiBi as an attn_mask, as users of SDPA do), n/a where it cannot (softcap).
VARIANTS = ("none", "window", "alibi", "softcap", "mask", "dropout")
WINDOW = 512  # keys to the left of the diagonal (a Mistral-style sliding window)
SOFTCAP = 50.0
DROPOUT_P = 0.1


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    mode: str  # "fwd", "bwd" or "fwd+bwd"
    variant: str = "none"
    head_dim_v: int | None = None  # v's (and the output's) head dim; None: head_dim

    @property
    def dim_v(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def pairs(self) -> float:
        """(query, key) pairs attended per head: N^2 (halved when causal, as the papers count),
        or those inside the sliding window."""
        n = self.seqlen
        if self.variant == "window":
            right = 0 if self.causal else WINDOW
            return float(sum(min(i + right, n - 1) - max(i - WINDOW, 0) + 1 for i in range(n)))
        return n * n / (2 if self.causal else 1)

    def flops(self) -> float:
        products = 2.0 * self.batch * self.nheads * self.pairs()
        fwd, bwd = products * (self.head_dim + self.dim_v), products * (3 * self.head_dim + 2 * self.dim_v)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[self.mode]

    def bytes(self) -> float:
        """Fewest bytes moved: q, k, v, out read/written once (fwd), plus dout, dq, dk, dv (bwd); half of
        each of D's size (q, k, dq, dk), half of Dv's (v, out, dout, dv)."""
        one = self.batch * self.nheads * self.seqlen * (self.head_dim + self.dim_v) * torch.finfo(self.dtype).bits / 8
        return one * {"fwd": 2, "bwd": 4, "fwd+bwd": 5}[self.mode]


def _variant(case: Case, batch: int, seqlen: int, device) -> tuple[dict | None, dict | None, dict]:
    """Keyword arguments for (cuflash.flash_attn_func, or None to time cuflash's SDPA-compatible
    call with SDPA's arguments; F.scaled_dot_product_attention, or None where SDPA has no
    equivalent; the float64 oracle) computing the case's variant."""
    c = case.causal

    def grid():
        return torch.arange(seqlen, device=device)[:, None], torch.arange(seqlen, device=device)[None, :]

    if case.variant == "window":
        window = (WINDOW, 0 if c else WINDOW)
        rows, cols = grid()
        band = (cols >= rows - window[0]) & (cols <= rows + window[1])
        return dict(window_size=window), dict(attn_mask=band), dict(window_size=window)
    if case.variant == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / case.nheads) for i in range(case.nheads)], device=device)
        rows, cols = grid()
        bias = -slopes[:, None, None] * (rows - cols).abs()
        if c:
            bias = bias.masked_fill(cols > rows, float("-inf"))
        return (dict(causal=c, alibi_slopes=slopes), dict(attn_mask=bias.to(case.dtype)),
                dict(causal=c, alibi_slopes=slopes))
    if case.variant == "softcap":
        return dict(causal=c, softcap=SOFTCAP), None, dict(causal=c, softcap=SOFTCAP)
    if case.variant == "mask":
        # Key padding: the last eighth of each sequence is padding, one mask row per batch entry.
        mask = torch.zeros(batch, 1, 1, seqlen, dtype=torch.bool, device=device)
        mask[..., : seqlen - seqlen // 8] = True
        if c:
            rows, cols = grid()
            mask = mask & (cols <= rows)
        return None, dict(attn_mask=mask), dict(attn_mask=mask)
    if case.variant == "dropout":
        return None, dict(is_causal=c, dropout_p=DROPOUT_P), {}
    return None, dict(is_causal=c), dict(causal=c)


@functools.lru_cache(maxsize=None)
def fa4_version() -> str | None:
    """flash-attn-4's version where FlashAttention-4 imports, else None."""
    try:
        import flash_attn.cute  # noqa: F401
        from importlib.metadata import version
    except Exception:  # (not installed, or its CUDA libraries do not load)
        return None
    try:
        return version("flash-attn-4")
    except Exception:
        return "unknown version"


def _fa4_fn(case: Case, ours: dict | None):
    """FlashAttention-4 on the case's variant (plain, window, softcap: what its flash_attn_func
    takes), in torch's (B, H, N, D) layout; None for the others."""
    if case.variant not in ("none", "window", "softcap"):
        return None
    from flash_attn.cute import flash_attn_func as fa4
    options = ours or dict(causal=case.causal)
    # (this version returns (out, softmax_lse))
    return lambda q, k, v: fa4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               **options)[0].transpose(1, 2)


def _attention_fn(provider: str, case: Case, batch: int, seqlen: int, device):
    """fn(q, k, v) in torch's (B, H, N, D) layout computing the case's variant, or None."""
    ours, theirs, _ = _variant(case, batch, seqlen, device)
    if provider in ("naive", "fa1"):
        if case.variant != "none":
            return None
        return lambda q, k, v: methods.attention(provider, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 case.causal).transpose(1, 2)
    if provider == "cuflash":
        if ours is None:
            sdpa_options = theirs or {}
            return lambda q, k, v: cuflash.scaled_dot_product_attention(q, k, v, **sdpa_options)
        flash_options = ours
        return lambda q, k, v: cuflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       **flash_options).transpose(1, 2)
    if provider == "fa4":
        return _fa4_fn(case, ours)
    if theirs is None:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    name = SDPA_BACKENDS[provider]

    def fn(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, name)) if name else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, **theirs)
    return fn


def _inputs(case: Case, device, requires_grad: bool, sets: int):
    """`sets` lists of q, k, v and the output's gradient, in torch's (B, H, N, D) layout (v and the
    gradient with v's head dim)."""
    shape = (case.batch, case.nheads, case.seqlen)
    return [[torch.randn(*shape, d, dtype=case.dtype, device=device, requires_grad=requires_grad)
             for d in (case.head_dim, case.head_dim, case.dim_v, case.dim_v)] for _ in range(sets)]


def median_ms(step, iters: int, warmup: int, device: torch.device) -> float:
    """The median time of step(i) in ms over `iters` calls after `warmup` untimed ones: between CUDA
    events on a GPU (which time the host too where its work outlasts the kernels: device_ms_host_us),
    the wall time on the CPU."""
    for i in range(warmup):
        step(i)
    if device.type != "cuda":
        times = []
        for i in range(iters):
            start = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        step(i)
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms(device: torch.device) -> float:
    """How many cycles of torch.cuda._sleep take a millisecond on `device` (measured once)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)  # (warm)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return 20_000_000 / start.elapsed_time(end)


def device_ms_host_us(step, iters: int, warmup: int, device: torch.device) -> tuple[float, float | None]:
    """(median device time of step(i) in ms, median host time to enqueue it in us). On CUDA the stream
    sleeps first (twice the host time of an untimed pass, plus a millisecond) while the host enqueues
    the timed calls, each between two events, so the events time the device only; the host time is
    taken in that loop, with nothing holding the host back. On the CPU the time is the wall time and
    the host's time None."""
    if device.type != "cuda":
        return median_ms(step, iters, warmup, device), None
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(iters):
        step(i)
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    torch.cuda._sleep(int((2 * host_ms + 1) * _sleep_cycles_per_ms(device)))
    for i in range(iters):
        starts[i].record()
        begin = time.perf_counter()
        step(i)
        host.append((time.perf_counter() - begin) * 1e6)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), statistics.median(host)


def error_vs_oracle(provider: str, case: Case, device, seqlen: int = 512) -> float | None:
    """||out - ref|| / ||ref|| against float64 on a smaller problem of the same kind (None with
    dropout, whose output is random)."""
    if case.variant == "dropout":
        return None
    q, k, v = (torch.randn(1, 2, seqlen, d, dtype=case.dtype, device=device)
               for d in (case.head_dim, case.head_dim, case.dim_v))
    small = Case(1, seqlen, 2, case.head_dim, case.causal, case.dtype, case.mode, case.variant, case.head_dim_v)
    out = _attention_fn(provider, small, 1, seqlen, device)(q, k, v)
    options = _variant(small, 1, seqlen, device)[2]
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, causal_offset=0, **options)
    ref = ref.transpose(1, 2)
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_case(provider: str, case: Case, device="cuda", iters: int = 30, warmup: int = 5) -> dict:
    """One row of results: device time (ms), TFLOP/s, GB/s, the host's time to enqueue a call (us,
    CUDA only), peak memory (GB, CUDA only), error; or a note saying why there is none."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    row = {"provider": provider, "batch": case.batch, "seqlen": case.seqlen, "nheads": case.nheads,
           "head_dim": case.head_dim, "head_dim_v": case.dim_v, "causal": case.causal,
           "dtype": str(case.dtype).replace("torch.", ""), "mode": case.mode, "variant": case.variant}
    if provider == "fa4" and fa4_version() is None:
        return {**row, "note": "skipped: FlashAttention-4 (flash_attn.cute) does not import here"}
    fn = _attention_fn(provider, case, case.batch, case.seqlen, device)
    if fn is None:
        return {**row, "note": f"n/a: {provider} has no {case.variant}"}
    one = case.batch * case.nheads * case.seqlen * max(case.head_dim, case.dim_v) * torch.finfo(case.dtype).bits / 8
    if provider in ("sdpa-math", "naive") and case.batch * case.nheads * case.seqlen ** 2 * 4 > 8e9:
        return {**row, "note": "skipped: it would materialize the scores (> 8 GB)"}
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    sets = max(1, min(8, math.ceil(3 * l2 / (4 * one))))
    try:
        data = _inputs(case, device, case.mode != "fwd", sets)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        if case.mode == "fwd":
            with torch.no_grad():
                ms, host_us = device_ms_host_us(lambda i: fn(*data[i % sets][:3]), iters, warmup, device)
        elif case.mode == "bwd":
            outs = [fn(*d[:3]) for d in data]
            ms, host_us = device_ms_host_us(
                lambda i: torch.autograd.grad(outs[i % sets], data[i % sets][:3], data[i % sets][3], retain_graph=True),
                iters, warmup, device)
        else:
            ms, host_us = device_ms_host_us(
                lambda i: torch.autograd.grad(fn(*data[i % sets][:3]), data[i % sets][:3], data[i % sets][3]),
                iters, warmup, device)
        peak = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None
        err = error_vs_oracle(provider, case, device)
    except Exception as exc:  # an SDPA backend that does not support the case says why
        data = outs = None  # noqa: F841 (drop the inputs before handing their memory back)
        if cuda:
            torch.cuda.empty_cache()
        return {**row, "note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    return {**row, "ms": ms, "tflops": case.flops() / ms / 1e9, "gbps": case.bytes() / ms / 1e6,
            "host_us": host_us, "peak_gb": peak, "rel_err": err, "note": ""}


def write_csv(rows: list[dict], path) -> None:
    """run_case's rows as a CSV, one column per key any row has (rows with a note lack the timings), in a
    folder made if need be (out_folder checks that it can be, and makes nothing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
