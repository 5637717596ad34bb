"""The `cuflash` command (also `python -m cuflash`): demo, info, bench."""
from __future__ import annotations

import argparse
import platform
import sys

import torch

from .reference import ERROR_BOUNDS


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
        print(f"{device}: {name}; backend: {backend_name(torch.device(device), torch.float32)}")
    print("supported: fp16, bf16, fp32 (fp64 on the CPU path); head dims 1-256; any seqlen_q, seqlen_k; "
          "causal (bottom-right for flash_attn_func, top-left for SDPA); MQA/GQA; strided inputs")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cuflash", description="Exact FlashAttention-2 for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compute, check and time attention on the best device present")
    sub.add_parser("info", help="versions, device, backend and support matrix")
    sub.add_parser("bench", help="side-by-side benchmark (see `cuflash bench -h`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench.__main__ import main as bench_main
        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"demo": demo, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
