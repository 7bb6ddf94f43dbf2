"""A DeepSpeed user's script, as DeepSpeed's docs write the loop: `deepspeed.initialize` on a tiny model with a
JSON-style config (ZeRO stage, accumulation 2, clipping), `engine.backward(loss)` / `engine.step()` every
micro-batch, attached to disttrace in the marked lines. On CPU DeepSpeed picks its CPU accelerator and gloo.

    torchrun --nproc-per-node 2 tests/scripts/ds_train.py OUT --stage 2 [--steps 3] [--no-attach]
    disttrace inject --fault bitflip-grad ... -- torchrun --nproc-per-node 2 tests/scripts/ds_train.py OUT
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import disttrace.api  # noqa: E402  # disttrace


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def micro_batch(rank, step, mb, size=4):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
    return torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--no-attach", action="store_true")
    ap.add_argument("--checkpoint", action="store_true", help="run.checkpoint() after step 2")
    ap.add_argument(
        "--local_rank", type=int, default=None, help="what the deepspeed launcher passes"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 1_000_000,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    rank = torch.distributed.get_rank()
    run = None
    if not args.no_attach:
        config = {"grad_accum_steps": args.accum, "micro_batch_size": 4, "steps": args.steps}
        run = disttrace.api.attach(engine, optimizer, out=args.out, name="ds-train", config=config)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        for mb in range(args.accum):
            x, y = micro_batch(rank, step, mb)
            loss = ((engine(x) - y) ** 2).mean()
            if run is not None:
                loss = run.loss(loss)  # disttrace
            engine.backward(loss)
            engine.step()
        if args.checkpoint and step == 2 and run is not None:
            run.checkpoint()  # disttrace
    elapsed = time.perf_counter() - t0
    if run is not None:
        run.close()  # disttrace
    if rank == 0:
        print(f"train_seconds {elapsed:.6f}", file=sys.stderr)
        print(run.run_dir if run is not None else args.out)


if __name__ == "__main__":
    main()
