"""DropBP on several processes: DDP or FSDP2 under ``torchrun``, the same script on every device.

    torchrun --standalone --nproc_per_node 2 examples/distributed.py --mode ddp     # CPU: gloo
    torchrun --standalone --nproc_per_node 2 examples/distributed.py --mode fsdp2
    DROPBP_BACKEND=cuda torchrun --standalone --nproc_per_node 8 examples/distributed.py --mode fsdp2

The backend gives the collective library (gloo, nccl, hccl, xccl) and this process's device. DropBP
is applied to the bare model, then the model is wrapped (DDP, with ``find_unused_parameters=True``)
or sharded (``fully_shard`` on every decoder layer, then on the whole model); the other order works
too. Every rank draws the same drop pattern from (seed, step) without communicating; the script
checks that at the end, and for DDP that every rank holds the same parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from finetune import build_model, byte_corpus, sample
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dropbp
from dropbp import backends


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return DistributedDataParallel(model, find_unused_parameters=True)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def same_on_every_rank(value: object) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def train(args: argparse.Namespace, backend: backends.Backend, rank: int) -> tuple[bool, bool | None]:
    """Train; whether every rank drew the same patterns and (DDP) holds the same parameters."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model, _ = backend.prepare(build_model(layers=4, hidden=64, seq_len=args.seq_len))
    ctl = dropbp.apply(model, args.drop_rate, seed=0, backend=backend)
    model = wrap(model, args.mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    data = byte_corpus()
    generator = torch.Generator().manual_seed(rank)  # each rank reads its own batches
    patterns = []
    for step in range(1, args.steps + 1):
        ids = sample(data, args.batch, args.seq_len, generator).to(backend.device)
        with backend.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        ctl.backward(loss)
        ctl.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        patterns.append(ctl.last_dropped)
        if rank == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {loss.item():.3f}  dropped {len(ctl.last_dropped)}/{len(ctl.branches)}")
    if args.mode != "ddp":
        return same_on_every_rank(patterns), None
    checksums = [p.detach().cpu().double().sum().item() for p in model.parameters()]
    return same_on_every_rank(patterns), same_on_every_rank(checksums)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--drop-rate", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=4, help="per process")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)

    backend = backends.get()
    rank = backend.init_distributed()
    # The model lives inside train(): a DDP wrapper that outlives the process group can hang the exit.
    same_patterns, same_params = train(args, backend, rank)
    if rank == 0:
        print(
            f"{args.mode} on {dist.get_world_size()} processes ({backend.distributed_backend}): "
            f"same drop patterns on every rank: {same_patterns}"
            + ("" if same_params is None else f", same parameters on every rank: {same_params}")
        )
    # Every rank past its last collective before any tears the group down: once (1 run in about a dozen on a
    # 2-core machine, FSDP2 on gloo) a rank aborted in teardown ("terminate called without an active exception")
    # after training had completed on both.
    dist.barrier()
    dist.destroy_process_group()
    # torch's own interpreter-exit teardown on gloo still aborts a rank now and then (FSDP2: "terminate called
    # without an active exception", twice in a row once): everything is done, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if same_patterns and same_params is not False else 1)


if __name__ == "__main__":
    main()
