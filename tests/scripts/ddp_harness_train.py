"""A torch user's DDP loop of the harness's experiment: the frozen manifest's model (the harness's plain LLaMA,
model/llama.py), its token windows (config/harness.harness_windows), torch's AdamW with the lock's settings,
accumulation under no_sync, clipping when the manifest clips, attached to disttrace with the lock's experiment
stated (config/harness.py), so `disttrace diff HARNESS_RUN THIS_RUN` compares them.

    disttrace freeze --set training.max_grad_norm=1.0 -o lock.json
    disttrace run lock.json                                     # the harness (DDP for dp = 2)
    torchrun --nproc-per-node 2 tests/scripts/ddp_harness_train.py OUT --lock lock.json

Control: --skew-lr-rank1 runs rank 1's optimizer at 1.001 x the lr (rank 0's, the one the manifest and
the statement hold, is right: only the recorded learning rates show it).
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api
from disttrace.config.freezing import read_lock
from disttrace.config.harness import harness_config, harness_windows
from disttrace.model.llama import build_model, lm_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lock", required=True)
    ap.add_argument("--skew-lr-rank1", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    frozen = read_lock(args.lock)
    m = frozen.model()
    t = m.training
    data = harness_windows(args.lock)
    # as the harness wraps it: its only buffers are RoPE tables, identical everywhere
    model = DDP(
        build_model(m.model, getattr(torch, t.dtype), m.experiment.seed), broadcast_buffers=False
    )
    lr = t.lr * (1 + 1e-3 if args.skew_lr_rank1 and rank == 1 else 1)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=(t.beta1, t.beta2),
        weight_decay=t.weight_decay,
        foreach=False,
    )
    run = disttrace.api.attach(
        model,
        opt,
        out=args.out,
        name="ddp-harness",
        edition=m.experiment.edition,
        seed=m.experiment.seed,
        config=harness_config(frozen),
    )
    accum = t.grad_accum_steps
    for step in range(1, t.steps + 1):
        opt.zero_grad(set_to_none=False)
        for mb in range(accum):
            batch = data.batch(step, mb, rank)
            run.batch(batch["inputs"], batch["sample_ids"])
            ctx = model.no_sync() if mb < accum - 1 else torch.enable_grad()
            with ctx:
                loss = run.loss(lm_loss(model(batch["inputs"]), batch["targets"]))
                (loss / accum).backward()
        if t.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
    run.close()
    if rank == 0:
        print(run.run_dir)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
