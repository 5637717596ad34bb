"""Trains a transformers Llama with FSDP2 and cuflash context parallelism: the ranks form a (dp, cp)
DeviceMesh; FSDP2 shards the parameters over all of them, each cp group splits every sequence of its
batch (cuflash.distributed.context_parallel_shard) and attends across its ranks through cuflash
(the all-to-all, the ring or their hybrid). Prints and writes the loss per step, which matches a run
without parallelism on the same data (--dp 1 --cp 1).

    torchrun --nproc_per_node=8 examples/train_llama_cp.py --cp 8 --seq-len 131072     # 8 GPUs, 128k
    torchrun --nproc_per_node=2 examples/train_llama_cp.py --device cpu --cp 2         # a toy on the CPU

With --doc-len, each row packs documents of that many tokens (the last one shorter), attention and the
next-token targets stay within each document (transformers' padding-free cu_seq_lens_* kwargs), and
context_parallel_shard cuts the packed row: --layout zigzag cuts every document into 2 x cp chunks,
which balances the ring's causal work over long documents (lengths multiples of 2 x cp).

    torchrun --nproc_per_node=4 examples/train_llama_cp.py --cp 4 --batch 1 --seq-len 262144 \
        --doc-len 65536 --layout zigzag --cp-mode ring
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (FSDP2 shards over dp x cp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (ranks per sequence)")
    p.add_argument("--cp-inner", type=int, default=0,
                   help="all-to-all size inside the cp group for the hybrid (ring across cp / cp-inner)")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    p.add_argument("--cp-mode", default="auto", choices=["auto", "ring", "ulysses"],
                   help="a 1-D cp group's exchange (auto: the all-to-all up to 128k tokens where the heads divide)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=0,
                   help="pack each row with documents of this many tokens (0: one sequence per row); needs --batch 1")
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's parameters")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--out", default=None, help="a JSON file for the losses (rank 0)")
    args = p.parse_args(argv)
    if args.cp_inner and args.cp_mode != "auto":
        p.error("--cp-mode is a 1-D cp group's choice: with --cp-inner the cp group runs the hybrid")
    if args.doc_len and (args.batch != 1 or args.cp_inner):
        p.error("--doc-len packs one row per rank (--batch 1) on a 1-D cp group (no --cp-inner)")
    return args


def model_for(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)  # the same initial weights on every rank and in the one-process run
    return LlamaForCausalLM(config).to(device, getattr(torch, args.dtype))


def batches(args, dp_rank: int, device):
    """The same token batches as the one-process run: step s, data-parallel rank r takes rows
    r * batch .. (r + 1) * batch of that step's global batch."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.dp * args.batch, args.seq_len), generator=generator)
        yield ids[dp_rank * args.batch:(dp_rank + 1) * args.batch].to(device)


def packing(args, device) -> dict:
    """A row's packed documents: the model's padding-free kwargs (prefix sums of the whole row, the
    same on every rank), their position ids and the positions that have a next token in their
    document; without --doc-len, one sequence."""
    lengths = [min(args.doc_len, args.seq_len - start) for start in range(0, args.seq_len, args.doc_len)] \
        if args.doc_len else [args.seq_len]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)) \
        if args.doc_len else {}
    return dict(kwargs=kwargs, cu=cu if args.doc_len else None, positions=positions,
                last=torch.isin(torch.arange(args.seq_len, device=device), cu[1:] - 1))


def main(argv=None) -> list[float]:
    args = parse(argv)
    world = args.dp * args.cp
    device = torch.device(args.device)
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        assert dist.get_world_size() == world, f"launch {world} processes (--dp x --cp)"
    model = model_for(args, device)
    import cuflash.integrations.transformers as cuflash_hf
    loss_scale, dp_rank, cp_mesh = 1.0, 0, None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        inner = args.cp_inner or 1
        shape, names = ((args.dp, args.cp // inner, inner), ("dp", "cp_ring", "cp_a2a")) if args.cp_inner else \
            ((args.dp, args.cp), ("dp", "cp"))
        mesh = init_device_mesh(args.device, shape, mesh_dim_names=names)
        cp_mesh = mesh[names[1:]] if args.cp_inner else mesh["cp"]
        dp_rank = mesh.get_coordinate()[0]
        cuflash_hf.register_context_parallel(cp_mesh, layout=args.layout, mode=args.cp_mode)
        model.config._attn_implementation = "cuflash_cp"
        everyone = mesh._flatten("all") if len(names) == 3 else mesh[("dp", "cp")]._flatten("all")
        for layer in model.model.layers:
            fully_shard(layer, mesh=everyone)
        fully_shard(model, mesh=everyone)
        # FSDP2 averages gradients over every rank; the cp ranks of a sequence each hold part of its
        # loss (normalized by the whole sequence's token count), so their sum is the sequence's gradient.
        loss_scale = float(args.cp)
    else:
        cuflash_hf.register()
        model.config._attn_implementation = "cuflash"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    start = time.perf_counter()
    packed = packing(args, device)
    for step, ids in enumerate(batches(args, dp_rank, device)):
        positions = packed["positions"].expand_as(ids)
        # the next token of the document; none after a document's last
        targets = F.pad(ids[:, 1:], (0, 1)).masked_fill(packed["last"], -100)
        count = int((targets != -100).sum())  # the targets of this rank's sequences, whole
        if cp_mesh is not None:
            from cuflash.distributed import context_parallel_shard
            ids, positions, targets = (context_parallel_shard(t, cp_mesh, args.layout, cu_seqlens=packed["cu"])
                                       for t in (ids, positions, targets))
        logits = model(input_ids=ids, position_ids=positions, **packed["kwargs"]).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        (loss_sum / count * loss_scale).backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss_sum.detach().clone()
        if world > 1:
            dist.all_reduce(total)  # every rank's share of every sequence
        loss = total.item() / (count * args.dp)
        losses.append(loss)
        if world == 1 or dist.get_rank() == 0:
            seconds, start = time.perf_counter() - start, time.perf_counter()
            tokens = args.dp * args.batch * args.seq_len
            print(f"step {step}: loss {loss:.6f}, {seconds:.2f} s, {tokens / seconds:.0f} tokens/s", flush=True)
    if args.out and (world == 1 or dist.get_rank() == 0):
        with open(args.out, "w") as f:
            json.dump(losses, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: with gloo, its threads can abort it after every
    # step has run and the process group is gone ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
