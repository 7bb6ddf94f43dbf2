"""A DeepSpeed user's training loop of the harness's experiment: the frozen manifest's model (the harness's plain
LLaMA, model/llama.py), its token windows (config/harness.harness_windows), the optimiser and batch the DeepSpeed
config says (the same config `disttrace freeze --from-deepspeed` imported into the lock), attached to disttrace
with the lock's experiment stated (config/harness.py), so `disttrace diff HARNESS_RUN THIS_RUN` compares them.

    disttrace freeze --from-deepspeed ds_config.json -o lock.json
    disttrace run lock.json                                     # the harness (FSDP2 for ZeRO-2/3)
    torchrun --nproc-per-node 2 tests/scripts/ds_harness_train.py OUT --lock lock.json --ds-config ds_config.json

Controls: --lr-scale multiplies the learning rate DeepSpeed's optimizer uses (the script then trains another
experiment than it states), --init-seed builds the model from another seed than the manifest's (a script bug
attach cannot see), --window-step-offset reads the windows of a later step.
"""

import argparse
import json
import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import disttrace.api  # noqa: E402
from disttrace.config.freezing import read_lock  # noqa: E402
from disttrace.config.harness import harness_config, harness_windows  # noqa: E402
from disttrace.model.llama import build_model, lm_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lock", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--lr-scale", type=float, default=1.0)
    ap.add_argument("--init-seed", type=int, default=None)
    ap.add_argument("--window-step-offset", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    frozen = read_lock(args.lock)
    m = frozen.model()
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    data = harness_windows(args.lock)
    seed = m.experiment.seed if args.init_seed is None else args.init_seed
    model = build_model(m.model, getattr(torch, m.training.dtype), seed)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    for group in optimizer.param_groups:
        group["lr"] *= args.lr_scale
    dp_rank = torch.distributed.get_rank(group=engine.data_parallel_group)
    blocks = [f"layers.{i}" for i in range(m.model.n_layers)] + ["norm", "output"]
    run = disttrace.api.attach(
        engine,
        optimizer,
        out=args.out,
        name="ds-harness",
        edition=m.experiment.edition,
        seed=m.experiment.seed,
        config=harness_config(frozen),
        forward=blocks if m.record.forward else False,
    )
    accum = engine.gradient_accumulation_steps()
    for step in range(1, m.training.steps + 1):
        for mb in range(accum):
            batch = data.batch(step + args.window_step_offset, mb, dp_rank)
            run.batch(batch["inputs"], batch["sample_ids"])
            loss = run.loss(lm_loss(engine(batch["inputs"]), batch["targets"]))
            engine.backward(loss)  # DeepSpeed scales by 1/accumulation, as the harness's loop does
            engine.step()
    run.close()
    if torch.distributed.get_rank() == 0:
        print(run.run_dir)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
