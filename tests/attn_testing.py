"""Shared test helpers: random inputs, the float64 oracle, error bounds, torch's own SDPA."""
import contextlib
import dataclasses
import fcntl
import os
import tempfile
import zlib

import pytest
import torch
import torch.nn.functional as F

from cuflash.errors import FlashAttentionError
from cuflash.reference import ERROR_BOUNDS as BOUNDS, attention_reference
# The "never more than 2x torch's own error" rule applies above this floor. For fp32 it is the
# storage precision of the fp32 softmax_lse that every implementation keeps: at lse ~ 10-20
# (seqlen in the thousands) one ulp is 1e-6 to 2e-6, and exp(s - lse) carries that relative error
# into every gradient. Measured on an H200 at seqlen 4096: dK/dV 1.3-1.5e-6 with IEEE dots,
# 6.7e-7 with tf32x3 dots (Hopper), 6-9e-7 for torch's efficient kernel, all far under 1e-5.
ROUNDING_FLOOR = {torch.float32: 2e-6, torch.float16: 0.0, torch.bfloat16: 0.0, torch.float64: 1e-13}

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                               reason="needs TRITON_INTERPRET=1 (set by conftest when there is no GPU)")

GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CPU_DTYPES = [torch.float32, torch.float16]  # (the interpreter has no bf16 dot: bf16 runs in the gpu tests)


def dtype_cases(values: list, fp32_values: list, unpack: bool = False) -> list[tuple]:
    """GPU_DTYPES x values as (dtype, value) parameter tuples ((dtype, *value) with unpack), fp32 with
    fp32_values only: fp32 kernels (IEEE or tf32x3 dots) compile 2-3 times slower than 16-bit ones,
    and each new shape compiles a variant of its own, so the gpu suite takes fp32 on a few odd shapes
    of each test (cold, with 15 workers, it runs in under 5 minutes on an H100)."""
    assert all(v in values for v in fp32_values)
    return [(dtype, *v) if unpack else (dtype, v)
            for dtype in GPU_DTYPES for v in (fp32_values if dtype == torch.float32 else values)]


def case_id(value) -> str:
    """A test id for a dtype, a number or a shape tuple (2x17x300)."""
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def flash_fn(causal: bool):
    """flash_attn_func with this causality, as check_against_oracle takes it."""
    import cuflash
    return lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal)


def table_cell(q: torch.Tensor, head_dim: int, seqlen: int, banded: bool):
    """The launch table's entry (kernels/plan.py) for q's dtype at this head dim and length on this GPU."""
    from cuflash.kernels.plan import Length, entry
    major, minor = torch.cuda.get_device_capability()
    return entry(10 * major + minor, head_dim, q.dtype == torch.float32, False, Length.of(seqlen), banded)


def force_candidates(monkeypatch, **passes):
    """select() takes these candidates (forward=, dkdv=, dq=) instead of the table's; the plans made
    meanwhile stay in caches of their own (launch plans, and the checked call signatures that keep
    their own plans: memo.py)."""
    from cuflash import memo
    from cuflash.kernels import launch, plan
    table = plan.table_entry
    monkeypatch.setattr(plan, "table_entry", lambda prob, params: dataclasses.replace(table(prob, params), **passes))
    monkeypatch.setattr(launch, "PLANS", {})
    monkeypatch.setattr(memo, "CHECKED", {})


def count_plan_lookups(monkeypatch, module) -> list[str]:
    """The launcher (key[0]) name of each launch() lookup that `module` makes from now on, on the
    Triton backend with the checked call signatures forgotten: a call that finds its signature's plan
    adds nothing. The test reads and clears the list."""
    from cuflash import memo
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    monkeypatch.setattr(memo, "CHECKED", {})
    looked_up: list[str] = []
    real = module.launch

    def counting(key, tensors, build):
        looked_up.append(key[0].__name__)
        return real(key, tensors, build)
    monkeypatch.setattr(module, "launch", counting)
    return looked_up


def seed_of(*parts) -> int:
    """A seed from a test's parameters, the same in every process (hash() of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def strided_view(t: torch.Tensor) -> torch.Tensor:
    """The same values as t in a view whose last dim has stride 2 (every other element of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(x).all(), "non-finite values (unwritten or NaN output)"
    ref = ref.double()
    norm = ref.norm().item()
    diff = (x.double() - ref).norm().item()
    return diff / norm if norm > 0 else diff


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, device, layout="bnhd"):
    """Fresh random q, k, v in flash layout; layout 'bhnd' gives non-contiguous views of
    (B, H, N, D) buffers, as an SDPA user would hand over."""
    def make(n, h):
        if layout == "bhnd":
            return torch.randn(batch, h, n, head_dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(batch, n, h, head_dim, dtype=dtype, device=device)
    return make(seqlen_q, nheads), make(seqlen_k, nheads_k), make(seqlen_k, nheads_k)


def rising_qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype, device, rise, jump_at, jump):
    """q, k, v (flash layout) whose logits (times softmax_scale = head_dim ** -0.5) rise along the keys by
    `rise` a key, and by `jump` more from key `jump_at` on, with noise: each row's running maximum moves
    at every key tile, by less than a tile's rise or all at once, so an online softmax rescales (or keeps
    a stale maximum) tile after tile."""
    direction = torch.ones(head_dim, dtype=torch.float64, device=device) / head_dim ** 0.5
    keys = torch.arange(seqlen_k, dtype=torch.float64, device=device)
    logit = rise * keys + jump * (keys >= jump_at)  # q . k_j * head_dim ** -0.5 with q = sqrt(D) * direction
    q = head_dim ** 0.5 * direction + 0.3 * torch.randn(batch, seqlen_q, nheads, head_dim, dtype=torch.float64,
                                                        device=device)
    k = (logit[:, None, None] * direction + 0.3 * torch.randn(batch, seqlen_k, nheads, head_dim,
                                                              dtype=torch.float64, device=device))
    v = torch.randn(batch, seqlen_k, nheads, head_dim, dtype=torch.float64, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def torch_sdpa(q, k, v, causal):
    """torch's own SDPA in flash layout, bottom-right causal like flash-attn; empty rows -> 0."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    mask = None
    if causal and seqlen_q != seqlen_k:
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return torch.nan_to_num(out.transpose(1, 2), 0.0)


# A float64 oracle with more score bytes than this holds several score-sized tensors through its backward
# (2 x 8 heads x 3000 x 3000: about 6 GB). The GPU suite's 16 workers share one GPU, and four such oracles
# at once ran an H100 out of memory: one runs at a time (big_oracle).
BIG_ORACLE_BYTES = 2**29


@contextlib.contextmanager
def big_oracle(q: torch.Tensor, k: torch.Tensor):
    """While a float64 oracle over q (..., H, D) and k (N_k, H_k, D) of the flash layout runs: on a GPU,
    where its scores take more than BIG_ORACLE_BYTES, holds a lock file that the other test processes'
    big oracles wait for, and gives its memory back to the GPU before letting them go."""
    if q.device.type != "cuda" or q.numel() // q.shape[-1] * k.shape[-3] * 8 <= BIG_ORACLE_BYTES:
        yield
        return
    with one_at_a_time("cuflash-big-oracle"):
        try:
            yield
        finally:
            torch.cuda.empty_cache()


@contextlib.contextmanager
def one_at_a_time(name: str):
    """An exclusive lock between this machine's processes (a lock file named `name` in the temp dir)."""
    with open(os.path.join(tempfile.gettempdir(), f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_and_grad(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check_against_oracle(fn, q, k, v, causal, with_sdpa=True, grads=True, **options):
    """Runs fn(q, k, v) (flash layout) forward and backward and checks output and gradients
    against the float64 oracle (given `options` of attention_reference: window, softcap, ...),
    and against torch SDPA's own error in the same dtype."""
    dtype = q.dtype
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)  # (the output's: v's head dim)
    with big_oracle(q, k):
        ref = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=causal, **options)[0],
                           q.double(), k.double(), v.double(), dout.double())
    if grads:
        ours = run_and_grad(fn, q, k, v, dout)
    else:
        ours = (fn(q, k, v),)
    theirs = run_and_grad(lambda a, b, c: torch_sdpa(a, b, c, causal), q, k, v, dout) if with_sdpa else None
    # What fp32 itself can do: the same attention composed of torch ops in fp32. Large logits
    # (ALiBi at distances in the thousands) lose digits in any fp32 computation; the bound then
    # becomes 2x that error.
    fp32 = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=causal, dtype=torch.float32,
                                                            **options)[0], q, k, v, dout) \
        if dtype == torch.float32 and not with_sdpa else None
    errors = {}
    for i, name in enumerate(("out", "dq", "dk", "dv")[:len(ours)]):
        err = rel_err(ours[i], ref[i])
        errors[name] = err
        torch_err = rel_err(theirs[i], ref[i]) if theirs is not None else None
        bound = BOUNDS[dtype] if fp32 is None else max(BOUNDS[dtype], 2 * rel_err(fp32[i], ref[i]))
        if torch_err is not None and not ref[i].any():
            # The float64 gradient is exactly zero (one visible key: dS = P * (dP - delta) with
            # P = 1) and err is the absolute rounding left by the fused kernels' delta =
            # rowsum(dO * O), a norm that grows with the tensor's size. torch's fused backends leave
            # it too (its efficient fp32 kernel 8e-6 at B=2, H=4, D=128), its math backend does not
            # (0): the bound is the dtype's or 2x torch's, the larger.
            bound = max(bound, 2 * torch_err)
        assert err < bound, f"{name}: error {err:.3g} above the {dtype} bound {bound:g}"
        if torch_err is not None and ref[i].any():
            assert err <= max(2 * torch_err, ROUNDING_FLOOR[dtype]), \
                f"{name}: error {err:.3g} more than 2x torch SDPA's {torch_err:.3g}"
    return errors


def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding in float64 written with complex numbers (independent of the implementation's
    form): x (..., H, D) rotated at positions (shaped like x.shape[:-2]) on its first 2 * cos.shape[1]
    dims."""
    half = cos.shape[1]
    x = x.double()
    rot = x[..., :2 * half]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(rot[..., :half], rot[..., half:])
    angle = torch.polar(torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double()))[positions]
    z = z * angle[..., None, :]
    out = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, x[..., 2 * half:]), dim=-1)


def varlen_reference(q, k, v, cu_q, cu_k, **options):
    """The oracle, one sequence at a time: out (total_q, H, Dv) in float64."""
    return varlen_oracle(q, k, v, cu_q, cu_k, **options)[0]


def varlen_oracle(q, k, v, cu_q, cu_k, used_q=None, used_k=None, **options):
    """The oracle of a varlen batch, one sequence at a time (a mod's b is its index): out (total_q, H, Dv)
    and lse (H, total_q) in `dtype` (float64). used_q / used_k (lists, seqused_q / seqused_k's values):
    sequence b is attention over the first used_q[b] of its query rows and used_k[b] of its keys alone,
    its other rows out 0 and lse +inf."""
    dtype = options.get("dtype", torch.float64)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)  # (v's head dim)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        rows_q = slice(cu_q[b], cu_q[b + 1] if used_q is None else cu_q[b] + used_q[b])
        rows_k = slice(cu_k[b], cu_k[b + 1] if used_k is None else cu_k[b] + used_k[b])
        slopes, score_mod, mask_mod = (options.get(name) for name in ("alibi_slopes", "score_mod", "mask_mod"))
        seq_options = dict(
            options, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes,
            score_mod=None if score_mod is None else lambda s, b_, *rest, b=b, f=score_mod: f(s, b_ + b, *rest),
            mask_mod=None if mask_mod is None else lambda b_, *rest, b=b, f=mask_mod: f(b_ + b, *rest))
        out_b, lse_b = attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], **seq_options)
        out[rows_q], lse[:, rows_q] = out_b[0], lse_b[0]
    return out, lse


def varlen_batch(lens_q, lens_k, nheads, nheads_k, head_dim, dtype, device):
    """q (total_q, H, D), k, v (total_k, Hk, D) and the int32 prefix sums of a varlen batch."""
    cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), nheads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lens_k), nheads_k, head_dim, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, cu_q, cu_k


def paged_cache(k, v, cu_k, page, spare_pages=3, interleaved=False):
    """k, v (total_k, Hk, D) of a varlen batch moved into a paged cache (num_blocks, page, Hk, D)
    in shuffled pages, with pages nobody uses and garbage past each sequence's end: (k_cache,
    v_cache, block_table (batch, max pages + 1) int32, the unused column holding an out-of-pool
    index that must never be read). interleaved: k and v are views of one (num_blocks, 2, page, Hk, D)
    tensor (pages not contiguous in memory)."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    counts = [-(-n // page) for n in lengths]
    num_blocks = sum(counts) + spare_pages
    hk, d = k.shape[1:]
    pool = torch.randn(num_blocks, 2, page, hk, d, dtype=k.dtype, device=k.device)
    order = torch.randperm(num_blocks, device=k.device)
    table = torch.full((len(lengths), max(counts) + 1), 10**6, dtype=torch.int32, device=k.device)
    used = 0
    for b, (n, c) in enumerate(zip(lengths, counts)):
        pages = order[used:used + c]
        used += c
        table[b, :c] = pages.int()
        start = int(cu_k[b])
        for j in range(c):
            rows = slice(j * page, min((j + 1) * page, n))
            pool[pages[j], 0, :rows.stop - rows.start] = k[start + rows.start:start + rows.stop]
            pool[pages[j], 1, :rows.stop - rows.start] = v[start + rows.start:start + rows.stop]
    if interleaved:
        return pool[:, 0], pool[:, 1], table
    return pool[:, 0].contiguous(), pool[:, 1].contiguous(), table


def check_tile_loads(q, k, v, params, fwd, dkdv, dq, tol):
    """The kernels with their loops' tiles read through tensor descriptors (and the dK/dV loop
    warp-specialized) against the same launches with pointer loads: out, lse, dq, dk, dv agree
    within tol (relative)."""
    from cuflash.kernels import attention_backward, attention_forward
    from cuflash.kernels.plan import Entry

    dout = torch.randn_like(q)

    def run(f, b, d):
        out, lse = attention_forward(q, k, v, params, Entry((f,), (b,), (d,)))
        return (out, lse) + attention_backward(dout, q, k, v, out, lse, params, Entry((f,), (b,), (d,)))

    plain = [dataclasses.replace(c, tma=False, warp_specialize=False) for c in (fwd, dkdv, dq)]
    tma = [dataclasses.replace(fwd, tma=True), dataclasses.replace(dkdv, tma=True, warp_specialize=True),
           dataclasses.replace(dq, tma=True)]
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), run(*tma), run(*plain)):
        assert rel_err(got, ref) <= tol, name


def raises(code, *words):
    """Context manager: expects FlashAttentionError with `code` and each of `words` in the message."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(FlashAttentionError)
            self.info = self.ctx.__enter__()

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.code == code, f"expected {code.name}, got {err.code.name}: {err}"
            assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
            for w in words:
                assert w in str(err), f"{w!r} not in {str(err)!r}"
            return handled
    return _Check()


def poison_allocations(monkeypatch) -> None:
    """The Triton backend with fresh launch plans and call checks, whose outputs (kernels/attention.py's
    torch.empty_like) start as NaN: memory a kernel leaves unwritten shows in the results."""
    from cuflash import memo
    from cuflash.kernels import attention, launch
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    monkeypatch.setattr(launch, "PLANS", {})
    monkeypatch.setattr(memo, "CHECKED", {})

    class Poisoned:  # attention.py's torch, whose empty_like fills with NaN
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(t, **kwargs):
            return torch.full_like(t, float("nan"), **kwargs)

    monkeypatch.setattr(attention, "torch", Poisoned())
