"""A Lightning run (strategy="ddp", 2 CPU ranks under torchrun) whose data carries its own index: each item is
(x, y, idx), and training_step logs the `idx` it was handed and the optimizer step it belongs to
(LOG/rank{R}.jsonl), the oracle for the sample ids disttrace records. 24 items, batch 4, shuffled, accumulation
2: 3 batches per rank and epoch, so 3 steps span two epochs (Lightning steps at an epoch's end).

    torchrun --nproc-per-node 2 tests/scripts/lightning_sample_ids.py OUT LOG [VARIANT]

VARIANT: "" (Lightning's DistributedSampler), "self-call" (training_step calls the module's own forward, a
second forward inside DDP's), or "random" (use_distributed_sampler=False: the loader's RandomSampler, which
cannot be read ahead: no ids must be recorded).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from disttrace.integrations.lightning import DisttraceCallback


class Indexed(Dataset):
    def __init__(self, n=24):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Tiny(L.LightningModule):
    def __init__(self, log: Path, self_call: bool):
        super().__init__()
        self.log, self.self_call = log, self_call
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y, idx = batch
        with open(self.log, "a") as f:
            f.write(json.dumps({"step": self.trainer.global_step + 1, "idx": idx.tolist()}) + "\n")
        out = self(x) if self.self_call else self.net(x)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out, log, variant=""):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    callback = DisttraceCallback(out=out, name="lightning-sample-ids")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=variant != "random",
    )
    module = Tiny(Path(log) / f"rank{trainer.global_rank}.jsonl", variant == "self-call")
    trainer.fit(module, DataLoader(Indexed(), batch_size=4, shuffle=True))
    if trainer.global_rank == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
