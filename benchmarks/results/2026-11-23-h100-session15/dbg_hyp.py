import torch
from cuflash.kernels import attention_forward
from cuflash.kernels.config import Launch
from cuflash.params import AttentionParams
torch.manual_seed(0)
for n, d, bn, st, lo in [(512, 64, 128, 3, 192), (512, 64, 64, 6, 64)]:
    q, k, v = (torch.randn(1, n, 1, d, dtype=torch.float16, device="cuda") for _ in range(3))
    p = AttentionParams(d ** -0.5, window_right=0)
    out, lse = attention_forward(q, k, v, p, Launch(128, 64, 4, 3, gluon=True, consumers=2, gluon_block_n=bn, gluon_stages=st))
    qf, kf, vf = (t[0, :, 0].double() for t in (q, k, v))
    s = qf @ kf.T * d ** -0.5
    r = torch.arange(n, device="cuda")[:, None]
    c = torch.arange(n, device="cuda")[None, :]
    hyps = {"right": c <= r, "rows-64": c <= r - 64, "rows+64": c <= r + 64, "no tile0": (c <= r) & (c >= bn),
            "no last": (c <= r) & (c < (lo // bn) * bn), "tile0 only": c < bn, "upto tile end": c < (r // bn + 1) * bn}
    got = out[0, lo:lo + 64, 0].double()
    for name, m in hyps.items():
        ref = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ vf
        print(n, bn, name, "%.3g" % (got - ref[lo:lo + 64]).abs().max().item(), flush=True)
    print("lse err", (lse[0, 0, lo:lo+64].double() - torch.logsumexp(s.masked_fill(~hyps["right"], float("-inf")), -1)[lo:lo+64]).abs().max().item())
