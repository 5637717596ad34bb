"""The `cuflash` command (also `python -m cuflash`): demo, info, bench, generate, run, check, experiment.

Every problem ends as one line on stderr, `cuflash <command>: error: <what>`, and exit status 2
(argparse's errors alike); Ctrl-C as one line and 130; a reader that goes away (`| head`) quietly,
with 141 as a tool killed by SIGPIPE: commandline.run_guarded, for every command."""
from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .backend import backend_name, triton_version
from .commandline import (MODES, CommandError, Parser, Progress, integer, integers, names, out_folder,
                          positive_number, run_guarded)
from .datafiles import SEEDS, check_room
from .reference import ERROR_BOUNDS, attention_reference
from .validate import MAX_HEAD_DIM

# Multiply-adds of Q K^T (B x H x N x N x D) up to which run checks every output against float64
# attention; past it, a sample (reference_errors says which).
REFERENCE_WORK = 2**32
# float64 scores the reference holds at once (64 MB): a block of query rows, every batch entry and head.
SCORES_BUDGET = 2**23
def package_version() -> str:
    """The installed distribution's version (cuflash-attn), else the source's cuflash.__version__."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("cuflash-attn")
    except PackageNotFoundError:
        from . import __version__
        return __version__


# -- demo, info, generate -----------------------------------------------------------------------------

def demo(args) -> int:
    """Computes attention on the best device present, checks it against the float64 oracle and
    torch SDPA, and prints error and speed side by side."""
    from .bench.harness import Case, run_case
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


def gluon_available() -> bool:
    """Whether the installed Triton runs the Gluon kernels for Hopper (kernels/compat.py)."""
    if triton_version() is None:
        return False
    from .kernels.compat import GLUON_TRITON
    return GLUON_TRITON


def info(args) -> int:
    devices = []  # (found before anything is printed: a bad CUFLASH_BACKEND is the one line then)
    for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0) and gluon_available()
        devices.append(f"{device}: {name}; backend: {backend_name(torch.device(device), torch.float32)}"
                       + ("; long 16-bit attention at head dim 64/128: the Gluon kernels for Hopper (docs/backends.md)"
                          if hopper else ""))
    print(f"cuflash {package_version()}, python {platform.python_version()}, torch {torch.__version__}")
    print(f"triton {triton_version()}" if triton_version() else "triton not installed: the CPU path only")
    print("\n".join(devices))
    print("supported: fp16, bf16, fp32 (fp64 on the CPU path); head dims 1-512; any seqlen_q, seqlen_k; "
          "causal (bottom-right for flash_attn_func, top-left for SDPA); MQA/GQA; strided inputs; varlen; "
          "sliding window; ALiBi; softcap; dropout; SDPA attn_mask; KV cache (paged or contiguous); "
          "methods naive, fa1, fa2")
    return 0


def generate(args) -> int:
    from .datafiles import Meta, generate as write_problem
    meta = Meta(args.batch_size, args.num_heads, args.seq_len, args.head_dim, args.dtype, args.seed)
    folder, removed = write_problem(meta, Path(args.output_dir))
    print(f"wrote {folder}/Q.bin, K.bin, V.bin and meta.json: {meta.shape} {args.dtype} "
          f"({meta.nbytes() * 3 / 1e6:.1f} MB), seed {args.seed}"
          + (f"; removed the replaced problem's {', '.join(removed)}" if removed else ""))
    return 0


# -- run ----------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, progress: Progress, label: str):
    """fn() once to warm up (compilation), then the median of 3 timed calls (ms); of 1 where the
    warm-up took over a second."""
    progress(f"cuflash run: {label}, warm-up call")
    start = time.perf_counter()
    result = fn()
    _sync(device)
    repeats = 3 if time.perf_counter() - start < 1.0 else 1
    times = []
    for i in range(repeats):
        progress(f"cuflash run: {label}, timed call {i + 1} of {repeats}")
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


def float64_reference(q, k, v, dout=None, causal: bool = False, rows=None, progress=None) -> dict:
    """Float64 attention of q (B, Nq, H, D) on k, v (B, Nk, H, D), causal aligned to the bottom-right
    (every query row must see a key): "out" (B, R, H, D) and "lse" (B, H, R) of the query rows `rows`
    (default: all, R = Nq) and, given dout (B, Nq, H, D), their "dQ"; "dK" and "dV" (B, Nk, H, D) as
    well when the rows are all of them. The scores are held SCORES_BUDGET at a time (a block of query
    rows, every batch entry and head); the rest is O(N)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    every = rows is None
    rows = torch.arange(seqlen_q, device=q.device) if rows is None else rows.to(q.device)
    # (B, H, N, D), contiguous: each block's products then read K and V in place
    kd, vd = (t.transpose(1, 2).double().contiguous() for t in (k, v))
    cols = torch.arange(seqlen_k, device=q.device)
    parts: dict[str, list] = {"out": [], "lse": [], "dQ": []}
    # dK, dV summed over the blocks as (B, H, D, Nk): the products that way round run faster
    transposed = (batch, nheads, head_dim, seqlen_k)
    sums = {"dK": kd.new_zeros(transposed), "dV": kd.new_zeros(transposed)} if every and dout is not None else {}
    step = max(1, SCORES_BUDGET // (batch * nheads * seqlen_k))
    for start in range(0, len(rows), step):
        block = rows[start:start + step]
        if progress is not None:
            progress(f"cuflash run: float64 reference, query rows {start + len(block)} of {len(rows)}")
        qb = q[:, block].transpose(1, 2).double()
        s = torch.matmul(qb, kd.transpose(-1, -2)).mul_(scale)
        if causal:
            s.masked_fill_(cols > block[:, None] + seqlen_k - seqlen_q, float("-inf"))
        p = torch.softmax(s, dim=-1)
        # the largest probability of a row is exp(max score - lse): lse without another exp of the scores
        parts["lse"].append(s.amax(dim=-1) - p.amax(dim=-1).log())
        del s
        out = torch.matmul(p, vd)
        parts["out"].append(out)
        if dout is None:
            continue
        dob = dout[:, block].transpose(1, 2).double()
        ds = torch.matmul(dob, vd.transpose(-1, -2)).sub_((dob * out).sum(-1, keepdim=True)).mul_(p)
        parts["dQ"].append(torch.matmul(ds, kd).mul_(scale))
        if sums:
            sums["dK"] += torch.matmul(qb.transpose(-1, -2), ds).mul_(scale)
            sums["dV"] += torch.matmul(dob.transpose(-1, -2), p)
    result = {name: torch.cat(blocks, dim=2) for name, blocks in parts.items() if blocks}
    result |= {name: x.transpose(-1, -2) for name, x in sums.items()}
    return {name: x if name == "lse" else x.transpose(1, 2) for name, x in result.items()}


def _spaced(n: int, count: int) -> torch.Tensor:
    """min(n, count) (at least 1) evenly spaced indices of n, first and last included."""
    return torch.linspace(0, n - 1, max(1, min(n, count))).round().long().unique()


def reference_errors(results: dict, q, k, v, dout, causal: bool, progress: Progress) -> tuple[dict, str]:
    """Errors of `results` ("out" and, given dout, "dQ", "dK", "dV"; (B, N, H, D) as q) against float64
    attention, and what was sampled for size ("" when nothing was). Up to REFERENCE_WORK multiply-adds
    (B x H x N x N x D) every element is checked; past it, every element of evenly spaced heads while one
    head's work fits, else out and dQ on evenly spaced query rows of every head (dK and dV need every
    query row: not checked)."""
    batch, seqlen, nheads, head_dim = q.shape
    head_work = batch * seqlen * seqlen * head_dim
    if nheads * head_work <= REFERENCE_WORK:
        ref = float64_reference(q, k, v, dout, causal, progress=progress)
        return {name: _errors(x, ref[name]) for name, x in results.items()}, ""
    work = f"{nheads * head_work:.2g} multiply-adds, over the {REFERENCE_WORK:.2g} checked in full"
    if head_work <= REFERENCE_WORK:
        heads = _spaced(nheads, REFERENCE_WORK // head_work)
        qh, kh, vh = (t[:, :, heads] for t in (q, k, v))
        ref = float64_reference(qh, kh, vh, None if dout is None else dout[:, :, heads], causal, progress=progress)
        errors = {name: _errors(x[:, :, heads], ref[name]) for name, x in results.items()}
        return errors, f"{work}: every output on {len(heads)} of {nheads} heads ({_listed(heads)}), all query rows"
    rows = _spaced(seqlen, REFERENCE_WORK // (batch * nheads * seqlen * head_dim))
    ref = float64_reference(q, k, v, dout, causal, rows, progress)
    errors = {name: _errors(results[name][:, rows.to(q.device)], ref[name]) for name in ("out", "dQ")
              if name in results}
    return errors, (f"{work}: out{', dQ' if dout is not None else ''} on {len(rows)} of {seqlen} query rows "
                    f"({_listed(rows)}), all heads" + ("; dK, dV not checked (each needs every query row)"
                                                        if dout is not None else ""))


def _listed(indices: torch.Tensor) -> str:
    shown = [str(i) for i in indices.tolist()]
    return ", ".join(shown) if len(shown) <= 6 else ", ".join(shown[:3] + ["..."] + shown[-2:])


def _dout(folder: Path, meta, inputs: dict, digest: str, mode: str) -> tuple[torch.Tensor | None, int | None, list]:
    """dO for the backward: dO.bin where it was drawn for these inputs or given by the user, else
    drawn from the seed. Returns it (None for the forward), the seed it was drawn from (None where
    read) and notes on it."""
    from .datafiles import DTYPES, file_records, random_tensor, read_tensor
    if mode == "forward":
        return None, None, []
    path = folder / "dO.bin"
    record = file_records(folder).get("dO.bin")
    if path.is_file() and (record is None or record.get("inputs") == digest):
        notes = [] if record else ["dO.bin given (not drawn by cuflash): used as it is"]
        return read_tensor(path, meta.shape, DTYPES[meta.dtype]), None, notes
    seed = meta.seed + len(inputs)
    notes = ["dO.bin was drawn for other inputs: drawn again"] if path.is_file() else []
    return random_tensor(meta.shape, DTYPES[meta.dtype], seed), seed, notes + [f"dO.bin drawn from seed {seed}"]


def _output_sizes(meta, mode: str, dout_drawn: bool) -> dict[str, int]:
    """Bytes of each file run writes (logsumexp in fp32)."""
    sizes: dict[str, int] = {}
    if mode != "backward":
        sizes |= {"O.bin": meta.nbytes(), "logsumexp.bin": meta.numel() // meta.head_dim * 4}
    if mode != "forward":
        sizes |= {name: meta.nbytes() for name in ("dQ.bin", "dK.bin", "dV.bin")}
    return sizes | ({"dO.bin": meta.nbytes()} if dout_drawn else {}) | {"meta.json": 0}


def _format(e: dict) -> str:
    return (f"max abs {e['max_abs']:.2e}  mean abs {e['mean_abs']:.2e}  MSE {e['mse']:.2e}  "
            f"max rel {e['max_rel']:.2e}")


def run(args) -> int:
    """Runs a method on a problem folder. Whatever is wrong with the folder, the arguments or the room
    to write the outputs is found before anything is computed; the outputs are written under
    temporary names and renamed into place, and meta.json records those that were."""
    from . import methods
    from .datafiles import inputs_digest, read_inputs, read_meta, write_outputs
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda, but torch sees no CUDA GPU here (use --device cpu or auto)")
    folder = Path(args.data)
    meta = read_meta(folder)
    inputs = read_inputs(folder, meta)
    digest = inputs_digest(inputs)
    dout, dout_seed, notes = _dout(folder, meta, inputs, digest, args.mode)
    check_room(folder, _output_sizes(meta, args.mode, dout_seed is not None))
    for name, t in inputs.items():
        bad = (~torch.isfinite(t)).sum().item()
        if bad:
            print(f"cuflash run: warning: {name}.bin holds {bad} non-finite values (NaN or inf)", file=sys.stderr)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    blocks = {} if args.block_m is None and args.block_n is None else dict(block_m=args.block_m, block_n=args.block_n)
    # Files are (B, H, N, D); the methods take (B, N, H, D) views.
    q, k, v = (inputs[n].to(device).transpose(1, 2) for n in ("Q", "K", "V"))
    do = None if dout is None else dout.to(device).transpose(1, 2)
    with Progress() as progress:
        (out, lse), fwd_ms = _timed(lambda: methods.forward(args.compute, q, k, v, args.causal, **blocks), device,
                                    progress, f"{args.compute} forward")
        results, bwd_ms = {"out": out}, math.nan
        if do is not None:
            grads, bwd_ms = _timed(lambda: methods.backward(args.compute, do, q, k, v, out, lse, args.causal,
                                                            **blocks), device, progress, f"{args.compute} backward")
            results |= dict(zip(("dQ", "dK", "dV"), grads))
        errors, sampled = reference_errors(results, q, k, v, do, args.causal, progress)
    print(f"{args.compute} on {device} ({meta.shape} {meta.dtype}, causal={args.causal})")
    print(f"  forward  {fwd_ms:9.3f} ms   out: " + _format(errors["out"]))
    for i, name in enumerate(n for n in ("dQ", "dK", "dV") if n in results):
        label = f"  backward {bwd_ms:9.3f} ms" if i == 0 else " " * 24
        print(f"{label}   {name}: " + (_format(errors[name]) if name in errors else "not checked"))
    if sampled:
        print(f"  float64 reference sampled for size ({sampled})")
    files = [("O.bin", out.transpose(1, 2)), ("logsumexp.bin", lse)] if args.mode != "backward" else []
    files += [(f"{name}.bin", results[name].transpose(1, 2)) for name in ("dQ", "dK", "dV") if name in results]
    produced = {"inputs": digest, "method": args.compute, "causal": args.causal}
    records = {name: produced for name, _ in files}
    if dout_seed is not None:
        files.append(("dO.bin", dout))
        records["dO.bin"] = {"inputs": digest, "seed": dout_seed}
    written = write_outputs(folder, files, records)
    print(f"  errors against float64 attention; wrote {', '.join(written)} in {folder}"
          + "".join(f"; {note}" for note in notes))
    if not all(torch.isfinite(t).all() for t in results.values()):
        print("cuflash run: warning: the outputs hold non-finite values", file=sys.stderr)
    return 0


# -- check, experiment --------------------------------------------------------------------------------

def check(args) -> int:
    """Random problems through cuflash and torch SDPA, both against float64 attention. A case fails
    when cuflash's ||err|| / ||ref|| exceeds --tolerance (default: the dtype's bound) or its output
    holds a non-finite value; the first failure stops the run unless --no-stop-on-failure."""
    from .interface import flash_attn_func
    import torch.nn.functional as F
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtypes = [torch.float16, torch.bfloat16, torch.float32] if cuda else [torch.float32]
    shapes = [(2, 1, 1, 4, 4, 64), (2, 17, 17, 4, 2, 40), (1, 128, 300, 8, 8, 96), (2, 1000, 1000, 4, 4, 128),
              (1, 257, 129, 2, 1, 256)]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"cuflash check on {torch.cuda.get_device_name() if cuda else 'the CPU'}: errors against float64 "
          f"attention (max rel = max |err| / max |ref|); cuflash fails a case where ||err||/||ref|| exceeds "
          f"its bound")
    print(f"{'case':42s} {'impl':8s} {'max abs':>9s} {'mean abs':>9s} {'MSE':>9s} {'max rel':>9s} "
          f"{'||err||/||ref||':>15s}  bound")
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
                finite = bool(torch.isfinite(ours).all())
                err = errors["cuflash"]["rel_norm"]
                for impl, e in errors.items():
                    judged = f"  {'<=' if err <= bound else '> '} {bound:g}" if impl == "cuflash" else ""
                    print(f"{name if impl == 'cuflash' else '':42s} {impl:8s} {e['max_abs']:9.2e} "
                          f"{e['mean_abs']:9.2e} {e['mse']:9.2e} {e['max_rel']:9.2e} {e['rel_norm']:15.2e}{judged}")
                if finite and err <= bound:
                    continue
                failed += 1
                print("  ^ FAILED: " + (f"||err||/||ref|| = {err:.2e} above {bound:g}" if finite
                                         else "non-finite values in the output"))
                if not args.no_stop_on_failure:
                    print(f"stopped at the first failure ({total} cases run; --no-stop-on-failure runs them all)")
                    return 1
    print(f"{total - failed} of {total} cases within {'--tolerance' if args.tolerance else 'the bounds'}"
          + ("" if not failed else f"; {failed} FAILED"))
    return 1 if failed else 0


# The experiment's names: the methods as `cuflash run --compute` names them, and torch (its SDPA).
EXPERIMENT_NAMES = {"naive": "naive", "fa1": "fa1", "cuflash": "fa2", "sdpa": "torch"}


def experiment(args) -> int:
    """naive, fa1, fa2 (cuflash) and torch (SDPA) on the same problems, on the CPU and on the GPU when
    there is one: time and error per sequence length into one table, CSV and plot."""
    from .bench.harness import Case, run_case, write_csv
    from .dtypes import DTYPES
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:  # (a bad CUFLASH_BACKEND is one error here, not a failed row per case)
        backend_name(torch.device(device), DTYPES[args.dtype])
    runs = [(provider, device) for device in devices for provider in EXPERIMENT_NAMES]
    rows: list[dict] = []
    total = len(runs) * len(args.seqlens) * len(args.modes)
    with Progress(after_s=0) as progress:
        for mode in args.modes:
            for n in args.seqlens:
                case = Case(args.batch, n, args.nheads, args.head_dim, args.causal, DTYPES[args.dtype], mode)
                for provider, device in runs:
                    name = EXPERIMENT_NAMES[provider]
                    progress(f"[{len(rows) + 1}/{total}] {name} on {device}, {mode}, seqlen {n}")
                    row = run_case(provider, case, device, iters=3 if device == "cpu" else 20, warmup=1)
                    rows.append({**row, "provider": f"{name} ({device})", "device": device})
                    write_csv(rows, args.out / "experiment.csv")  # (a run cut short keeps what it measured)
    print(f"{'provider':16s} {'mode':8s} {'seqlen':>7s} {'ms':>10s} {'error':>9s}")
    for r in rows:
        timing = f"{r['ms']:10.3f}" if "ms" in r else f"{r.get('note', 'n/a'):>10s}"
        err = f"{r['rel_err']:9.1e}" if r.get("rel_err") is not None else f"{'n/a':>9s}"
        print(f"{r['provider']:16s} {r['mode']:8s} {r['seqlen']:7d} {timing} {err}")
    out = args.out
    try:
        from .bench.plot import plot
        title = f"B{args.batch} H{args.nheads} D{args.head_dim} {args.dtype}{' causal' if args.causal else ''}"
        print(f"wrote {out / 'experiment.csv'} and {plot(out / 'experiment.csv', out / 'experiment.png', title, 'ms')}")
    except ImportError:
        print(f"wrote {out / 'experiment.csv'} (no plot: matplotlib is not installed)")
    return 0


# -- the parser ---------------------------------------------------------------------------------------



def _parser() -> Parser:
    from .dtypes import dtype_name
    from .methods import METHODS
    parser = Parser(prog="cuflash", description="Exact FlashAttention-2 for PyTorch.")
    parser.add_argument("--version", action="version", version=f"cuflash {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compute, check and time attention on the best device present")
    sub.add_parser("info", help="versions, device, backend and support matrix")
    sub.add_parser("bench", help="side-by-side benchmark (see `cuflash bench -h`)", add_help=False)
    gen = sub.add_parser("generate", help="write random Q, K, V (B, H, N, D) and meta.json into B{b}_H{h}_S{s}_D{d}/")
    gen.add_argument("--batch-size", type=integer(1), default=1, help="B")
    gen.add_argument("--num-heads", type=integer(1), default=8, help="H")
    gen.add_argument("--seq-len", type=integer(1), default=1024, help="N")
    gen.add_argument("--head-dim", type=integer(1, MAX_HEAD_DIM), default=64, help="D")
    gen.add_argument("--dtype", type=dtype_name, default="fp32", help="fp16, bf16 or fp32 (or float16, ...)")
    gen.add_argument("--seed", type=integer(*SEEDS), default=0, help="Q, K, V are drawn from seed, seed+1, seed+2")
    gen.add_argument("--output-dir", default="data", help="the problem's folder is made in this one")
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
    chk.add_argument("--tolerance", type=positive_number, default=None,
                     help="fail a case whose ||err|| / ||ref|| exceeds this (default: the dtype's bound)")
    chk.add_argument("--no-stop-on-failure", action="store_true", help="run every case after a failure")
    exp = sub.add_parser("experiment", help="naive, fa1, fa2 and torch on the CPU (and the GPU) on the same problems: "
                                            "one table, CSV and plot")
    exp.add_argument("--seqlens", type=integers(1), default="128,256,512,1024", help="sequence lengths")
    exp.add_argument("--batch", type=integer(1), default=1)
    exp.add_argument("--nheads", type=integer(1), default=4)
    exp.add_argument("--head-dim", type=integer(1, MAX_HEAD_DIM), default=64)
    exp.add_argument("--dtype", type=dtype_name, default="fp32", help="fp16, bf16 or fp32 (16-bit on the GPU only)")
    exp.add_argument("--causal", action="store_true")
    exp.add_argument("--modes", type=names(MODES), default="fwd,fwd+bwd", help=f"from {','.join(MODES)}")
    exp.add_argument("--out", type=out_folder, default="experiment",
                     help="folder for experiment.csv and experiment.png")
    return parser


COMMANDS = {"demo": demo, "info": info, "generate": generate, "run": run, "check": check, "experiment": experiment}


def _dispatch(argv: list[str]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench.__main__ import main as bench_main
        return bench_main(rest, prog="cuflash bench")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return COMMANDS[args.command](args)


def main(argv=None) -> int:
    """The `cuflash` command; returns its exit status (argparse's exits included: nothing raises)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    words = [a for a in argv if not a.startswith("-")]
    return run_guarded("cuflash" + (f" {words[0]}" if words else ""), lambda: _dispatch(argv))


if __name__ == "__main__":
    sys.exit(main())
