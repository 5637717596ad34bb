"""The `cuflash` command (also `python -m cuflash`): demo, info, bench, generate, run, check."""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .reference import ERROR_BOUNDS, attention_reference


def demo(args) -> int:
    """Computes attention on the best device present, checks it against the float64 oracle and
    torch SDPA, and prints error and speed side by side."""
    from .bench.harness import Case, run_case
    from .ops import backend_name
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, seqlen, nheads, head_dim = (4, 2048, 16, 128) if cuda else (1, 1024, 8, 64)
    print(f"cuflash demo on {torch.cuda.get_device_name() if cuda else 'the CPU'}: backend "
          f"{backend_name(torch.device(device), dtype)}, {str(dtype).replace('torch.', '')}, batch {batch}, "
          f"seqlen {seqlen}, {nheads} heads, head dim {head_dim}")
    unit, scale = ("TFLOP/s", 1.0) if cuda else ("GFLOP/s", 1e3)
    print(f"\n{'provider':10s} {'mode':8s} {'causal':6s} {'ms':>9s} {unit:>9s} {'error':>9s}")
    ok = True
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            case = Case(batch, seqlen, nheads, head_dim, causal, dtype, mode)
            for provider in ("cuflash", "sdpa"):
                r = run_case(provider, case, device, iters=10 if cuda else 3, warmup=3 if cuda else 1)
                if "ms" not in r:
                    print(f"{provider:10s} {mode:8s} {causal!s:6s} {r['note']}")
                    continue
                print(f"{provider:10s} {mode:8s} {causal!s:6s} {r['ms']:9.2f} {r['tflops'] * scale:9.1f} "
                      f"{r['rel_err']:9.1e}")
                if provider == "cuflash" and not r["rel_err"] < ERROR_BOUNDS[dtype]:
                    ok = False
    print(f"\nerror: ||out - ref|| / ||ref|| against float64 attention (bound {ERROR_BOUNDS[dtype]:g}): "
          f"{'all within' if ok else 'OUT OF BOUNDS'}")
    return 0 if ok else 1


def info(args) -> int:
    from . import __version__
    from .ops import backend_name, triton_version
    print(f"cuflash {__version__}, python {platform.python_version()}, torch {torch.__version__}")
    print(f"triton {triton_version()}" if triton_version() else "triton not installed: the CPU path only")
    for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0) and _gluon_kernels()
        print(f"{device}: {name}; backend: {backend_name(torch.device(device), torch.float32)}"
              + ("; long 16-bit attention at head dim 64/128: the Gluon kernels for Hopper (README: Backends)"
                 if hopper else ""))
    print("supported: fp16, bf16, fp32 (fp64 on the CPU path); head dims 1-256; any seqlen_q, seqlen_k; "
          "causal (bottom-right for flash_attn_func, top-left for SDPA); MQA/GQA; strided inputs; varlen; "
          "sliding window; ALiBi; softcap; dropout; SDPA attn_mask; KV cache (paged or contiguous); "
          "methods naive, fa1, fa2")
    return 0


def _gluon_kernels() -> bool:
    """Whether the installed Triton runs the Gluon kernels (kernels/hopper_forward.py,
    hopper_backward.py: the same condition)."""
    from .ops import triton_version
    if triton_version() is None:
        return False
    from .kernels.forward import hopper_forward
    return hopper_forward is not None and hopper_forward.GLUON_TRITON


def generate(args) -> int:
    from .datafiles import Meta, generate as write_problem
    meta = Meta(args.batch_size, args.num_heads, args.seq_len, args.head_dim, args.dtype, args.seed)
    folder = write_problem(meta, Path(args.output_dir))
    print(f"wrote {folder}/Q.bin, K.bin, V.bin and meta.json: {meta.shape} {args.dtype} "
          f"({meta.nbytes() * 3 / 1e6:.1f} MB), seed {args.seed}")
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int = 3):
    """fn() once to warm up (compilation), then the median of `repeats` timed calls (ms)."""
    result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def _errors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """max abs, mean abs, MSE, max relative (max |err| / max |ref|) and ||err|| / ||ref||."""
    diff = (x.double() - ref.double()).abs()
    scale = ref.double().abs().max().item() or 1.0
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "mse": (diff ** 2).mean().item(),
            "max_rel": diff.max().item() / scale, "rel_norm": diff.norm().item() / (ref.double().norm().item() or 1.0)}


def run(args) -> int:
    """Runs a method on a problem folder; any problem with the folder exits with 2 before a file
    is written."""
    from . import methods
    from .datafiles import DTYPES, DataError, read_inputs, read_meta, read_tensor, random_tensor, write_tensor
    folder = Path(args.data)
    try:
        meta = read_meta(folder)
        inputs = read_inputs(folder, meta)
        dtype = DTYPES[meta.dtype]
        dout, dout_generated = None, False
        if args.mode != "forward":
            if (folder / "dO.bin").exists():
                dout = read_tensor(folder / "dO.bin", meta.shape, dtype)
            else:
                dout, dout_generated = random_tensor(meta.shape, dtype, meta.seed + len(inputs)), True
    except DataError as exc:
        print(f"cuflash run: error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    # Files are (B, H, N, D); the methods take (B, N, H, D) views.
    q, k, v = (inputs[n].to(device).transpose(1, 2) for n in ("Q", "K", "V"))
    (out, lse), fwd_ms = _timed(lambda: methods.forward(args.compute, q, k, v, args.causal), device)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*ref_inputs, causal=args.causal)
    print(f"{args.compute} on {device} ({meta.shape} {meta.dtype}, causal={args.causal})")
    print(f"  forward  {fwd_ms:9.3f} ms   out: " + _format(_errors(out, ref_out)))
    written = []
    if args.mode != "backward":
        write_tensor(folder / "O.bin", out.transpose(1, 2))
        write_tensor(folder / "logsumexp.bin", lse)
        written += ["O.bin", "logsumexp.bin"]
    if args.mode != "forward":
        do = dout.to(device).transpose(1, 2)
        grads, bwd_ms = _timed(lambda: methods.backward(args.compute, do, q, k, v, out, lse, args.causal), device)
        ref_grads = torch.autograd.grad(ref_out, ref_inputs, do.double())
        for i, name in enumerate(("dQ", "dK", "dV")):
            label = f"  backward {bwd_ms:9.3f} ms" if i == 0 else " " * 24
            print(f"{label}   {name}: " + _format(_errors(grads[i], ref_grads[i])))
            write_tensor(folder / f"{name}.bin", grads[i].transpose(1, 2))
            written.append(f"{name}.bin")
        if dout_generated:
            write_tensor(folder / "dO.bin", dout)
            written.append("dO.bin (generated from seed + 3)")
    print(f"  errors against float64 attention; wrote {', '.join(written)} in {folder}")
    return 0


def _format(e: dict) -> str:
    return (f"max abs {e['max_abs']:.2e}  mean abs {e['mean_abs']:.2e}  MSE {e['mse']:.2e}  "
            f"max rel {e['max_rel']:.2e}")


def check(args) -> int:
    """Random problems through cuflash and torch SDPA, both against float64 attention."""
    from .interface import flash_attn_func
    import torch.nn.functional as F
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtypes = [torch.float16, torch.bfloat16, torch.float32] if cuda else [torch.float32]
    shapes = [(2, 1, 1, 4, 4, 64), (2, 17, 17, 4, 2, 40), (1, 128, 300, 8, 8, 96), (2, 1000, 1000, 4, 4, 128),
              (1, 257, 129, 2, 1, 256)]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"cuflash check on {torch.cuda.get_device_name() if cuda else 'the CPU'}: "
          f"errors against float64 attention (max rel = max |err| / max |ref|)")
    print(f"{'case':42s} {'impl':8s} {'max abs':>9s} {'mean abs':>9s} {'MSE':>9s} {'max rel':>9s}")
    ok = True
    for dtype in dtypes:
        for batch, nq, nk, h, hk, d in shapes:
            for causal in (False, True):
                q = torch.randn(batch, nq, h, d, device=device, dtype=dtype, generator=gen)
                k, v = (torch.randn(batch, nk, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
                ref, _ = attention_reference(q, k, v, causal=causal)
                ours = flash_attn_func(q, k, v, causal=causal)
                mask = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq) if causal else None
                theirs = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        attn_mask=mask, enable_gqa=h != hk)
                theirs = torch.nan_to_num(theirs.transpose(1, 2), 0.0)
                name = f"{str(dtype)[6:]} B{batch} Nq{nq} Nk{nk} H{h}/{hk} D{d}{' causal' if causal else ''}"
                for impl, x in (("cuflash", ours), ("sdpa", theirs)):
                    e = _errors(x, ref)
                    print(f"{name if impl == 'cuflash' else '':42s} {impl:8s} {e['max_abs']:9.2e} "
                          f"{e['mean_abs']:9.2e} {e['mse']:9.2e} {e['max_rel']:9.2e}")
                    if impl == "cuflash" and not e["rel_norm"] < ERROR_BOUNDS[dtype]:
                        ok = False
                        print(f"  ^ ||err|| / ||ref|| = {e['rel_norm']:.2e} above the bound {ERROR_BOUNDS[dtype]:g}")
    print("all within bounds" if ok else "OUT OF BOUNDS")
    return 0 if ok else 1


def main(argv=None) -> int:
    from .datafiles import DTYPES
    from .methods import METHODS
    parser = argparse.ArgumentParser(prog="cuflash", description="Exact FlashAttention-2 for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compute, check and time attention on the best device present")
    sub.add_parser("info", help="versions, device, backend and support matrix")
    sub.add_parser("bench", help="side-by-side benchmark (see `cuflash bench -h`)", add_help=False)
    gen = sub.add_parser("generate", help="write random Q, K, V (B, H, N, D) and meta.json into B{b}_H{h}_S{s}_D{d}/")
    gen.add_argument("--batch-size", type=int, default=1)
    gen.add_argument("--num-heads", type=int, default=8)
    gen.add_argument("--seq-len", type=int, default=1024)
    gen.add_argument("--head-dim", type=int, default=64)
    gen.add_argument("--dtype", choices=DTYPES, default="float32")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output-dir", default="data")
    run_p = sub.add_parser("run", help="run naive, fa1 or fa2 on a generated problem; writes O, logsumexp, dQ/dK/dV")
    run_p.add_argument("--compute", choices=METHODS, required=True)
    run_p.add_argument("--mode", choices=["forward", "backward", "both"], default="forward")
    run_p.add_argument("--data", required=True, help="a folder written by `cuflash generate`")
    run_p.add_argument("--causal", action="store_true")
    run_p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    chk = sub.add_parser("check", help="random problems vs torch SDPA and float64: max abs, mean abs, MSE, max rel")
    chk.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench.__main__ import main as bench_main
        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "generate":
        for key in ("batch_size", "num_heads", "seq_len", "head_dim"):
            if getattr(args, key) < 1:
                parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return {"demo": demo, "info": info, "generate": generate, "run": run, "check": check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
