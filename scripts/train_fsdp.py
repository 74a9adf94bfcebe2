"""The textbook torch FSDP2 loop (``fully_shard``), device-agnostic through the accelerator.

Each rank keeps 1/world of every parameter, gradient and optimizer state; a layer's parameters
are all-gathered before its forward and backward and its gradients reduce-scattered after
(HCCL's AllGather / ReduceScatter on Ascend, NCCL's on GPUs, gloo's on the CPU). Launched
like scripts/train_ddp.py:

    torchrun --nproc_per_node=8 scripts/train_fsdp.py
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 \\
        --master_addr=MASTER_IP --master_port=29500 scripts/train_fsdp.py

Every step trains on one global batch (``--global-batch-size``), each rank on its contiguous
slice of it, so any number of ranks trains the same model with the same losses. Rank 0 prints
one line per epoch and every rank a final ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from megatron_npu.accelerator import get_accelerator


class TinyNet(torch.nn.Module):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(blocks)
        )
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_dataset(samples: int = 512, features: int = 16, classes: int = 4) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    y = (x[:, :classes].argmax(dim=1)).long()  # a learnable rule
    return TensorDataset(x, y)


def shard_model(model: TinyNet, mesh: object) -> TinyNet:
    """FSDP2: each block is one unit (gathered just in time), then the root (embed and head)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def my_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous part of a global batch."""
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = get_accelerator()
    # 1. the process group: hccl on NPUs, nccl on GPUs, gloo on the CPU
    dist.init_process_group(backend=accelerator.communication_backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % world:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of {world} ranks")
    local_rank = int(os.environ["LOCAL_RANK"])
    accelerator.set_device(local_rank)  # one device per process
    device = accelerator.device(local_rank)
    torch.manual_seed(0)

    # 2. the model, built whole on every rank from one seed, then sharded over a 1-D mesh of all ranks
    mesh = init_device_mesh(accelerator.device_type, (world,))
    model = shard_model(TinyNet().to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # its state is sharded like the parameters
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(make_dataset(), batch_size=args.global_batch_size, shuffle=False)

    # 3. the loop is the single-device loop; FSDP2 averages the gradients over the ranks
    step_losses: list[float] = []
    epoch_losses: list[float] = []
    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = my_slice(x, rank, world).to(device), my_slice(y, rank, world).to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            step_losses.append(mean.item() / world)
        steps = len(loader)
        epoch_losses.append(sum(step_losses[-steps:]) / steps)
        if rank == 0:
            # one write per line: the ranks share stdout (see scripts/train_ddp.py)
            line = f"epoch {epoch} | loss {epoch_losses[-1]:.4f} | backend {dist.get_backend()} | device {device}\n"
            os.write(1, line.encode())
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    full = {name: p.full_tensor().detach().double().sum().item() for name, p in model.named_parameters()}
    result = {
        "rank": rank,
        "losses": step_losses,
        "epoch_losses": epoch_losses,
        "checksum": sum(full.values()),
        "shard_numel": shard_numel,
        "numel": sum(p.numel() for p in model.parameters()),
        "backend": dist.get_backend(),
    }
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks share stdout
    dist.barrier()  # no rank closes its sockets while another still uses them (as train_ddp.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
