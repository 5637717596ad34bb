"""cuflash bench (also python -m cuflash.bench): a side-by-side sweep of cuflash and torch SDPA,
printed as a table and written as CSV/markdown."""
from __future__ import annotations

import datetime
import platform
import sys

import torch

from ..commandline import MODES, CommandError, Parser, Progress, head_dims, head_dims_text, integer, integers, names, \
    out_folder, run_guarded
from ..dtypes import DTYPES, dtype_name
from ..validate import MAX_HEAD_DIM
from ..backend import backend_name, triton_version
from .harness import CUDA_ONLY, PROVIDERS, VARIANTS, Case, fa4_version, run_case, write_csv


def main(argv=None, prog: str = "python -m cuflash.bench") -> int:
    """The sweep (`--decode`: the decode sweep); `prog` names the command in its help and errors.
    Bad arguments exit through argparse (SystemExit 2); run_guarded turns the rest into one line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--decode" in argv:  # the decode sweep has its own options: `cuflash bench --decode -h`
        from .decode import main as decode_main
        return decode_main([a for a in argv if a != "--decode"], prog=f"{prog} --decode")
    if "--flex" in argv:  # programmable attention against torch's compiled flex_attention: `--flex -h`
        from .flex import main as flex_main
        return flex_main([a for a in argv if a != "--flex"], prog=f"{prog} --flex")
    p = Parser(prog=prog, description=__doc__,
               epilog="--decode: the KV-cache decode sweep (see --decode -h); --flex: score_mod/mask_mod against "
                      "torch's compiled flex_attention (see --flex -h)")
    p.add_argument("--providers", type=names(PROVIDERS), default="cuflash,sdpa-cudnn,sdpa-flash",
                   help=f"from {','.join(PROVIDERS)}")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes' subset: seqlens 2048,8192, head dims 64,128, fwd and bwd")
    p.add_argument("--seqlens", type=integers(1), default=None,
                   help="(default: 512,1024,2048,4096,8192,16384; 256,1024,4096 on the CPU)")
    p.add_argument("--hdims", type=head_dims(MAX_HEAD_DIM), default=None,
                   help="D (q, k and v) or D:Dv (v's head dim apart, as 192:128) (default: 64,128,256; 64 on the CPU)")
    p.add_argument("--dtype", default=None, type=dtype_name, help="fp16, bf16 or fp32 (default: bf16; fp32 on the CPU)")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--modes", type=names(MODES), default=None,
                   help=f"from {','.join(MODES)} (default: all; fwd,fwd+bwd on the CPU)")
    p.add_argument("--variants", type=names(VARIANTS), default="none",
                   help=f"from {','.join(VARIANTS)}: options timed against SDPA computing the same thing")
    p.add_argument("--tokens", type=integer(1), default=16384, help="batch * seqlen (the papers' setting)")
    p.add_argument("--hidden", type=integer(1), default=2048, help="nheads * head_dim")
    p.add_argument("--batch", type=integer(1), default=None, help="fixed batch (overrides --tokens)")
    p.add_argument("--nheads", type=integer(1), default=None, help="fixed nheads (overrides --hidden)")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="default: cuda where there is a GPU, else cpu with a one-minute default sweep")
    p.add_argument("--iters", type=integer(1), default=None, help="timed calls per case (default: 30; 3 on the CPU)")
    p.add_argument("--out", type=out_folder, default=None, help="folder for results.csv and results.md")
    args = p.parse_args(argv)
    defaults: tuple[list, list, list] = ([2048, 8192], [(64, 64), (128, 128)], ["fwd", "bwd"]) if args.quick else \
        ([512, 1024, 2048, 4096, 8192, 16384], [(64, 64), (128, 128), (256, 256)], list(MODES))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu":  # a sweep that finishes in about a minute on a few cores
            defaults = ([256, 1024, 4096], [(64, 64)], ["fwd", "fwd+bwd"])
            args.batch, args.nheads = args.batch or 1, args.nheads or 8
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda, but torch sees no CUDA GPU here (use --device cpu)")
    chosen: dict[str, object] = {}
    for name, default in zip(("seqlens", "hdims", "modes"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
            chosen[name] = ",".join(map(head_dims_text if name == "hdims" else str, default))
    widest = max(d for d, _ in args.hdims)
    if args.nheads is None and args.hidden < widest:
        p.error(f"argument --hidden: {args.hidden} leaves no head at head dim {widest}; "
                f"accepted: --hidden >= the largest of --hdims (or --nheads)")
    if args.dtype is None:
        args.dtype = chosen["dtype"] = "fp32" if args.device == "cpu" else "bf16"
    if args.iters is None:
        args.iters = chosen["iters"] = 3 if args.device == "cpu" else 30
    providers = args.providers
    if args.device == "cpu":
        providers = _cpu_providers(providers, ",".join(providers) == p.get_default("providers"))
        if not providers:
            raise CommandError("none of the providers runs on the CPU")
        chosen["providers"] = ",".join(providers)
    if chosen:
        print(f"cuflash bench on {args.device}: " + "; ".join(f"{k} {v}" for k, v in chosen.items())
              + (f"; batch {args.batch}, {args.nheads} heads" if args.device == "cpu" else ""), file=sys.stderr)
    if "cuflash" in providers:  # (a bad CUFLASH_BACKEND is one error here, not a failed row per case)
        backend_name(torch.device(args.device), DTYPES[args.dtype])
    return _sweep(args, providers)


def _sweep(args, providers: list[str]) -> int:
    """Times every case with every provider, prints the table and writes it under args.out."""
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    cases = [Case(args.batch or max(1, args.tokens // n), n, args.nheads or args.hidden // d, d, c,
                  DTYPES[args.dtype], m, variant, dv)
             for variant in args.variants for d, dv in args.hdims for c in causals for m in args.modes
             for n in args.seqlens]
    rows = []
    total = len(cases) * len(providers)
    with Progress(after_s=0) as progress:
        for i, case in enumerate(cases):
            for j, provider in enumerate(providers):
                progress(f"[{i * len(providers) + j + 1}/{total}] {provider} {case.variant} {case.mode} "
                         f"D={head_dims_text((case.head_dim, case.dim_v))} N={case.seqlen} causal={case.causal}")
                rows.append(run_case(provider, case, args.device, iters=args.iters,
                                     warmup=2 if args.device == "cpu" else 5))
                if args.out:  # (after every case: a sweep cut short keeps what it measured)
                    write_csv(rows, args.out / "results.csv")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    header = (f"{device} | torch {torch.__version__} | triton "
              f"{triton_version() or 'none'} | cuDNN {torch.backends.cudnn.version()} | "
              f"{datetime.date.today()} | python {platform.python_version()}")
    if "fa4" in providers:
        header += f" | flash-attn-4 {fa4_version() or 'not installed'}"
    table = _markdown(rows, providers, header, "GFLOP/s" if args.device == "cpu" else "TFLOP/s")
    print(table)
    if args.out:
        (args.out / "results.md").write_text(table + "\n")
        try:
            from .plot import plot
            print(f"plot: {plot(args.out / 'results.csv', args.out / 'results.png', header)}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def _cpu_providers(providers: list[str], default: bool) -> list[str]:
    """The providers that run on the CPU: the CUDA-only ones left out (with a note when the user named
    them), torch's own choice (its CPU flash kernel) added to the default list."""
    dropped = [name for name in providers if name in CUDA_ONLY]
    providers = [name for name in providers if name not in CUDA_ONLY]
    if default:
        providers.append("sdpa")
    elif dropped:
        print(f"cuflash bench: {', '.join(dropped)} run on CUDA only: left out", file=sys.stderr)
    return providers


def _key(row) -> tuple:
    dims = head_dims_text((row["head_dim"], row["head_dim_v"]))
    return row["variant"], row["mode"], row["batch"], row["nheads"], dims, row["seqlen"], row["causal"]


def _markdown(rows, providers, header, unit) -> str:
    """One line per case: TFLOP/s of each provider, cuflash's ratio to each of the others, cuflash's
    error and the host's time to enqueue one cuflash call (CUDA)."""
    others = [p for p in providers if p != "cuflash"]
    lines = [header, "",
             "| variant | mode | B | H | D | N | causal | " + " | ".join(f"{p} {unit}" for p in providers) + " | "
             + " | ".join(f"vs {p}" for p in others) + " | cuflash err | cuflash host us |",
             "|---" * (9 + len(providers) + len(others)) + "|"]
    scale = 1e3 if unit == "GFLOP/s" else 1.0
    keys = []
    for r in rows:
        key = _key(r)
        if key not in keys:
            keys.append(key)
    for key in keys:
        by = {r["provider"]: r for r in rows if _key(r) == key}
        tf = {p: by[p]["tflops"] * scale for p in providers if by.get(p, {}).get("tflops")}
        cells = [f"{tf[p]:.1f}" if tf.get(p) else "n/a" for p in providers]
        ratios = [f"{tf['cuflash'] / tf[p]:.2f}x" if tf.get("cuflash") and tf.get(p) else "n/a" for p in others]
        err = by.get("cuflash", {}).get("rel_err")
        err_cell = f"{err:.1e}" if err is not None else "n/a"
        host = by.get("cuflash", {}).get("host_us")
        host_cell = f"{host:.0f}" if host is not None else "n/a"
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells + ratios)
                     + f" | {err_cell} | {host_cell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_guarded("python -m cuflash.bench", main))
