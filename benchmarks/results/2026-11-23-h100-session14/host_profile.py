"""Where the host's time goes in `cuflash bench`'s backward step (torch.autograd.grad through
cuflash.scaled_dot_product_attention, D=128, 512 keys, 16k tokens): the host time per call of the
step and of kernels.attention_backward alone (no synchronization; medians of 200), then a cProfile of
300 steps (top functions by own time and by cumulative time).
PYTHONPATH=src python3 host_profile.py"""
import cProfile
import pstats
import statistics
import time

import torch

from cuflash.bench.harness import Case, _attention_fn, _inputs
from cuflash.kernels import attention_backward, attention_forward
from cuflash.params import AttentionParams

device = torch.device("cuda")
case = Case(32, 512, 16, 128, False, torch.bfloat16, "bwd")
fn = _attention_fn("cuflash", case, case.batch, case.seqlen, device)
data = _inputs(case, device, True, 4)
outs = [fn(*x[:3]) for x in data]


def step(i):
    return torch.autograd.grad(outs[i % 4], data[i % 4][:3], data[i % 4][3], retain_graph=True)


q, k, v, do = (t.detach().transpose(1, 2) for t in data[0])
params = AttentionParams(128 ** -0.5)
out, lse = attention_forward(q, k, v, params)


def direct(i):
    return attention_backward(do, q, k, v, out, lse, params)


def host_us(fn, calls=200):
    for i in range(20):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e6)
        if i % 8 == 7:
            torch.cuda.synchronize()  # keep the GPU's queue short: time the host, not a full queue
    torch.cuda.synchronize()
    return statistics.median(times)


for rnd in range(3):
    print(f"round {rnd}: autograd.grad step {host_us(step):.1f} us, kernels.attention_backward "
          f"{host_us(direct):.1f} us (host, median)", flush=True)
profile = cProfile.Profile()
profile.enable()
for i in range(300):
    step(i)
torch.cuda.synchronize()
profile.disable()
stats = pstats.Stats(profile)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(40)
