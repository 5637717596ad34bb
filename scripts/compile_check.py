"""Compiles, without running and without a GPU, every kernel the launch table picks for Hopper
(sm_90; the Gluon kernels included) over many input specializations, and a decode step's kernels,
with the installed Triton and its own ptxas, and prints the ones that fail. Triton specializes
arguments (an int equal to 1 becomes a constant), and some specializations crash its passes or
ptxas where the benchmark shapes compile fine: this finds them for free before a GPU run. Match
the GPU machine's Triton in a separate environment:
    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0
    PYTHONPATH=src /tmp/t36/bin/python scripts/compile_check.py [--dtype bf16,fp32] [--hdims 64,96,128,256]
        [--vdims 0,128] [--options plain,causal,window,softcap,alibi,attn_mask,additive_mask,dropout,varlen,score_mod,
         mask_mod,block_mask,'varlen seqused','varlen seqused sink',sink,sink_causal,sink_score_mod]
"""
import argparse
import itertools

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _Hopper:
    """A stand-in for the CUDA driver: the target is sm_90, there is no device to launch on."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(_Hopper())
_run = JITFunction.run
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: _run(self, *args, grid=grid, warmup=True, **kwargs)

from cuflash.kernels import attention, attention_backward, attention_forward  # noqa: E402 (after the stand-in)


def _compile_only(key, tensors, build):
    # The launchers' plans (kernels/launch.py) would load the compiled binaries: compile only.
    for kernel, grid, kwargs in build():
        kernel[grid](**kwargs)


attention.launch = _compile_only
from cuflash.kernels import plan  # noqa: E402
from cuflash.kernels.device import padded_head_dim  # noqa: E402
from cuflash.kernels.plan import Length, entry  # noqa: E402
from cuflash.flex import block_sparsity, create_block_mask  # noqa: E402
from cuflash.mods import Mod, Mods  # noqa: E402
from cuflash.params import AttentionParams  # noqa: E402

plan.arch = lambda device: 90  # the decode tiles of Hopper for the CPU tensors below

# (seqlen_q, seqlen_k, nheads, nheads_k): ones that Triton turns into constants, GQA, MQA, ragged.
SHAPES = [(1, 1, 4, 4), (1, 1000, 4, 2), (1000, 1, 4, 4), (17, 17, 4, 1), (300, 300, 4, 2), (1, 300, 4, 1),
          (300, 1, 4, 4), (1000, 1000, 4, 2), (3000, 3000, 2, 2), (1, 3000, 4, 1)]
OPTIONS = {"plain": {}, "causal": dict(window_right=0), "window": dict(window_left=256, window_right=0),
           "softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=torch.rand(4)), "dropout": dict(dropout_p=0.1),
           "varlen": {}, "varlen alibi": dict(alibi_slopes=torch.rand(4), window_right=0),
           "varlen causal": dict(window_right=0), "varlen seqused": dict(window_right=0),
           "varlen seqused sink": dict(window_right=0, learnable_sink=torch.randn(4)),
           "score_mod": {}, "mask_mod": dict(window_right=0), "block_mask": {},
           "attn_mask": {}, "additive_mask": {}, "sink": dict(learnable_sink=torch.randn(4)),
           "sink_causal": dict(learnable_sink=torch.randn(4).bfloat16(), window_right=0),
           "sink_score_mod": dict(learnable_sink=torch.randn(4))}


def _mods(name: str, nq: int, nk: int, h: int):
    """The Mods of a mods option: a relative bias read from a captured table (score_mod, with the causal
    mask_mod of flash_attn_func's mask_mod), or a block mask of 128-token documents."""
    bias = torch.randn(h, 64)
    docs = torch.arange(max(nq, nk), dtype=torch.int32) // 128

    def relative(score, b, h, q, kv):
        return score + bias[h, (q - kv).abs().clamp(max=63)]

    def document(b, h, q, kv):
        return docs[q] == docs[kv]
    if name == "block_mask":
        mask = create_block_mask(document, 2, None, nq, nk, device="cpu")
        return Mods(score=Mod.of(relative, "score"), mask=Mod.of(document, "mask"),
                    blocks=block_sparsity(mask, 2, h))
    return Mods(score=Mod.of(relative, "score"), mask=Mod.of(document, "mask") if name == "mask_mod" else None)


def compile_case(dtype, d, nq, nk, h, hk, name, dv: int = 0) -> str | None:
    """Compiles forward and backward for one case (dv: v's head dim, 0: d); returns the failure, or None."""
    dv = dv or d
    opts = dict(OPTIONS[name])
    if "dropout_p" in opts:
        opts["rng_seed"] = torch.zeros(2, dtype=torch.int64)
    if name in ("score_mod", "mask_mod", "block_mask", "sink_score_mod"):
        opts["mods"] = _mods(name, nq, nk, h)
    if name in ("attn_mask", "additive_mask"):  # SDPA's, (batch, nheads, nq, nk): bool, or bf16 added
        mask = torch.rand(2, h, nq, nk) > 0.3
        opts["attn_mask"] = mask if name == "attn_mask" else mask.to(torch.bfloat16)
    if name.startswith("varlen"):
        lens_q, lens_k = [nq, 1, 17], [nk, 9, 17]
        cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
        if name.startswith("varlen seqused"):  # (each sequence using all but its last row)
            opts["seqused_q"], opts["seqused_k"] = (torch.tensor(lens, dtype=torch.int32) - 1
                                                    for lens in (lens_q, lens_k))
        q = torch.randn(sum(lens_q), h, d, dtype=dtype)
        k, v = (torch.randn(sum(lens_k), hk, n, dtype=dtype) for n in (d, dv))
        params = AttentionParams(d ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                 max_seqlen_k=max(lens_k), **opts)
        lse = torch.zeros(h, sum(lens_q))
    else:
        q = torch.randn(2, nq, h, d, dtype=dtype)
        k, v = (torch.randn(2, nk, hk, n, dtype=dtype) for n in (d, dv))
        params = AttentionParams(d ** -0.5, **opts)
        lse = torch.zeros(2, h, nq)
    cell = entry(90, padded_head_dim(d), dtype == torch.float32, False,
                 Length.of(max(params.max_seqlen_q or nq, params.max_seqlen_k or nk)), params.banded,
                 padded_head_dim(dv))
    out = torch.randn(*q.shape[:-1], dv, dtype=dtype)  # (the output and dO: v's head dim)
    for kernel, call in (("forward", lambda: attention_forward(q, k, v, params, cell)),
                         ("backward", lambda: attention_backward(out, q, k, v, out, lse, params, cell))):
        try:
            call()
        except Exception as exc:  # a compiler pass or ptxas failing
            lines = str(exc).strip().splitlines() or [""]
            return f"{kernel}: {type(exc).__name__}: {lines[-1][:120]}"
    return None


def compile_decode(dtype, d, paged: bool, tensor_seqlens: bool, scored: bool, dv: int = 0) -> str | None:
    """Compiles a decode step's kernels (the causal decode appending 2 new tokens and checking the
    index tensors' values, the split combine; scored: with softcap, ALiBi and a learnable sink, split
    and not: the sink is counted by the combine or by the decode kernel) for a cache of 4 KV heads
    read by 8 query heads (dv: v_cache's head dim, 0: d); returns the failure, or None."""
    dv = dv or d
    q = torch.randn(2, 2, 8, d, dtype=dtype)
    k_new, v_new = (torch.randn(2, 2, 4, n, dtype=dtype) for n in (d, dv))
    shape = (8, 64, 4) if paged else (2, 256, 4)
    k_cache, v_cache = (torch.zeros(*shape, n, dtype=dtype) for n in (d, dv))
    table = torch.arange(8, dtype=torch.int32).view(2, 4) if paged else None
    seqlens = torch.tensor([5, 100], dtype=torch.int32) if tensor_seqlens else 100
    try:
        options = dict(softcap=30.0, alibi_slopes=torch.rand(8), learnable_sink=torch.randn(8)) if scored else {}
        for splits in (1, 4) if scored else (0,):
            attention.decode_forward(q, k_cache, v_cache, seqlens, 2, None, None, table,
                                     AttentionParams(d ** -0.5, window_right=0, **options), splits, k_new, v_new)
    except Exception as exc:  # a compiler pass or ptxas failing
        lines = str(exc).strip().splitlines() or [""]
        return f"decode: {type(exc).__name__}: {lines[-1][:120]}"
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--vdims", default="0", help="v's head dims, each with every one of --hdims (0: the same as q's)")
    p.add_argument("--options", default="plain,causal,varlen", help=f"from {','.join(OPTIONS)}")
    p.add_argument("--shapes", default=None, help=f"indices into the {len(SHAPES)} shapes (default: all)")
    args = p.parse_args()
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[x] for x in args.dtype.split(",")]
    failed = total = 0
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    dims = list(itertools.product(map(int, args.hdims.split(",")), map(int, args.vdims.split(","))))
    for dtype, (d, dv), name, shape in itertools.product(dtypes, dims, args.options.split(","), shapes):
        total += 1
        error = compile_case(dtype, d, *shape, name, dv)
        if error:
            failed += 1
            print(f"FAIL {dtype} D={d} Dv={dv or d} {name} {shape}: {error}", flush=True)
    for dtype, (d, dv), paged, tensor_seqlens, scored in itertools.product(dtypes, dims, (False, True), (False, True),
                                                                           (False, True)):
        total += 1
        error = compile_decode(dtype, d, paged, tensor_seqlens, scored, dv)
        if error:
            failed += 1
            print(f"FAIL {dtype} D={d} Dv={dv or d} decode paged={paged} tensor seqlens={tensor_seqlens} "
                  f"scored={scored}: {error}", flush=True)
    print(f"{failed} of {total} cases failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
