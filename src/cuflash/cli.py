"""The `cuflash` command (also `python -m cuflash`): demo, info, bench, generate, run, check, experiment."""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .errors import MAX_HEAD_DIM
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
    from .ops import backend_name, gluon_kernels, triton_version
    print(f"cuflash {__version__}, python {platform.python_version()}, torch {torch.__version__}")
    print(f"triton {triton_version()}" if triton_version() else "triton not installed: the CPU path only")
    for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0) and gluon_kernels()
        print(f"{device}: {name}; backend: {backend_name(torch.device(device), torch.float32)}"
              + ("; long 16-bit attention at head dim 64/128: the Gluon kernels for Hopper (README: Backends)"
                 if hopper else ""))
    print("supported: fp16, bf16, fp32 (fp64 on the CPU path); head dims 1-256; any seqlen_q, seqlen_k; "
          "causal (bottom-right for flash_attn_func, top-left for SDPA); MQA/GQA; strided inputs; varlen; "
          "sliding window; ALiBi; softcap; dropout; SDPA attn_mask; KV cache (paged or contiguous); "
          "methods naive, fa1, fa2")
    return 0


def _fail(command: str, message: str) -> int:
    """One line naming the problem, exit status 2 (bad input; nothing written)."""
    print(f"cuflash {command}: error: {message}", file=sys.stderr)
    return 2


def generate(args) -> int:
    from .datafiles import DataError, Meta, generate as write_problem
    for key in ("batch_size", "num_heads", "seq_len", "head_dim"):
        if getattr(args, key) < 1:
            return _fail("generate", f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.head_dim > MAX_HEAD_DIM:
        return _fail("generate", f"--head-dim {args.head_dim}: supported head dims are 1 to {MAX_HEAD_DIM}")
    meta = Meta(args.batch_size, args.num_heads, args.seq_len, args.head_dim, args.dtype, args.seed)
    try:
        folder, removed = write_problem(meta, Path(args.output_dir))
    except DataError as exc:
        return _fail("generate", str(exc))
    print(f"wrote {folder}/Q.bin, K.bin, V.bin and meta.json: {meta.shape} {args.dtype} "
          f"({meta.nbytes() * 3 / 1e6:.1f} MB), seed {args.seed}"
          + (f"; removed the replaced problem's {', '.join(removed)}" if removed else ""))
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
    from .datafiles import (DTYPES, DataError, file_records, inputs_digest, random_tensor, read_inputs, read_meta,
                            read_tensor, record_files, write_tensor)
    from .errors import FlashAttentionError
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("run", "--device cuda, but torch sees no CUDA GPU here (use --device cpu or auto)")
    folder = Path(args.data)
    notes = []
    try:
        meta = read_meta(folder)
        inputs = read_inputs(folder, meta)
        digest = inputs_digest(inputs)
        dtype = DTYPES[meta.dtype]
        dout, dout_generated = None, False
        if args.mode != "forward":
            record = file_records(folder).get("dO.bin")
            if (folder / "dO.bin").exists() and (record is None or record.get("inputs") == digest):
                dout = read_tensor(folder / "dO.bin", meta.shape, dtype)
                if record is None:
                    notes.append("dO.bin given (not drawn by cuflash): used as it is")
            else:
                if (folder / "dO.bin").exists():
                    notes.append("dO.bin was drawn for other inputs: drawn again")
                dout, dout_generated = random_tensor(meta.shape, dtype, meta.seed + len(inputs)), True
    except DataError as exc:
        return _fail("run", str(exc))
    for name, t in inputs.items():
        bad = (~torch.isfinite(t)).sum().item()
        if bad:
            print(f"cuflash run: warning: {name}.bin holds {bad} non-finite values (NaN or inf)", file=sys.stderr)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    blocks = {} if args.block_m is None and args.block_n is None else dict(block_m=args.block_m, block_n=args.block_n)
    # Files are (B, H, N, D); the methods take (B, N, H, D) views.
    q, k, v = (inputs[n].to(device).transpose(1, 2) for n in ("Q", "K", "V"))
    try:
        (out, lse), fwd_ms = _timed(lambda: methods.forward(args.compute, q, k, v, args.causal, **blocks), device)
    except FlashAttentionError as exc:
        return _fail("run", str(exc))
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(ref_inputs[0], ref_inputs[1], ref_inputs[2], causal=args.causal)
    print(f"{args.compute} on {device} ({meta.shape} {meta.dtype}, causal={args.causal})")
    print(f"  forward  {fwd_ms:9.3f} ms   out: " + _format(_errors(out, ref_out)))
    written, produced = [], {"inputs": digest, "method": args.compute, "causal": args.causal}
    if args.mode != "backward":
        write_tensor(folder / "O.bin", out.transpose(1, 2))
        write_tensor(folder / "logsumexp.bin", lse)
        written += ["O.bin", "logsumexp.bin"]
    results = [out]
    if dout is not None:  # (read or drawn unless the mode is forward)
        do = dout.to(device).transpose(1, 2)
        grads, bwd_ms = _timed(lambda: methods.backward(args.compute, do, q, k, v, out, lse, args.causal, **blocks),
                               device)
        ref_grads = torch.autograd.grad(ref_out, ref_inputs, do.double())
        for i, name in enumerate(("dQ", "dK", "dV")):
            label = f"  backward {bwd_ms:9.3f} ms" if i == 0 else " " * 24
            print(f"{label}   {name}: " + _format(_errors(grads[i], ref_grads[i])))
            write_tensor(folder / f"{name}.bin", grads[i].transpose(1, 2))
            written.append(f"{name}.bin")
        results += list(grads)
        if dout_generated:
            write_tensor(folder / "dO.bin", dout)
            written.append("dO.bin")
            notes.append(f"dO.bin drawn from seed {meta.seed + len(inputs)}")
    records = {name: produced for name in written if name != "dO.bin"}
    if dout_generated:
        records["dO.bin"] = {"inputs": digest, "seed": meta.seed + len(inputs)}
    record_files(folder, records)
    print(f"  errors against float64 attention; wrote {', '.join(written)} in {folder}"
          + "".join(f"; {note}" for note in notes))
    if not all(torch.isfinite(t).all() for t in results):
        print("cuflash run: warning: the outputs hold non-finite values", file=sys.stderr)
    return 0


def _format(e: dict) -> str:
    return (f"max abs {e['max_abs']:.2e}  mean abs {e['mean_abs']:.2e}  MSE {e['mse']:.2e}  "
            f"max rel {e['max_rel']:.2e}")


def check(args) -> int:
    """Random problems through cuflash and torch SDPA, both against float64 attention. A case fails
    when cuflash's ||err|| / ||ref|| exceeds --tolerance (default: the dtype's bound) or its output
    holds a non-finite value; the first failure stops the run unless --no-stop-on-failure."""
    from .interface import flash_attn_func
    import torch.nn.functional as F
    if args.tolerance is not None and not args.tolerance > 0:
        return _fail("check", f"--tolerance must be a positive number, got {args.tolerance}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtypes = [torch.float16, torch.bfloat16, torch.float32] if cuda else [torch.float32]
    shapes = [(2, 1, 1, 4, 4, 64), (2, 17, 17, 4, 2, 40), (1, 128, 300, 8, 8, 96), (2, 1000, 1000, 4, 4, 128),
              (1, 257, 129, 2, 1, 256)]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"cuflash check on {torch.cuda.get_device_name() if cuda else 'the CPU'}: "
          f"errors against float64 attention (max rel = max |err| / max |ref|)")
    print(f"{'case':42s} {'impl':8s} {'max abs':>9s} {'mean abs':>9s} {'MSE':>9s} {'max rel':>9s}")
    failed = total = 0
    for dtype in dtypes:
        bound = args.tolerance if args.tolerance is not None else ERROR_BOUNDS[dtype]
        for batch, nq, nk, h, hk, d in shapes:
            for causal in (False, True):
                total += 1
                q = torch.randn(batch, nq, h, d, device=device, dtype=dtype, generator=gen)
                k, v = (torch.randn(batch, nk, hk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
                ref, _ = attention_reference(q, k, v, causal=causal)
                ours = flash_attn_func(q, k, v, causal=causal)
                mask = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq) if causal else None
                theirs = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        attn_mask=mask, enable_gqa=h != hk)
                theirs = torch.nan_to_num(theirs.transpose(1, 2), 0.0)
                name = f"{str(dtype)[6:]} B{batch} Nq{nq} Nk{nk} H{h}/{hk} D{d}{' causal' if causal else ''}"
                errors = {impl: _errors(x, ref) for impl, x in (("cuflash", ours), ("sdpa", theirs))}
                for impl, e in errors.items():
                    print(f"{name if impl == 'cuflash' else '':42s} {impl:8s} {e['max_abs']:9.2e} "
                          f"{e['mean_abs']:9.2e} {e['mse']:9.2e} {e['max_rel']:9.2e}")
                finite = bool(torch.isfinite(ours).all())
                err = errors["cuflash"]["rel_norm"]
                if finite and err <= bound:
                    continue
                failed += 1
                print("  ^ FAILED: " + (f"||err|| / ||ref|| = {err:.2e} above {bound:g}" if finite
                                         else "non-finite values in the output"))
                if not args.no_stop_on_failure:
                    print(f"stopped at the first failure ({total} cases run; --no-stop-on-failure runs them all)")
                    return 1
    print(f"{total - failed} of {total} cases within {'--tolerance' if args.tolerance else 'the bounds'}"
          + ("" if not failed else f"; {failed} FAILED"))
    return 1 if failed else 0


def experiment(args) -> int:
    """naive, fa1 and fa2 (cuflash) and torch SDPA on the same problems, on the CPU and on the GPU
    when there is one: time and error per sequence length into one table, CSV and plot."""
    from .bench.harness import Case, run_case, write_csv
    from .dtypes import DTYPES
    try:
        seqlens = [int(n) for n in args.seqlens.split(",")]
    except ValueError:
        return _fail("experiment", f"--seqlens must be integers separated by commas, got {args.seqlens!r}")
    if min(seqlens) < 1 or not 1 <= args.head_dim <= MAX_HEAD_DIM:
        return _fail("experiment", f"seqlens must be >= 1 and --head-dim in 1..{MAX_HEAD_DIM}")
    runs = [(p, "cpu") for p in ("naive", "fa1", "cuflash", "sdpa")]
    if torch.cuda.is_available():
        runs += [(p, "cuda") for p in ("naive", "fa1", "cuflash", "sdpa")]
    modes = args.modes.split(",")
    rows: list[dict] = []
    total = len(runs) * len(seqlens) * len(modes)
    for mode in modes:
        for n in seqlens:
            case = Case(args.batch, n, args.nheads, args.head_dim, args.causal, DTYPES[args.dtype], mode)
            for provider, device in runs:
                print(f"\r[{len(rows) + 1}/{total}] {provider} on {device}, {mode}, seqlen {n}    ", end="",
                      file=sys.stderr, flush=True)
                row = run_case(provider, case, device, iters=3 if device == "cpu" else 20, warmup=1)
                label = {"cuflash": "fa2", "sdpa": "torch"}.get(provider, provider)
                rows.append({**row, "provider": f"{label} ({device})", "device": device})
    print(file=sys.stderr)
    print(f"{'provider':16s} {'mode':8s} {'seqlen':>7s} {'ms':>10s} {'error':>9s}")
    for r in rows:
        timing = f"{r['ms']:10.3f}" if "ms" in r else f"{r.get('note', 'n/a'):>10s}"
        err = f"{r['rel_err']:9.1e}" if r.get("rel_err") is not None else f"{'n/a':>9s}"
        print(f"{r['provider']:16s} {r['mode']:8s} {r['seqlen']:7d} {timing} {err}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail("experiment", f"cannot create {out}: {exc.strerror or exc}")
    write_csv(rows, out / "experiment.csv")
    try:
        from .bench.plot import plot
        title = f"B{args.batch} H{args.nheads} D{args.head_dim} {args.dtype}{' causal' if args.causal else ''}"
        print(f"wrote {out / 'experiment.csv'} and {plot(out / 'experiment.csv', out / 'experiment.png', title, 'ms')}")
    except ImportError:
        print(f"wrote {out / 'experiment.csv'} (no plot: matplotlib is not installed)")
    return 0


def main(argv=None) -> int:
    from .dtypes import dtype_name
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
    gen.add_argument("--dtype", type=dtype_name, default="fp32", help="fp16, bf16 or fp32 (or float16, ...)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output-dir", default="data")
    run_p = sub.add_parser("run", help="run naive, fa1 or fa2 on a generated problem; writes O, logsumexp, dQ/dK/dV")
    run_p.add_argument("--compute", choices=METHODS, required=True)
    run_p.add_argument("--mode", choices=["forward", "backward", "both"], default="forward")
    run_p.add_argument("--data", required=True, help="a folder written by `cuflash generate`")
    run_p.add_argument("--causal", action="store_true")
    run_p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    run_p.add_argument("--block-m", type=int, default=None,
                       help="fa2's query rows per tile (Br): 16, 32, 64 or 128, with --block-n")
    run_p.add_argument("--block-n", type=int, default=None,
                       help="fa2's keys per tile (Bc): 16, 32, 64 or 128, with --block-m")
    chk = sub.add_parser("check", help="random problems vs torch SDPA and float64: max abs, mean abs, MSE, max rel")
    chk.add_argument("--seed", type=int, default=0)
    chk.add_argument("--tolerance", type=float, default=None,
                     help="fail a case whose ||err|| / ||ref|| exceeds this (default: the dtype's bound)")
    chk.add_argument("--no-stop-on-failure", action="store_true", help="run every case after a failure")
    exp = sub.add_parser("experiment", help="naive, fa1, fa2 and torch on the CPU (and the GPU) on the same problems: "
                                            "one table, CSV and plot")
    exp.add_argument("--seqlens", default="128,256,512,1024")
    exp.add_argument("--batch", type=int, default=1)
    exp.add_argument("--nheads", type=int, default=4)
    exp.add_argument("--head-dim", type=int, default=64)
    exp.add_argument("--dtype", type=dtype_name, default="fp32", help="fp16, bf16 or fp32 (16-bit on the GPU only)")
    exp.add_argument("--causal", action="store_true")
    exp.add_argument("--modes", default="fwd,fwd+bwd", help="from fwd,bwd,fwd+bwd")
    exp.add_argument("--out", default="experiment", help="folder for experiment.csv and experiment.png")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench.__main__ import main as bench_main
        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"demo": demo, "info": info, "generate": generate, "run": run, "check": check,
            "experiment": experiment}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
