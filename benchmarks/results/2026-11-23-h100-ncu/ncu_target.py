"""One forward and one backward of cuflash under Nsight Compute: compiled and warmed up first, then
the profiled range (cudaProfilerStart/Stop) holds one call of each, so `ncu --profile-from-start off`
sees only those kernels. bf16, 16k tokens, hidden 2048 (nheads = 2048 / D).
PYTHONPATH=src ncu --profile-from-start off ... python3 ncu_target.py D N CAUSAL(0/1)"""
import sys

import torch

from cuflash.kernels import attention_backward, attention_forward
from cuflash.params import AttentionParams

d, n, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
b, h = 16384 // n, 2048 // d
q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
params = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
for _ in range(3):
    out, lse = attention_forward(q, k, v, params)
    attention_backward(do, q, k, v, out, lse, params)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
out, lse = attention_forward(q, k, v, params)
attention_backward(do, q, k, v, out, lse, params)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
