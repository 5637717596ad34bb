"""Ring attention on several GPUs: correctness against one GPU, then per-GPU throughput against
single-GPU cuflash. Launch: NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --nproc_per_node=2 \
scripts/ring_bench.py [--seqlens 32768,131072] [--out DIR]"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import cuflash
from cuflash.distributed import ring_flash_attn_func, zigzag_shard, zigzag_unshard


def timed(fn, reps=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", default="32768,131072")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = "cuda"
    results = {"world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # Correctness: bf16, GQA, causal, zigzag, against attention on one GPU over the whole sequence.
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8192, h, 128, dtype=torch.bfloat16, device=dev) for h in (8, 2, 2, 8))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = cuflash.flash_attn_func(*full, causal=True)
    ref.backward(dout)
    local = [zigzag_shard(t, rank, world).detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring_flash_attn_func(*local, causal=True, layout="zigzag")
    out.backward(zigzag_shard(dout, rank, world))
    errors = {}
    for name, mine, theirs in (("out", out.detach(), ref.detach()), ("dq", local[0].grad, full[0].grad),
                               ("dk", local[1].grad, full[1].grad), ("dv", local[2].grad, full[2].grad)):
        got = zigzag_unshard(mine).float()
        errors[name] = ((got - theirs.float()).norm() / theirs.float().norm()).item()
    results["rel_diff_vs_one_gpu"] = errors
    if rank == 0:
        print("ring vs one GPU (bf16, 8k, GQA 8/2, causal, zigzag):",
              " ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)

    rows = []
    for n in map(int, args.seqlens.split(",")):
        nheads, d = 16, 128
        flops_fwd = 4 * nheads * n * n * d / 2
        q, k, v, dout = (torch.randn(1, n, nheads, d, dtype=torch.bfloat16, device=dev) for _ in range(4))
        local = [zigzag_shard(t, rank, world).detach().clone().requires_grad_() for t in (q, k, v)]
        local_dout = zigzag_shard(dout, rank, world)
        ring_fwd = timed(lambda: ring_flash_attn_func(*local, causal=True, layout="zigzag"))
        ring_fb = timed(lambda: torch.autograd.grad(ring_flash_attn_func(*local, causal=True, layout="zigzag"),
                                                    local, local_dout))
        shard_bytes = 2 * local[1].numel() * local[1].element_size()
        kv = [local[1].detach(), local[2].detach()]
        recv = [torch.empty_like(t) for t in kv]
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def exchange():
            ops = [dist.P2POp(dist.isend, t, nxt) for t in kv] + [dist.P2POp(dist.irecv, r, prv) for r in recv]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        comm = timed(exchange)
        full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        one_fwd = timed(lambda: cuflash.flash_attn_func(*full, causal=True))
        one_fb = timed(lambda: torch.autograd.grad(cuflash.flash_attn_func(*full, causal=True), full, dout))
        row = {"seqlen": n, "ring_fwd_ms": ring_fwd, "ring_fwdbwd_ms": ring_fb, "one_gpu_fwd_ms": one_fwd,
               "one_gpu_fwdbwd_ms": one_fb, "kv_exchange_ms": comm, "kv_shard_mb": shard_bytes / 1e6,
               "ring_fwd_tflops_per_gpu": flops_fwd / ring_fwd / 1e9 / world,
               "one_gpu_fwd_tflops": flops_fwd / one_fwd / 1e9,
               "ring_fwdbwd_tflops_per_gpu": 3.5 * flops_fwd / ring_fb / 1e9 / world,
               "one_gpu_fwdbwd_tflops": 3.5 * flops_fwd / one_fb / 1e9}
        row["efficiency_fwd"] = row["ring_fwd_tflops_per_gpu"] / row["one_gpu_fwd_tflops"]
        row["efficiency_fwdbwd"] = row["ring_fwdbwd_tflops_per_gpu"] / row["one_gpu_fwdbwd_tflops"]
        rows.append(row)
        if rank == 0:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del q, k, v, dout, local, full
        torch.cuda.empty_cache()
    results["rows"] = rows
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ring_bench.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
