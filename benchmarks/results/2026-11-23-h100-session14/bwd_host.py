"""Why `cuflash bench`'s short backward rows vary: per case, 5 repeats of (a) the bench's timing
(CUDA events around each call, median of 30), (b) the host's time to enqueue one call (perf_counter,
no synchronization; median), (c) the GPU's time per call over 30 back-to-back calls (two events
around the loop), for cuflash and sdpa-cudnn, bwd mode as the bench runs it.
PYTHONPATH=src python3 bwd_host.py"""
import statistics
import time

import torch

from cuflash.bench.harness import Case, _attention_fn, _inputs, _median_ms

device = torch.device("cuda")
for n, causal in ((384, False), (512, False), (512, True), (1024, False)):
    d = 128
    case = Case(16384 // n, n, 2048 // d, d, causal, torch.bfloat16, "bwd")
    for provider in ("cuflash", "sdpa-cudnn"):
        fn = _attention_fn(provider, case, case.batch, case.seqlen, device)
        data = _inputs(case, device, True, 4)
        outs = [fn(*x[:3]) for x in data]

        def step(i):
            return torch.autograd.grad(outs[i % 4], data[i % 4][:3], data[i % 4][3], retain_graph=True)

        rows = []
        for _ in range(5):
            bench_ms = _median_ms(step, 30, 5, device)
            torch.cuda.synchronize()
            host = []
            for i in range(30):
                t = time.perf_counter()
                step(i)
                host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(30):
                step(i)
            end.record()
            torch.cuda.synchronize()
            rows.append(f"bench {bench_ms:.3f} host {statistics.median(host):.3f} loop {start.elapsed_time(end) / 30:.3f}")
        print(f"D={d} N={n} causal={causal!s:5} {provider:10s} " + " | ".join(rows), flush=True)
        data = outs = None  # noqa: F841 (the inputs freed before the next case)
        torch.cuda.empty_cache()
