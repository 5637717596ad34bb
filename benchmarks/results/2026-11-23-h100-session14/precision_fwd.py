"""The causal forward's error against float64 with the table's launch (the Gluon forward with 64-key
tiles where the table now takes it) and with the Triton forward on the same inputs: relative error
(Frobenius) and the largest absolute error, and the largest difference between the two outputs.
bf16 and fp16, 3 seeds per case. PYTHONPATH=src python3 precision_fwd.py"""
import dataclasses

import torch

from cuflash.kernels import attention_forward, launch
from cuflash.kernels.config import forward_config
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference

for dtype in (torch.bfloat16, torch.float16):
    for d in (64, 128):
        for n in (160, 192, 256, 512, 700, 1000):
            cfg = forward_config(torch.empty(0, dtype=dtype, device="cuda"), d, n, True)
            rows = []
            for seed in range(3):
                torch.manual_seed(seed)
                q, k, v = (torch.randn(4, n, 16, d, dtype=dtype, device="cuda") for _ in range(3))
                params = AttentionParams(d ** -0.5, window_right=0)
                ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
                outs = {}
                for name, c in (("table", cfg), ("triton", dataclasses.replace(cfg, gluon=False))):
                    launch._plans.clear()
                    outs[name], _ = attention_forward(q, k, v, params, c)
                errs = {name: (((o.double() - ref).norm() / ref.norm()).item(), (o.double() - ref).abs().max().item())
                        for name, o in outs.items()}
                between = (outs["table"].float() - outs["triton"].float()).abs().max().item()
                rows.append(f"table {errs['table'][0]:.2e}/{errs['table'][1]:.1e} triton {errs['triton'][0]:.2e}/"
                            f"{errs['triton'][1]:.1e} diff {between:.1e}")
            print(f"{str(dtype)[6:]:8s} D={d:3d} N={n:5d} gluon={cfg.gluon:d} keys={cfg.gluon_block_n:3d}  "
                  + " | ".join(rows), flush=True)
