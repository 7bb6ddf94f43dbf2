"""A training loop with no disttrace line in it whose loss is computed the way torchtitan computes it: the
model returns hidden states; the loss backpropagates chunk by chunk into a detached copy of them (each chunk
a backward of its own, through the output head only), then one backward of the whole loss carries the
gathered gradient into the model. Only that last backward is the step's loss; the script prints it.

    python tests/scripts/chunked_loss.py [--steps N] [--chunks K]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)  # called outside forward, chunk by chunk

    def forward(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))


class _HiddenGradient(torch.autograd.Function):
    """The whole loss as a value, whose backward hands the hidden states the gradient the chunks gathered."""

    @staticmethod
    def forward(ctx, hidden, total, gathered):
        ctx.save_for_backward(gathered)
        return total.clone()

    @staticmethod
    def backward(ctx, grad):
        (gathered,) = ctx.saved_tensors
        return gathered * grad, None, None


def chunked_loss(model, hidden, targets, chunks):
    detached = hidden.detach().requires_grad_()
    total = torch.zeros(())
    n = targets.numel()
    for h, t in zip(detached.chunk(chunks, dim=0), targets.chunk(chunks, dim=0)):
        part = F.cross_entropy(model.head(h).reshape(-1, 32), t.reshape(-1), reduction="sum") / n
        part.backward()
        total += part.detach()
    return _HiddenGradient.apply(hidden, total, detached.grad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Body()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 32, (8, 6), generator=g)
        optimizer.zero_grad()
        loss = chunked_loss(model, model(tokens), torch.roll(tokens, -1, dims=1), args.chunks)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.9g}", flush=True)


if __name__ == "__main__":
    main()
