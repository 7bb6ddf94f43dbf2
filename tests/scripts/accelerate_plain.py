"""An Hugging Face `accelerate` training loop with no disttrace line in it: `Accelerator.prepare` wraps the
model (DDP), optimizer and loader, `accelerator.accumulate` runs gradient accumulation, `accelerator.backward`
and `accelerator.clip_grad_norm_` do the rest. `disttrace run -- torchrun --nproc-per-node 2
tests/scripts/accelerate_plain.py` records it as it is.

    torchrun --nproc-per-node 2 tests/scripts/accelerate_plain.py [--steps N]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randint(0, 3, (512,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    batches = iter(loader)
    for _ in range(args.steps * args.accum):
        x, y = next(batches)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.print(f"final loss {loss.item():.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
