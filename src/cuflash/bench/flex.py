"""cuflash bench --flex: programmable attention side by side, on the mods FlexAttention users write.

For each mod (causal, sliding window, ALiBi, softcap, document mask, prefix-LM), head dim and
sequence length (batch * seqlen = --tokens): cuflash.flex_attention, torch's flex_attention under
torch.compile (its Triton kernels), and cuflash's built-in option computing the same where it has
one (flash_attn_func with causal / window_size / alibi_slopes / softcap). Forward and backward times
(CUDA-event medians), their ratios, TFLOP/s of the keys each mod leaves visible, and the error of
each provider's forward against float64 on a smaller problem. Both flex providers take the same
block mask (torch's create_block_mask)."""
from __future__ import annotations

import math
import sys

import torch

from ..commandline import Parser, Progress, integer, integers, names, out_folder, run_guarded
from ..dtypes import dtype_name
from .harness import median_ms, write_csv

DOCUMENT = 2048  # tokens per document of the document mask
WINDOW = 1024
SOFTCAP = 30.0
ERROR_SEQLEN = 384  # the length of the problem each provider's error is measured on


def mods(seqlen: int, nheads: int, device) -> dict:
    """name -> (score_mod, mask_mod, the flash_attn_func options computing the same or None)."""
    slopes = torch.tensor([2 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device=device)
    docs = torch.arange(seqlen, device=device) // DOCUMENT
    prefix = seqlen // 4

    def causal(b, h, q, kv):
        return q >= kv

    def window(b, h, q, kv):
        return (q >= kv) & (q - kv < WINDOW)

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    def softcap(score, b, h, q, kv):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def document(b, h, q, kv):
        return (docs[q] == docs[kv]) & (q >= kv)

    def prefix_lm(b, h, q, kv):
        return (kv < prefix) | (q >= kv)

    return {"causal": (None, causal, dict(causal=True)),
            "window": (None, window, dict(causal=True, window_size=(WINDOW - 1, 0))),
            "alibi": (alibi, None, dict(alibi_slopes=slopes)),
            "softcap": (softcap, None, dict(softcap=SOFTCAP)),
            "document": (None, document, None),
            "prefix_lm": (None, prefix_lm, None)}


def visible_fraction(mask_mod, seqlen: int, device) -> float:
    """The share of (query, key) pairs a mask_mod leaves visible (1 without one), from a strided sample."""
    if mask_mod is None:
        return 1.0
    step = max(1, seqlen // 512)
    i = torch.arange(0, seqlen, step, device=device)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    return mask_mod(zero, zero, i[:, None], i[None, :]).float().mean().item()


def providers(name: str, spec, batch: int, seqlen: int, nheads: int, device):
    """provider -> fn(q, k, v) in (B, H, L, D), for the mod `name`."""
    import cuflash
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    score_mod, mask_mod, builtin = spec
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)  # (one per provider set: a case's own guards)
    out = {"cuflash-flex": lambda q, k, v: cuflash.flex_attention(q, k, v, score_mod=score_mod,
                                                                  block_mask=block_mask),
           "torch-flex": lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)}
    if builtin is not None:
        out["cuflash-builtin"] = lambda q, k, v: cuflash.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **builtin).transpose(1, 2)
    return out


def error_vs_oracle(fn, spec, head_dim: int, dtype, device, seqlen: int = ERROR_SEQLEN) -> float:
    """||out - ref|| / ||ref|| of fn against float64 attention with the mods applied elementwise."""
    score_mod, mask_mod, _ = spec
    q, k, v = (torch.randn(1, 2, seqlen, head_dim, dtype=dtype, device=device) for _ in range(3))
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(head_dim)
    b = torch.zeros((), dtype=torch.int32, device=device)
    h = torch.arange(2, device=device)[:, None, None]
    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).double()
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ v.double()
    return ((fn(q, k, v).double() - ref).norm() / ref.norm()).item()


def run(name: str, head_dim: int, seqlen: int, args, device) -> list[dict]:
    batch, nheads = max(1, args.tokens // seqlen), args.hidden // head_dim
    dtype = args.dtype
    torch._dynamo.reset()  # (torch.compile's recompiles of flex_attention would hit its limit over a sweep)
    spec = mods(seqlen, nheads, device)[name]
    fns = providers(name, spec, batch, seqlen, nheads, device)
    small_spec = mods(ERROR_SEQLEN, 2, device)[name]  # the error's smaller problem, 2 heads
    small = providers(name, small_spec, 1, ERROR_SEQLEN, 2, device)
    shape = (batch, nheads, seqlen, head_dim)
    q, k, v, do = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(4))
    share = visible_fraction(spec[1], seqlen, device)
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim * share
    rows = []
    for provider, fn in fns.items():
        row = dict(mod=name, provider=provider, seqlen=seqlen, batch=batch, nheads=nheads, head_dim=head_dim,
                   dtype=str(dtype).removeprefix("torch."), visible=round(share, 4))
        try:
            row["error"] = f"{error_vs_oracle(small[provider], small_spec, head_dim, dtype, device):.2e}"
            fwd = median_ms(lambda i: fn(q, k, v), args.iters, 3, device)
            out = fn(q, k, v)
            bwd = median_ms(lambda i: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), args.iters, 3,
                            device)
            row.update(fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4), fwd_tflops=round(flops / fwd / 1e9, 1),
                       bwd_tflops=round(2.5 * flops / bwd / 1e9, 1))
        except Exception as e:  # noqa: BLE001 -- a provider that cannot run this case says why, in its row
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    base = next((r for r in rows if r["provider"] == "cuflash-flex" and "fwd_ms" in r), None)
    for r in rows:
        if base is not None and "fwd_ms" in r and r is not base:
            r["flex_fwd_speedup"] = round(r["fwd_ms"] / base["fwd_ms"], 3)
            r["flex_bwd_speedup"] = round(r["bwd_ms"] / base["bwd_ms"], 3)
    return rows


def main(argv=None, prog: str = "python -m cuflash.bench --flex") -> int:
    p = Parser(prog=prog, description=__doc__)
    p.add_argument("--mods", type=names(tuple(mods(16, 1, "cpu"))), default=None, help="(default: all)")
    p.add_argument("--seqlens", type=integers(16), default=[2048, 4096, 8192, 16384])
    p.add_argument("--hdims", type=integers(16, 256), default=[128])
    p.add_argument("--dtype", type=dtype_name, default=torch.bfloat16)
    p.add_argument("--tokens", type=integer(1), default=16384)
    p.add_argument("--hidden", type=integer(1), default=2048)
    p.add_argument("--iters", type=integer(1), default=20)
    p.add_argument("--out", type=out_folder, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))

    def sweep() -> int:
        if not torch.cuda.is_available():
            raise RuntimeError("the flex sweep compares GPU kernels: it needs a CUDA GPU")
        device = torch.device("cuda")
        chosen = args.mods or list(mods(16, 1, "cpu"))
        cases = [(m, d, n) for m in chosen for d in args.hdims for n in args.seqlens]
        rows: list[dict] = []
        with Progress() as progress:
            for n, (name, head_dim, seqlen) in enumerate(cases):
                progress(f"case {n + 1}/{len(cases)}: {name} d={head_dim} n={seqlen}")
                done = run(name, head_dim, seqlen, args, device)
                for r in done:
                    print(", ".join(f"{k}={v}" for k, v in r.items()), flush=True)
                rows += done
                if args.out is not None:  # (after every case: a sweep cut short keeps what it measured)
                    write_csv(rows, args.out / "flex.csv")
        if args.out is not None:
            try:
                from .plot import flex_plot
                print(f"plot: {flex_plot(args.out / 'flex.csv', args.out / 'flex.png')}")
            except ImportError:
                print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 0
    return run_guarded(prog, sweep)
