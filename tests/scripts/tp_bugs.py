"""User-style tensor-parallel and FSDP2 scripts (2 ranks on gloo) attached to disttrace, each in a fix and a
bug variant of a public silent-bug family. `--bug` plants one (none is the fix):

  loss-local-stats  --engine tp: a vocabulary-parallel cross-entropy with label smoothing takes the smoothing
                    term's mean logit from the local vocabulary shard instead of the whole vocabulary
                    (the family of https://github.com/NVIDIA/Megatron-LM/issues/737): the tp ranks compute different losses
  unsummed-row      --engine tp: a fused row-parallel path tags its local partial sum Replicate instead of
                    reducing it: the rank's output is never summed over tp
  unreduced-norm    --engine tp: the sequence-parallel norm's weight gradient (a partial sum over the rank's
                    sequence chunk) is never all-reduced over tp
  local-clip        --engine fsdp: the clip norm is the local shard's (torch.nn.utils.get_total_norm over
                    to_local() gradients), treated as the global one
  dropout-rng       --engine tp: the dropout after the row-parallel reduction (a replicated region) draws its
                    mask from a generator seeded per rank (the sharded region's seeding, Megatron's
                    model-parallel RNG, used where every tp rank must draw one mask): the reduced output
                    differs across the tp ranks
  sp-unreduced-head --engine sp: under sequence parallelism the head, held whole by every rank, sees only
                    the rank's sequence chunk; its weight gradient is never all-reduced over tp

The model is plain PyTorch: tensor parallel by DTensor's parallelize_module (the up projection column-wise,
the down projection row-wise, the head column-wise with vocabulary-parallel logits) plus a hand-written
sequence-parallel norm; sequence parallel (--engine sp) as torchtitan lays it out: the embedding row-wise
to sequence shards, torch's SequenceParallel norms, up column-wise from sequence shards, down row-wise
back to them, and the head and the loss on each rank's own sequence chunk (the rank's loss is its tokens'
share of the batch's: the tp ranks' losses differ, and their sum is the loss); FSDP2 by fully_shard.
Attach records what the styles declare Replicate by default (no forward= here). Each rank also writes what
the bug changes, measured in plain torch at step 1 (not through disttrace), to MEASURE-rank<R>.json: the
loss, the row-parallel output's sum, the norm's reduced gradient's norm, the clip norm used; under sp the
head's reduced gradient's norm, and the summed loss beside the same model's loss computed whole in one
process from the gathered weights.

    python tests/scripts/tp_bugs.py --out runs [--engine tp|sp|fsdp] [--bug NAME] [--measure PREFIX]
"""

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import disttrace.api  # disttrace

VOCAB, DIM, HIDDEN, SEQ, BATCH = 32, 16, 32, 8, 4


class _AllReduce(torch.autograd.Function):
    """Megatron's reduce-from-tensor-parallel region: sum over the group forward, identity backward (every
    rank of the group computes the same downstream loss)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SPNorm(nn.Module):
    """RMSNorm run sequence-parallel: each tp rank normalises its own chunk of the sequence, the chunks are
    gathered back. Its weight is a plain tensor every rank holds whole; its gradient is a partial sum over
    the rank's chunk and must be all-reduced over tp (Megatron's sequence-parallel norm gradients)."""

    def __init__(self, dim, mesh):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.mesh = mesh

    def forward(self, x):
        xs = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        xs = xs.redistribute(self.mesh, [Shard(1)]).to_local()
        ys = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        y = DTensor.from_local(ys, self.mesh, [Shard(1)], run_check=False)
        return y.redistribute(self.mesh, [Replicate()]).to_local()


class Down(nn.Linear):
    """The row-parallel down projection (RowwiseParallel in the plan) on a fused path over the local shards.
    The fix sums the partial products over tp before tagging the result Replicate; the bug tags the local
    partial sum Replicate as it is, so the style's output hook sees nothing to reduce."""

    unsummed = False

    def forward(self, x):
        out = F.linear(x.to_local(), self.weight.to_local())
        if not self.unsummed:
            out = _AllReduce.apply(out, x.device_mesh.get_group())
        # dropout in the replicated region: every tp rank must draw the same mask
        out = F.dropout(out, p=0.1, training=self.training)
        return DTensor.from_local(out, x.device_mesh, [Replicate()], run_check=False)


class TPModel(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = SPNorm(DIM, mesh)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = Down(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h)  # this rank's shard of the vocabulary's logits


def vocab_parallel_loss(local, targets, group, rank, world, smoothing=0.1, local_stats=False):
    """Cross-entropy with label smoothing over logits sharded on the vocabulary (Megatron's)."""
    vl = local.shape[-1]
    lo, vocab = rank * vl, vl * world
    m = local.detach().max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = _AllReduce.apply(torch.exp(local - m[..., None]).sum(-1), group)
    logz = torch.log(z) + m
    inside = (targets >= lo) & (targets < lo + vl)
    picked = local.gather(-1, (targets - lo).clamp(0, vl - 1)[..., None])[..., 0] * inside
    target_logit = _AllReduce.apply(picked, group)
    if local_stats:  # the bug: the local shard's mean logit stands for the vocabulary's
        mean_logit = local.sum(-1) / vl
    else:
        mean_logit = _AllReduce.apply(local.sum(-1), group) / vocab
    nll = logz - target_logit
    return ((1 - smoothing) * nll + smoothing * (logz - mean_logit)).mean()


def batch(step, rank=0, size=BATCH):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def train_tp(rank, world, args):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    torch.manual_seed(0)
    model = TPModel(mesh)
    model.down.unsummed = args.bug == "unsummed-row"
    parallelize_module(
        model,
        mesh,
        {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel()},
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = disttrace.api.attach(
        model, optimizer, out=args.out, name="tp-bugs", config={"bug_family": "tp"}
    )  # disttrace
    if args.bug == "dropout-rng":  # the bug: a per-rank seed where the tp ranks share one stream
        torch.manual_seed(1234 + rank)
    measured = {}
    down_sum = []
    model.down.register_forward_hook(lambda m, i, o: down_sum.append(float(o.detach().sum())))
    for step in range(1, args.steps + 1):
        tokens, targets = batch(step)  # every tp rank reads the same batch
        optimizer.zero_grad()
        local_logits = model(tokens)
        loss = vocab_parallel_loss(
            local_logits, targets, group, rank, world, local_stats=args.bug == "loss-local-stats"
        )
        loss = run.loss(loss)  # disttrace
        loss.backward()
        if args.bug != "unreduced-norm":
            dist.all_reduce(model.norm.weight.grad, group=group)
        if step == 1:
            measured = {
                "loss": float(loss.detach()),
                "down_sum": down_sum[0],
                "norm_grad": float(model.norm.weight.grad.norm()),
            }
        optimizer.step()
    return run, measured


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = RMSNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.final_norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)  # this rank's chunk of the sequence
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(self.final_norm(h))  # the logits of this rank's chunk


def whole_loss(model, tokens, targets):
    """The sequence-parallel model's loss computed whole, in one process, from its gathered weights."""

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    h = F.embedding(tokens, full(model.embed.weight))
    up = F.linear(rms(h, full(model.norm.weight)), full(model.up.weight), full(model.up.bias))
    h = h + F.linear(torch.tanh(up), full(model.down.weight))
    logits = F.linear(rms(h, full(model.final_norm.weight)), full(model.head.weight))
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train_sp(rank, world, args):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    torch.manual_seed(0)
    model = SPModel()
    parallelize_module(
        model,
        mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=True),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "final_norm": SequenceParallel(use_local_output=True),
        },
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = disttrace.api.attach(
        model, optimizer, out=args.out, name="sp-bugs", config={"bug_family": "sp"}
    )  # disttrace
    measured = {}
    chunk = SEQ // world
    for step in range(1, args.steps + 1):
        tokens, targets = batch(step)  # every tp rank reads the same batch
        optimizer.zero_grad()
        local_logits = model(tokens)
        mine = targets[:, rank * chunk : (rank + 1) * chunk]
        # this rank's tokens' share of the batch's mean loss: the tp ranks' losses sum to it
        loss = F.cross_entropy(local_logits.reshape(-1, VOCAB), mine.reshape(-1), reduction="sum")
        loss = run.loss(loss / targets.numel())  # disttrace
        if step == 1:
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            measured = {
                "loss": float(loss.detach()),
                "loss_total": float(total),
                "loss_whole": float(whole_loss(model, tokens, targets)),
            }
        loss.backward()
        if args.bug != "sp-unreduced-head":
            dist.all_reduce(model.head.weight.grad, group=group)
        if step == 1:
            measured["head_grad"] = float(model.head.weight.grad.norm())
        optimizer.step()
    return run, measured


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, HIDDEN)
        self.b = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train_fsdp(rank, world, args):
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = disttrace.api.attach(
        model, optimizer, out=args.out, name="fsdp-clip", config={"bug_family": "fsdp"}
    )  # disttrace
    measured = {}
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each dp rank its own data
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
        optimizer.zero_grad()
        loss = run.loss(F.mse_loss(model(x), y))  # disttrace
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if args.bug == "local-clip":
            local = torch.nn.utils.get_total_norm([p.grad.to_local() for p in params])
            total = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, total)
        if step == 1:
            measured = {"loss": float(loss.detach()), "clip_norm": float(total.full_tensor())}
        optimizer.step()
    return run, measured


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        train = {"tp": train_tp, "sp": train_sp, "fsdp": train_fsdp}[args.engine]
        run, measured = train(rank, world, args)
        run.close()  # disttrace
        if args.measure:
            with open(f"{args.measure}-rank{rank}.json", "w") as f:
                json.dump(measured, f)
        if rank == 0:
            print(run.run_dir, flush=True)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="tp", choices=["tp", "sp", "fsdp"])
    ap.add_argument(
        "--bug",
        default="none",
        choices=[
            "none",
            "loss-local-stats",
            "unsummed-row",
            "unreduced-norm",
            "local-clip",
            "dropout-rng",
            "sp-unreduced-head",
        ],
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--measure", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
