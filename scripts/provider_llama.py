"""An unmodified transformers Llama (attn_implementation="sdpa") trained three ways: as torch runs it
(its default backend choice: cuDNN on Hopper), with torch's flash kernel (sdpa_kernel), and after
cuflash.activate_sdpa_provider() alone: the same initial weights and batches, the loss of every step
side by side, the median step time of each, and the attention kernels a profile of one step names
(cuDNN's, torch's flash_fwd/flash_bwd, or cuflash's _attn_fwd/_attn_bwd).

    PYTHONPATH=src python scripts/provider_llama.py --seq-len 8192 --steps 10
"""
import argparse
import contextlib
import time

import torch
import torch.nn.attention as attention

import cuflash


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    return p.parse_args()


def attention_kernels(step) -> list[str]:
    """The attention kernels (torch's or cuflash's) a profile of step() names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n[:90] for n in names if n.startswith("_attn_") or "flash" in n or "sdpa" in n)


# The provider first, before any SDPA call of the process (as a user activates it at startup); then
# torch's default backend and torch's flash kernel.
RUNS = ("cuflash", "torch", "torch flash")


def train(args, run: str) -> tuple[list[float], float, list[str]]:
    """(the loss of each step, the median step seconds, the attention kernels of a profiled step)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=data) for _ in range(args.steps)]
    losses, seconds = [], []

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    if run == "cuflash":
        cuflash.activate_sdpa_provider()
    chosen = (attention.sdpa_kernel([attention.SDPBackend.FLASH_ATTENTION]) if run == "torch flash"
              else contextlib.nullcontext())
    try:
        with chosen:
            for ids in batches:
                ids = ids.cuda()
                torch.cuda.synchronize()
                start = time.perf_counter()
                losses.append(step(ids).item())
                seconds.append(time.perf_counter() - start)
            kernels = attention_kernels(lambda: step(batches[0].cuda()))
    finally:
        if run == "cuflash":
            attention.restore_flash_attention_impl()
    timed = sorted(seconds[1:] or seconds)  # the first step compiles
    return losses, timed[len(timed) // 2], kernels


def main():
    args = parse()
    results = {run: train(args, run) for run in RUNS}
    print(f"{'step':>4}" + "".join(f"{run + ' loss':>18}" for run in RUNS))
    for i, losses in enumerate(zip(*(results[run][0] for run in RUNS))):
        print(f"{i:>4}" + "".join(f"{loss:>18.5f}" for loss in losses))
    ours = results["cuflash"][1]
    print("median step: " + ", ".join(f"{run} {results[run][1] * 1e3:.1f} ms" for run in RUNS))
    print("cuflash's speedup: " + ", ".join(f"{results[run][1] / ours:.3f}x {run}" for run in RUNS[1:]))
    for run in RUNS:
        print(f"attention kernels, {run}: {results[run][2]}")


if __name__ == "__main__":
    main()
