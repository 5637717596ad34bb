"""Gradient errors against float64 (the tests' relative Frobenius error) of the Gluon backward of a
module copy made for the run (src/cuflash/kernels/_hb_base.py: the last commit's, not committed)
and of the working tree's, beside torch SDPA's own (its default backend), on the same inputs.
The two passes only (deterministic): the fused dQ adds in a varying order.
PYTHONPATH=src:tests python3 precision_ab.py"""
import torch

from attn_testing import make_qkv, rel_err, run_and_grad, torch_sdpa
from cuflash import flash_attn_func
from cuflash.kernels import _hb_base, backward, hopper_backward, launch
from cuflash.reference import attention_reference

for dtype in (torch.bfloat16, torch.float16):
    for d in (64, 128):
        for causal in (False, True):
            for nq, nk in ((2048, 2048), (1000, 1100)):
                torch.manual_seed(nq + d)
                q, k, v = make_qkv(2, nq, nk, 8, 2, d, dtype, "cuda")
                dout = torch.randn(q.shape, dtype=dtype, device="cuda")
                ref = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=causal)[0],
                                   q.double(), k.double(), v.double(), dout)
                errs = {}
                for name, module in (("base", _hb_base), ("new", hopper_backward)):
                    backward.hopper_backward = module
                    launch._plans.clear()
                    ours = run_and_grad(lambda a, b, c: flash_attn_func(a, b, c, causal=causal, deterministic=True),
                                        q, k, v, dout)
                    errs[name] = [rel_err(x, r) for x, r in zip(ours[1:], ref[1:])]
                backward.hopper_backward = hopper_backward
                launch._plans.clear()
                errs["torch"] = [rel_err(x, r) for x, r in
                                 zip(run_and_grad(lambda a, b, c: torch_sdpa(a, b, c, causal), q, k, v, dout)[1:],
                                     ref[1:])]
                print(f"{str(dtype)[6:]:8s} D={d:3d} {nq}x{nk} causal={causal!s:5}  " + "  ".join(
                    f"{name} dq/dk/dv " + "/".join(f"{e:.2e}" for e in es) for name, es in errs.items()), flush=True)
