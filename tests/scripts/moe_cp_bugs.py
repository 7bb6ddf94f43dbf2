"""A user-style script with torch's own collectives: expert parallel (a mixture's experts split over 2 ranks,
tokens by all_to_all_single) or context parallel (each sequence split over a cp group of 2 ranks, keys and values
all-gathered), DDP for the rest, attached to disttrace in the marked lines. `--bug` plants one public family:

  router-detached  (--family ep) the combine weights are detached on the way back from the experts: the
                   forward and the loss are bit for bit the fix's, the router gets no gradient from the
                   language-model loss (the family of https://github.com/huggingface/transformers/issues/48687)
  label-roll       (--family cp) each rank's labels are its own input slice rolled by one, so the label at
                   the end of a slice is the slice's first token instead of the next slice's
                   (the family of https://github.com/volcengine/verl/issues/4250)
  dp-same-data     (--family cp --world 4) every cp group reads the first group's batch: the data-parallel
                   shards are one (a missing sampler), what `check`'s "data differs" rule is for

The script measures its bug's effect itself, without disttrace, and prints it on stderr: the router
gradient's norm (ep), the loss next to the one correct labels give (cp).

    python tests/scripts/moe_cp_bugs.py --family ep|cp --out runs [--bug NAME]
    disttrace run -- python tests/scripts/moe_cp_bugs.py --family ep|cp --no-attach [--bug NAME]

--no-attach leaves the marked lines out (the script as its author wrote it) for zero-code recording. Attached,
the cp family says what attach cannot see, that both ranks read one batch: attach(layout={"cp": ...}).
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api  # disttrace

VOCAB, DIM, SEQ, EXPERTS, TOP_K = 32, 16, 8, 4, 2
CP = 2  # the context-parallel group's size


class ExpertParallelMoE(nn.Module):
    """E experts, E / world of them on this rank; token-choice top-k; tokens travel by all-to-all."""

    def __init__(self, rank, world, detach_weights=False):
        super().__init__()
        self.rank, self.world, self.local = rank, world, EXPERTS // world
        self.detach_weights = detach_weights
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        g = torch.Generator().manual_seed(1)
        full = torch.randn(EXPERTS, DIM, DIM, generator=g) * 0.3
        self.experts = nn.Parameter(full[rank * self.local : (rank + 1) * self.local].clone())

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, DIM)
        probs = F.softmax(self.router(x), -1)
        weights, chosen = probs.topk(TOP_K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        # the load-balancing term (Switch): the router's only gradient when the combine detaches it
        share = (counts.to(probs.dtype) / counts.sum()).detach()
        self.aux = 0.01 * EXPERTS * (share * probs.mean(0)).sum()
        arrived = torch.empty_like(counts)
        dist.all_to_all_single(arrived, counts)
        send = counts.view(self.world, self.local).sum(1).tolist()
        got = arrived.view(self.world, self.local)
        recv = got.sum(1).tolist()
        tokens = dnn.all_to_all_single(x.new_empty(sum(recv), DIM), x[order // TOP_K], recv, send)
        # arrivals by source rank, each source's by local expert: one expert at a time over each block
        out, at = [], 0
        for s in range(self.world):
            for e in range(self.local):
                n = int(got[s, e])
                out.append(torch.tanh(tokens[at : at + n] @ self.experts[e]))
                at += n
        back = dnn.all_to_all_single(x.new_empty(sum(send), DIM), torch.cat(out), send, recv)
        routed = torch.empty_like(back).index_copy(0, order, back).view(-1, TOP_K, DIM)
        w = weights.detach() if self.detach_weights else weights
        return (routed * w.unsqueeze(-1)).sum(1).view(shape)


class ContextParallelAttention(nn.Module):
    """Queries of this rank's slice, keys and values of the whole sequence (all-gathered), causal."""

    def __init__(self, cp_rank, cp, group):
        super().__init__()
        self.start, self.group = cp_rank * (SEQ // cp), group
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)

    def gather(self, t):
        """The whole sequence from every rank's slice, differentiably: each slice zero-padded to its place
        and all-reduced (x + 0 is exact, so the values are an all-gather's). Not torch.distributed.nn's
        all_gather: its backward fails on a subgroup (the ranks' global and group numbers mixed up)."""
        before = t.new_zeros(t.shape[0], self.start, t.shape[2])
        after = t.new_zeros(t.shape[0], SEQ - self.start - t.shape[1], t.shape[2])
        return dnn.all_reduce(torch.cat([before, t, after], 1), group=self.group)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k, v = self.gather(k), self.gather(v)
        rows = torch.arange(self.start, self.start + q.shape[1])
        mask = rows[:, None] >= torch.arange(k.shape[1])[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class TinyLM(nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = mixer
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.mixer(h))


def batch(shard, step):
    """(inputs, labels) of one micro-batch of data-parallel shard `shard`: a sequence of SEQ + 1 tokens,
    labels shifted by one. Under ep each rank is its own shard; under cp the ranks of a cp group read one
    batch and take their slices."""
    g = torch.Generator().manual_seed(100 * step + shard)
    seq = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


class Recording:
    """disttrace.api.attach's run, or, with --no-attach, nothing: each call hands its value back."""

    def __init__(self, on, net, optimizer, args, config, layout):
        self.run = None
        if on:
            self.run = disttrace.api.attach(
                net,
                optimizer,
                out=args.out,
                name=f"{args.family}-bugs",
                config=config,
                layout=layout,
            )

    def batch(self, x):
        if self.run is not None:
            self.run.batch(x)

    def loss(self, loss):
        return loss if self.run is None else self.run.loss(loss)

    def close(self):
        if self.run is not None:
            self.run.close()
            return self.run.run_dir
        return None


def train(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.family == "ep":
        mixer = ExpertParallelMoE(rank, world, detach_weights=args.bug == "router-detached")
    else:  # cp groups of CP consecutive ranks; data parallel across them
        groups = [dist.new_group(list(range(g, g + CP))) for g in range(0, world, CP)]
        cpg = groups[rank // CP]
        mixer = ContextParallelAttention(rank % CP, CP, cpg)
    model = TinyLM(mixer)
    if args.family == "ep":  # the experts are this rank's own: DDP leaves them alone
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["mixer.experts"])
    net = DDP(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {"family": args.family, "steps": args.steps, "grad_accum_steps": 1}
    config["micro_batch_size"] = 4
    # a context-parallel group is invisible to attach (plain all_gather, no mesh): the script says it
    layout = {"cp": cpg} if args.family == "cp" else None
    run = Recording(not args.no_attach, net, optimizer, args, config, layout)  # disttrace
    size = SEQ // CP
    at = rank % CP * size  # this rank's slice of a cp group's sequence
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        if args.family == "ep":
            shard = rank
        else:  # dp-same-data: every cp group reads the first group's batch
            shard = 0 if args.bug == "dp-same-data" else rank // CP
        inputs, labels = batch(shard, step)
        if args.family == "cp":
            mine = inputs[:, at : at + size]
            if args.bug == "label-roll":
                targets = torch.roll(mine, -1, dims=1)  # the slice's own tokens, rolled
            else:
                targets = labels[:, at : at + size]
            run.batch(inputs)  # disttrace
            logits = net(mine)
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
            loss = dnn.all_reduce(ce, group=cpg) / labels.numel()
            if step == 1:  # the effect, measured by the script: the loss correct labels give
                right = labels[:, at : at + size]
                with torch.no_grad():
                    good = F.cross_entropy(
                        logits.reshape(-1, VOCAB), right.reshape(-1), reduction="sum"
                    )
                    dist.all_reduce(good, group=cpg)
                if rank == 0:
                    print(
                        f"effect: loss {float(loss.detach()):.6f} vs correct labels' "
                        f"{float(good) / labels.numel():.6f}",
                        file=sys.stderr,
                    )
        else:
            run.batch(inputs)  # disttrace
            logits = net(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
            loss = loss + model.mixer.aux
        loss = run.loss(loss)  # disttrace
        loss.backward()
        if args.family == "ep":
            # each rank's experts hold every rank's tokens' gradient: the data-parallel mean
            model.mixer.experts.grad.div_(world)
            if step == 1 and rank == 0:
                norm = float(model.mixer.router.weight.grad.norm())
                print(f"effect: router gradient norm {norm:.6g}", file=sys.stderr)
        optimizer.step()
    run_dir = run.close()  # disttrace
    if rank == 0 and run_dir is not None:
        print(run_dir, flush=True)  # disttrace


def spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True, choices=["ep", "cp"])
    ap.add_argument(
        "--bug", default="none", choices=["none", "router-detached", "label-roll", "dp-same-data"]
    )
    ap.add_argument("--world", type=int, default=2, help="ep: 2 or 4; cp: a multiple of 2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs")
    ap.add_argument(
        "--no-attach", action="store_true", help="no attach call: for zero-code recording"
    )
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
