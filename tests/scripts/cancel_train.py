"""A user-style script whose weight gradient cancels, attached to disttrace: a projection of inputs that are
nearly one vector (1 + 1e-3 noise) whose outputs are centred over the tokens of each sequence, so the output
gradient sums to zero over the tokens and dW = sum_t dy_t x_t^T cancels to ~1e-3 of its terms (as a key
projection's gradient does through the softmax). A second, plain layer reads the centred outputs and does
not cancel. The same 16 samples a step in every layout: `--mb 8 --accum 2` against `--mb 4 --accum 4` on
one rank, or 2 ranks of `--mb 4 --accum 2` under DDP, FSDP2 (`--engine fsdp2`) or a hand-written all-reduce
(`--engine manual`). `--skew-lr` (a control, 2 ranks): rank 1's learning rate x (1 + 1e-3) (rank 0 writes the
manifest, which shows the configured one: only the numbers can tell). `--clip MAX`: clip the global gradient
norm to MAX (torch.nn.utils.clip_grad_norm_) before each optimizer step; `--no-bias`: a head without a bias,
so the cancelling projection's gradient carries a share of the global norm (which then cancels too);
`--spread S`: the inputs' noise (default 1e-3; smaller cancels more); `--shift EPS`: a third layer adds EPS times
a learned offset of a constant input, against targets moved by 3, so its gradient (the residuals' sum over the
tokens) does not cancel: a small share of the global norm whose own gradient is near its magnitude.

    torchrun --nproc-per-node 2 tests/scripts/cancel_train.py OUT --mb 4 --accum 2 [--engine ddp]
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import disttrace.api  # disttrace

TOKENS, D_IN, D_OUT = 64, 8, 16


class Centred(nn.Module):
    def __init__(self, bias: bool = True, shift: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(D_IN, D_OUT, bias=False)
        self.head = nn.Linear(D_OUT, 4, bias=bias)
        self.scale = shift
        self.shift = nn.Linear(1, 4, bias=False) if shift else None

    def forward(self, x):
        y = self.proj(x)
        out = self.head(y - y.mean(dim=1, keepdim=True))
        if self.shift is not None:
            out = out + self.scale * self.shift(torch.ones_like(x[..., :1]))
        return out


def samples(step: int, spread: float = 1e-3):
    """The step's 16 samples (the same in every layout): inputs near one vector (off by `spread`: the
    projection's gradient cancels to about that share of its terms), and targets."""
    g = torch.Generator().manual_seed(step)
    x = 1 + spread * torch.randn(16, TOKENS, D_IN, generator=g)
    return x, torch.randn(16, TOKENS, 4, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engine", default="ddp", choices=["ddp", "fsdp2", "manual"])
    ap.add_argument("--skew-lr", action="store_true")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--no-bias", action="store_true")
    ap.add_argument("--spread", type=float, default=1e-3)
    ap.add_argument("--shift", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "WORLD_SIZE" in os.environ  # under torchrun, also with one rank
    if launched:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if launched else 0
    assert args.mb * args.accum * world == 16, "16 samples a step in every layout"
    torch.manual_seed(0)
    model = Centred(bias=not args.no_bias, shift=args.shift)
    net = model
    if world > 1 and args.engine == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    elif (
        launched and args.engine == "fsdp2"
    ):  # one rank too: FSDP2's model class is the experiment's
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        net = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    lr = 1e-2 * (1 + 1e-3 if args.skew_lr and rank == 1 else 1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    config = {"lr": 1e-2, "steps": args.steps, "data": "cancel-train"}
    run = disttrace.api.attach(net, optimizer, out=args.out, name="cancel-train", config=config)
    for step in range(1, args.steps + 1):
        x, target = samples(step, args.spread)
        optimizer.zero_grad()
        for mb in range(args.accum):
            lo = (rank * args.accum + mb) * args.mb
            xb, tb = x[lo : lo + args.mb], target[lo : lo + args.mb] + (3.0 if args.shift else 0.0)
            run.batch(xb)  # disttrace
            # each rank's share of the step's mean: the engines average the ranks' gradients
            loss = ((net(xb) - tb) ** 2).sum() * world / (16 * TOKENS)
            loss = run.loss(loss)  # disttrace
            loss.backward()
        if world > 1 and args.engine == "manual":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
        optimizer.step()
    run.close()  # disttrace
    if rank == 0:
        print(run.run_dir, flush=True)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
