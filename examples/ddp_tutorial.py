"""The PyTorch DDP tutorial's basic example (a toy model trained with DistributedDataParallel on CPU/gloo),
as a user would write it. The lines marked `# disttrace` are the only change: five lines.

    python examples/ddp_tutorial.py --out runs      # then: disttrace diff RUN_A RUN_B
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api  # disttrace


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size, port, args):
    setup(rank, world_size, port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=args.lr)
    run = disttrace.api.attach(ddp_model, optimizer, out=args.out, name="ddp-tutorial")  # disttrace
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=generator))
        labels = torch.randn(20, 5, generator=generator)
        loss = loss_fn(outputs, labels)
        loss.backward()
        run.loss(loss)  # disttrace
        optimizer.step()
    run.close()  # disttrace
    if rank == 0:
        print(run.run_dir)  # disttrace
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    mp.spawn(
        demo_basic,
        args=(args.world_size, 29500 + os.getpid() % 1000, args),
        nprocs=args.world_size,
        join=True,
    )
