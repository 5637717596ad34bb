"""Context parallelism on several GPUs: correctness against one process, then per-GPU throughput of the
ring, the all-to-all, (with --inner) the hybrid and the ring over packed documents of --doc-tokens each
(packed: in contiguous shares; packed_zigzag: each document cut into 2W chunks, which balances the causal
work), against one GPU attending over the same per-GPU length (each rank's GPU alone, their mean; of such
documents; repeated to a rank's share of the work, so that both run about as long), and against one GPU
at its best, on one causal sequence of --ref-tokens (16k) tokens with the same heads, head dim and dtype
(one_gpu_16k_tflops_fwdbwd, efficiency_vs_16k_fwdbwd), with the time of each exchange and of the compute
beside it, and the most GPU memory a rank held.
Writes cp_bench.csv (a row per run) and cp_bench.png (efficiency against tokens).
Causal, bf16, D=128, 32 query heads and 8 KV heads by default.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --nproc_per_node=8 scripts/cp_bench.py \\
        --tokens 131072,1048576 --modes ring,ulysses --out benchmarks/results/h100x8
    PYTHONPATH=src torchrun --nproc_per_node=2 scripts/cp_bench.py --device cpu --tokens 256   # a smoke run
"""
import argparse
import csv
import os
import sys
import time

import torch
import torch.distributed as dist

import cuflash
from cuflash.distributed import context_parallel_attn_func, context_parallel_shard, ring_flash_attn_varlen_func
from cuflash.distributed.ring import packed_steps
from cuflash.distributed.shards import split_packed

FIELDS = ["world_size", "tokens", "tokens_per_gpu", "mode", "layout", "fwd_ms", "fwdbwd_ms", "tflops_per_gpu_fwd",
          "tflops_per_gpu_fwdbwd", "one_gpu_tflops_fwd", "one_gpu_tflops_fwdbwd", "efficiency_fwd",
          "efficiency_fwdbwd", "one_gpu_16k_tflops_fwdbwd", "efficiency_vs_16k_fwdbwd", "ring_steps", "step_ms",
          "exchange_ms", "step_bwd_ms", "exchange_bwd_ms", "peak_gib"]
TIMING = {"reps": 5, "warmup": 2}  # --reps, --warmup


def timed(fn, device) -> float:
    """Median milliseconds of fn() over TIMING's reps after its warmup runs, every rank starting together."""
    reps, warmup = TIMING["reps"], TIMING["warmup"]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def problem(tokens, args, dtype, device, packed: bool, seed=0):
    """q, k, v, dout of `tokens` tokens: (1, tokens, heads, dim), or packed (tokens, heads, dim)."""
    torch.manual_seed(seed)
    shape = (tokens,) if packed else (1, tokens)
    return [torch.randn(*shape, h, args.dim, dtype=dtype, device=device)
            for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]


def setup(mesh, mode, tokens, args, device):
    """The calls on a problem of `tokens` tokens: (this rank's shard of a whole tensor; the
    context-parallel call on shards; the one-process call on whole tensors; its causal FLOPs; the
    ring steps it takes, 1 for the all-to-all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not mode.startswith("packed"):
        return (lambda t: context_parallel_shard(t, mesh, args.layout),
                lambda a, b, c: context_parallel_attn_func(a, b, c, mesh, causal=True, layout=args.layout, mode=mode),
                lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True),
                4 * args.heads * tokens * tokens * args.dim / 2, mesh.size(0) if mode == "ring" else 1)
    # Packed documents of doc_tokens (the last one shorter), one (total, heads, dim) batch.
    lengths = [min(args.doc_tokens, tokens - start) for start in range(0, tokens, args.doc_tokens)]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    longest = max(lengths)
    layout = packed_layout(mode)
    steps = world if layout == "zigzag" else \
        len(packed_steps(cu.tolist(), rank, world, tokens // world, True, 1.0, torch.device("cpu")))
    return (lambda t: split_packed(t, cu, world, layout)[rank],
            lambda a, b, c: ring_flash_attn_varlen_func(a, b, c, cu, longest, group=mesh.get_group(0), causal=True,
                                                        layout=layout),
            lambda a, b, c: cuflash.flash_attn_varlen_func(a, b, c, cu, cu, longest, longest, causal=True),
            sum(4 * args.heads * n * n * args.dim / 2 for n in lengths), steps)


def packed_layout(mode: str) -> str:
    """How a packed mode cuts the documents among the ranks (cuflash.distributed.shards)."""
    return "zigzag" if mode == "packed_zigzag" else "contiguous"


def check(mesh, mode, args, device, dtype):
    """Relative error of out, dq, dk, dv against one process on the whole sequence (every rank)."""
    shard, attend, whole, _, _ = setup(mesh, mode, args.check_tokens, args, device)
    q, k, v, dout = problem(args.check_tokens, args, dtype, device, mode.startswith("packed"))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = whole(*full)
    ref.backward(dout)
    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*local)
    out.backward(shard(dout))
    errors = {}
    for name, mine, theirs in (("out", out.detach(), ref), ("dq", local[0].grad, full[0].grad),
                               ("dk", local[1].grad, full[1].grad), ("dv", local[2].grad, full[2].grad)):
        theirs = shard(theirs.detach()).float()
        errors[name] = ((mine.float() - theirs).norm() / theirs.norm()).item()
    return errors


def mean_over_ranks(values: list[float], device) -> list[float]:
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def peak_gib(device) -> float:
    """The most GPU memory any rank's allocator held since its last reset, in GiB (nan on the CPU)."""
    if device.type != "cuda":
        return float("nan")
    peak = torch.tensor([float(torch.cuda.max_memory_allocated(device))], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() / 2**30


def exchange_ms(mesh, mode, tensors, device) -> float:
    """One exchange of `tensors`: a hop around the ring (ring, packed: each to the next rank, from the
    previous), or an all-to-all of each (ulysses; the hybrid's within a node)."""
    ring = mode == "ring" or mode.startswith("packed")
    group = mesh.get_group(0 if ring else mesh.ndim - 1)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if ring:
        nxt, prv = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
        recv = [torch.empty_like(t) for t in tensors]

        def hop():
            ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
            ops += [dist.P2POp(dist.irecv, r, prv, group) for r in recv]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return timed(hop, device)
    parts = [[p.contiguous() for p in t.chunk(size, dim=-2)] for t in tensors]
    recv = [[torch.empty_like(p) for p in ps] for ps in parts]

    def all_to_all():
        for r, p in zip(recv, parts):
            dist.all_to_all(r, p, group=group)
    return timed(all_to_all, device)


def exchanges(mesh, mode, q, k, v, fwd_ms, fwdbwd_ms, steps, device) -> dict:
    """Each exchange beside the compute around it. The ring (exchange_ms: one hop of K/V) gathers the
    other ranks' K/V before its first step (steps - 1 hops, under KV_PREFETCH_BYTES; past it each hop
    runs beside a step, step_ms = fwd_ms / steps); its backward gathers them again, and each of its steps
    (step_bwd_ms, the backward's share) runs beside a hop of the fp32 dK/dV accumulators
    (exchange_bwd_ms: a hop of K/V and of dK/dV together); a ring of one step exchanges nothing (0).
    The all-to-all's exchanges (q, k, v; the backward: dout, dq, dk, dv) run between its computations,
    once per call."""
    ring = mode == "ring" or mode.startswith("packed")
    grads = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)] if ring else [q, q, k, v]
    moves = not ring or steps > 1
    return dict(ring_steps=steps, step_ms=fwd_ms / steps,
                exchange_ms=exchange_ms(mesh, mode, [k, v] if ring else [q, k, v], device) if moves else 0.0,
                step_bwd_ms=(fwdbwd_ms - fwd_ms) / steps,
                exchange_bwd_ms=exchange_ms(mesh, mode, ([k, v] if ring else []) + grads, device) if moves else 0.0)


def run(mesh, mode, tokens, args, device, dtype) -> dict:
    world = dist.get_world_size()
    per_gpu = tokens // world
    _, attend, _, flops, steps = setup(mesh, mode, tokens, args, device)
    # Timing needs no whole problem: each rank draws its shard's shape (cutting shards out of the
    # whole problem built on every rank took 20 GiB a rank at 1M tokens, beside the call's own).
    packed = mode.startswith("packed")
    *local, local_dout = problem(per_gpu, args, dtype, device, packed, seed=1 + dist.get_rank())
    local = [t.requires_grad_() for t in local]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd = timed(lambda: attend(*local), device)
    both = timed(lambda: torch.autograd.grad(attend(*local), local, local_dout), device)
    peak = peak_gib(device)
    _, _, whole, one_flops, _ = setup(mesh, mode, per_gpu, args, device)
    one = [t.requires_grad_() for t in problem(per_gpu, args, dtype, device, packed)[:3]]
    # The one-GPU call runs as many times back to back as a rank's share of the work holds its work
    # (world times for a causal sequence, once for packed documents), so that both timings last
    # about as long: under seconds of load the GPUs reach their power cap and their clocks fall.
    repeat = max(1, round(flops / world / one_flops))
    one_fwd = timed(lambda: [whole(*one) for _ in range(repeat)], device) / repeat
    one_both = timed(lambda: [torch.autograd.grad(whole(*one), one, torch.ones_like(one[0]))
                              for _ in range(repeat)], device) / repeat
    # Every rank times its own GPU alone; the baseline is their mean throughput: GPUs of one host
    # differ (on a 4-H100 host one ran 10-14% slower than the others under their power cap), and a
    # context-parallel call goes at its slowest rank's pace.
    one_tflops_fwd, one_tflops_both = mean_over_ranks([one_flops / one_fwd / 1e9, 3.5 * one_flops / one_both / 1e9],
                                                      device)
    row = dict(world_size=world, tokens=tokens, tokens_per_gpu=per_gpu, mode=mode,
               layout=packed_layout(mode) if packed else args.layout, fwd_ms=fwd,
               fwdbwd_ms=both, tflops_per_gpu_fwd=flops / world / fwd / 1e9,
               tflops_per_gpu_fwdbwd=3.5 * flops / world / both / 1e9,
               one_gpu_tflops_fwd=one_tflops_fwd, one_gpu_tflops_fwdbwd=one_tflops_both,
               peak_gib=peak, **exchanges(mesh, mode, *(t.detach() for t in local), fwd, both, steps, device))
    row["efficiency_fwd"] = row["tflops_per_gpu_fwd"] / row["one_gpu_tflops_fwd"]
    row["efficiency_fwdbwd"] = row["tflops_per_gpu_fwdbwd"] / row["one_gpu_tflops_fwdbwd"]
    return row


def one_gpu_at_its_best(args, device, dtype) -> float:
    """Forward+backward TFLOP/s of one GPU on one causal sequence of --ref-tokens tokens (16k, where a
    GPU runs at its best), with the benchmark's heads, head dim and dtype: each rank's GPU alone, their
    mean. Eight calls back to back per timing, so that the GPUs run under load as in the other timings."""
    tokens = args.ref_tokens
    q, k, v = (t.requires_grad_() for t in problem(tokens, args, dtype, device, False)[:3])
    grad = torch.ones_like(q)

    def calls():
        for _ in range(8):
            torch.autograd.grad(cuflash.flash_attn_func(q, k, v, causal=True), (q, k, v), grad)
    ms = timed(calls, device) / 8
    return mean_over_ranks([3.5 * 4 * args.heads * tokens * tokens * args.dim / 2 / ms / 1e9], device)[0]


def write(rows, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cp_bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(out, "cp_bench.png"))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, mode in enumerate(sorted({r["mode"] for r in rows})):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["tokens"] for r in mine], [r["efficiency_fwdbwd"] for r in mine], marker="o", color=f"C{i}",
                label=f"{mode} fwd+bwd")
        ax.plot([r["tokens"] for r in mine], [r["efficiency_fwd"] for r in mine], marker="x", linestyle="--",
                color=f"C{i}", label=f"{mode} fwd")
        ax.plot([r["tokens"] for r in mine], [r["efficiency_vs_16k_fwdbwd"] for r in mine], marker="s", linestyle=":",
                color=f"C{i}", label=f"{mode} fwd+bwd vs one GPU at 16k")
    ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (whole sequence)")
    ax.set_ylabel("per-GPU efficiency vs one GPU")
    ax.set_title(f"context parallelism on {int(rows[0]['world_size'])} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tokens", default="131072,1048576", help="whole-sequence lengths, comma-separated")
    p.add_argument("--modes", default="ring,ulysses",
                   help="from ring, ulysses (a 1-D mesh), hybrid (--inner), packed and packed_zigzag (the ring over "
                   "documents in contiguous shares or cut into 2W chunks each)")
    p.add_argument("--doc-tokens", type=int, default=16384, help="packed: tokens per document (the last shorter)")
    p.add_argument("--inner", type=int, default=0, help="the hybrid's all-to-all size (ranks per node)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"],
                   help="how the sequence is cut (zigzag balances the ring's causal work; packed: contiguous)")
    p.add_argument("--check-tokens", type=int, default=8192)
    p.add_argument("--ref-tokens", type=int, default=16384,
                   help="the one-GPU reference of the *_16k columns (less only for smoke runs)")
    p.add_argument("--reps", type=int, default=TIMING["reps"], help="timed runs per measurement (the median is kept)")
    p.add_argument("--warmup", type=int, default=TIMING["warmup"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    TIMING.update(reps=args.reps, warmup=args.warmup)
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    best = one_gpu_at_its_best(args, device, dtype)
    rows = []
    for mode in args.modes.split(","):
        shape = (world // args.inner, args.inner) if mode == "hybrid" else (world,)
        mesh = init_device_mesh(device.type, shape)
        errors = check(mesh, "auto" if mode == "hybrid" else mode, args, device, dtype)
        if dist.get_rank() == 0:
            print(f"{mode}: vs one process " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
        for tokens in map(int, args.tokens.split(",")):
            row = run(mesh, "auto" if mode == "hybrid" else mode, tokens, args, device, dtype)
            row.update(mode=mode, one_gpu_16k_tflops_fwdbwd=best,
                       efficiency_vs_16k_fwdbwd=row["tflops_per_gpu_fwdbwd"] / best)
            rows.append(row)
            if dist.get_rank() == 0:
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                if args.out:  # after every row, so that a cut run keeps what it measured
                    write(rows, args.out)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: with gloo, its threads can abort it after every
    # step has run and the process group is gone ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
