import torch, sys
from cuflash.kernels import attention_forward, forward, hopper_forward, launch, _hf_noA, _hf_base
from cuflash.kernels.config import Launch
from cuflash.params import AttentionParams
torch.manual_seed(0)
for name, mod in (("new", hopper_forward), ("noA", _hf_noA), ("base", _hf_base)):
    forward.hopper_forward = mod
    launch._plans.clear()
    for (b, h, n, d, bn, st, causal) in [(1, 1, 512, 64, 128, 3, True), (1, 1, 512, 64, 64, 6, True), (1, 1, 512, 128, 64, 5, True)]:
        q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16, device="cuda") for _ in range(3))
        p = AttentionParams(d ** -0.5, window_right=0 if causal else -1)
        out, lse = attention_forward(q, k, v, p, Launch(128, 64, 4, 3, gluon=True, consumers=2, gluon_block_n=bn, gluon_stages=st))
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        err = (out.float() - ref).abs().amax(dim=(0, 2, 3))  # per row
        bad = (err > 1e-2).nonzero().flatten().tolist()
        blocks = sorted(set(r // 64 for r in bad))
        print(name, b, h, n, d, bn, causal, "max err %.3g" % err.max().item(), "bad rows", len(bad), "64-row blocks", blocks[:40], flush=True)
