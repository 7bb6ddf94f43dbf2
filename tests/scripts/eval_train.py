"""A user-style DDP script (2 ranks on gloo) whose reference names the gate's evaluation: a tiny token model
learning a fixed next-token rule, so a model trained longer scores lower on held-out sequences of the rule.

    python tests/scripts/eval_train.py --out runs --eval-data heldout.json [--accum 2 --micro 4]
        [--stale-final] [--own-eval]

Each step's global batch is the same 16 sequences whatever the split (ranks x accumulation x micro-batch):
--accum 1 --micro 8 is the same experiment in another layout. --stale-final: the planted bug, the final
checkpoint holds the model as it was after step 1 (the script saves the wrong weights), which the
trajectory never sees. --own-eval: the run names its own evaluation (a command that prints a perfect
score, on other data), which a gate judging it as a candidate must ignore.
"""

import argparse
import copy
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api

VOCAB, LENGTH, GLOBAL = 32, 8, 16
HERE = os.path.dirname(os.path.abspath(__file__))
EVAL_SCRIPT = os.path.join(HERE, "eval_tiny.py")


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def rule(tokens):
    """The next token the model learns: a fixed permutation of the current one."""
    return (tokens * 5 + 3) % VOCAB


def sequences(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, LENGTH), generator=g)


def heldout(n: int = 64) -> list[list[int]]:
    return sequences(999_999, n).tolist()


def train(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM()
    net = DDP(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-2)
    assert args.accum * args.micro * world == GLOBAL
    evaluation = None
    if args.eval_data:
        evaluation = {
            "command": ["python", EVAL_SCRIPT, "{checkpoint}", "{data}"],
            "metric": "eval_loss",
            "rtol": 0.01,
            "timeout_s": 120,
            "env": ["PYTHONPATH", "OMP_NUM_THREADS"],
            "data": args.eval_data,
        }
    if args.own_eval:
        evaluation = {
            "command": ["python", "-c", "print('{\"eval_loss\": 0.0}')"],
            "data": args.own_eval,
        }
    config = {"grad_accum_steps": args.accum, "micro_batch_size": args.micro, "steps": args.steps}
    run = disttrace.api.attach(
        net, optimizer, out=args.out, name="eval-train", config=config, evaluation=evaluation
    )
    after_step_1 = None
    for step in range(1, args.steps + 1):
        batch = sequences(step, GLOBAL)[rank * args.accum * args.micro :][: args.accum * args.micro]
        optimizer.zero_grad()
        for mb in range(args.accum):
            tokens = batch[mb * args.micro : (mb + 1) * args.micro]
            run.batch(tokens)
            sync = mb == args.accum - 1
            ctx = net.no_sync() if not sync else torch.enable_grad()
            with ctx:
                logits = net(tokens)
                ce = F.cross_entropy(
                    logits.reshape(-1, VOCAB), rule(tokens).reshape(-1), reduction="sum"
                )
                loss = run.loss(ce / batch.numel())
                loss.backward()
        optimizer.step()
        if step == 1:
            after_step_1 = copy.deepcopy(model.state_dict())
            run.checkpoint(step=1)  # the known-worse model, for the tests' oracle
    if args.stale_final:
        model.load_state_dict(after_step_1)  # the bug: the wrong weights are saved
    run.checkpoint(step=args.steps)
    run.close()
    if rank == 0:
        print(run.run_dir, flush=True)


def spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--eval-data", default=None)
    ap.add_argument("--own-eval", default=None, help="a data file for the run's own evaluation")
    ap.add_argument("--stale-final", action="store_true")
    args = ap.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
