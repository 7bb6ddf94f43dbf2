"""A Lightning run (a tiny regression module, accumulation 2, clipping, strategy="ddp" on 2 CPU ranks under
torchrun), recorded through disttrace.integrations.lightning.

    torchrun --nproc-per-node 2 tests/scripts/lightning_train.py OUT [ACCUM BATCH [skew-lr]]

ACCUM x BATCH: accumulate_grad_batches and the loader's batch size (default 2 x 4); 1 x 8 trains on the same
16 samples a step (the DistributedSampler gives each rank every other sample, in order). skew-lr: the
control that must diverge, rank 1's learning rate off by 1e-3 relative (the manifest, rank 0's, shows 0.1).
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from disttrace.integrations.lightning import DisttraceCallback


class Tiny(L.LightningModule):
    def __init__(self, skew=False):
        super().__init__()
        self.skew = skew
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        lr = 0.1 * (1 + 1e-3) if self.skew and self.global_rank == 1 else 0.1
        return torch.optim.SGD(self.parameters(), lr=lr)


def main(out, accum=2, batch=4, variant=""):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    callback = DisttraceCallback(out=out, name="lightning-tiny")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=accum,
        gradient_clip_val=1.0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(variant == "skew-lr"), DataLoader(data, batch_size=batch))
    if trainer.global_rank == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(x) for x in sys.argv[2:4]), *sys.argv[4:5])
