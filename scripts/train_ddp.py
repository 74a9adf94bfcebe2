"""The textbook torch DDP loop, device-agnostic through the accelerator.

The same script runs on NPUs (hccl), GPUs (nccl) and the CPU (gloo):

    torchrun --nproc_per_node=8 scripts/train_ddp.py
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 \\
        --master_addr=MASTER_IP --master_port=29500 scripts/train_ddp.py

Rank 0 prints one line per epoch and every rank a final ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 (the textbook name)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from megatron_npu.accelerator import get_accelerator


class TinyNet(torch.nn.Module):
    def __init__(self, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_dataset(samples: int = 512, features: int = 16, classes: int = 4) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    y = (x[:, :classes].argmax(dim=1)).long()  # a learnable rule
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    accelerator = get_accelerator()
    # 1. the process group: hccl on NPUs, nccl on GPUs, gloo on the CPU
    dist.init_process_group(backend=accelerator.communication_backend, init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    accelerator.set_device(local_rank)  # one device per process
    device = accelerator.device(local_rank)
    torch.manual_seed(0)

    # 2. the model wrapped in DDP (device_ids only where there is a device)
    model = TinyNet().to(device)
    ddp_model = DDP(model, device_ids=None if accelerator.runs_on_host else [local_rank])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    # 3. each process reads its own shard
    dataset = make_dataset()
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler, batch_size=args.batch_size)

    # 4. the loop is the single-device loop
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, count = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = loss_fn(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach()
            count += 1
        dist.all_reduce(total)
        mean = total.item() / (count * dist.get_world_size())
        losses.append(mean)
        if dist.get_rank() == 0:
            # one write per line: the ranks share stdout, and print() writes the text and its newline
            # apart when Python runs unbuffered (PYTHONUNBUFFERED), so another rank's line could land between
            line = f"epoch {epoch} | loss {mean:.4f} | backend {dist.get_backend()} | device {device}\n"
            os.write(1, line.encode())
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    result = {"rank": dist.get_rank(), "losses": losses, "checksum": checksum, "backend": dist.get_backend()}
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks share stdout
    # the DDP wrapper's reducer holds the group: released first, so that destroying the group joins gloo's
    # threads here rather than at interpreter exit (a rank once aborted there: "terminate called without an
    # active exception"); the barrier keeps a rank from closing its sockets while the other still uses them
    del ddp_model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
