"""The cost of a new mod: the first call of cuflash.flex_attention with a mod it has not seen (trace and
compile the forward), its first backward (compile the backward kernels), a call at a new sequence length
and batch (no new compile: the kernels do not specialize on them), and the host time of a warm call
against the built-in option computing the same. Usage (GPU): PYTHONPATH=src python scripts/flex_first_call.py"""
import time

import torch

import cuflash


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def host_us(fn, calls: int = 200) -> float:
    """Median host time to enqueue one call (the GPU runs behind)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    slopes = torch.rand(16, device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def inputs(batch, seqlen):
        return [torch.randn(batch, 16, seqlen, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]

    q, k, v = inputs(2, 2048)
    mask = cuflash.create_block_mask(causal, None, None, 2048, 2048, device=device)
    first = timed(lambda: cuflash.flex_attention(q, k, v, score_mod=alibi, block_mask=mask))
    out = cuflash.flex_attention(q, k, v, score_mod=alibi, block_mask=mask)
    first_bwd = timed(lambda: out.sum().backward())
    warm = timed(lambda: cuflash.flex_attention(q, k, v, score_mod=alibi, block_mask=mask))
    print(f"first forward (trace + compile) {first:.2f} s; first backward (compile) {first_bwd:.2f} s; "
          f"warm forward {warm * 1e3:.2f} ms")
    # A new batch and length: the same kernels where the length keeps its class in the launch table
    # (kernels/plan.py) and whole blocks; a new class, or a ragged last block, compiles once more.
    for batch, seqlen in ((3, 1920), (1, 1664), (3, 3000), (2, 2900)):
        q2, k2, v2 = inputs(batch, seqlen)
        mask2 = cuflash.create_block_mask(causal, None, None, seqlen, seqlen, device=device)
        other = timed(lambda: cuflash.flex_attention(q2, k2, v2, score_mod=alibi, block_mask=mask2).sum().backward())
        print(f"batch {batch} x {seqlen} keys, first forward + backward {other * 1e3:.1f} ms")
    with torch.no_grad():
        qs, ks, vs = (t.detach()[:, :, :256] for t in (q, k, v))
        small_mask = cuflash.create_block_mask(causal, None, None, 256, 256, device=device)
        flex = host_us(lambda: cuflash.flex_attention(qs, ks, vs, block_mask=small_mask))
        flex_score = host_us(lambda: cuflash.flex_attention(qs, ks, vs, score_mod=alibi))
        qf, kf, vf = (t.transpose(1, 2) for t in (qs, ks, vs))
        builtin = host_us(lambda: cuflash.flash_attn_func(qf, kf, vf, causal=True))
    print(f"host time a call, 2 x 16 x 256 x 128: flex_attention causal block mask {flex:.0f} us, with an ALiBi "
          f"score_mod {flex_score:.0f} us, flash_attn_func(causal=True) {builtin:.0f} us")


if __name__ == "__main__":
    main()
