"""A Lightning run (strategy="ddp", 2 CPU ranks under torchrun) whose callback names the gate's evaluation
(eval_command=); Lightning's own ModelCheckpoint also writes its .ckpt at the end, so a test can score both.

    torchrun --nproc-per-node 2 tests/scripts/lightning_eval_train.py OUT HELDOUT.pt CKPT_DIR
"""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from disttrace.integrations.lightning import DisttraceCallback

HERE = os.path.dirname(os.path.abspath(__file__))
W = torch.linspace(-1, 1, 8)[:, None]  # the rule learned: y = x @ W


class Regress(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def samples(seed: int, n: int):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, x @ W


def main(out, data, ckpt_dir):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    callback = DisttraceCallback(
        out=out,
        name="lightning-eval",
        eval_command=[
            "python",
            os.path.join(HERE, "lightning_eval_score.py"),
            "{checkpoint}",
            "{data}",
        ],
        evaluation={"data": data, "rtol": 0.01, "env": ["PYTHONPATH", "OMP_NUM_THREADS"]},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        callbacks=[callback, ModelCheckpoint(dirpath=ckpt_dir, filename="last")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regress(), DataLoader(TensorDataset(*samples(0, 64)), batch_size=4))
    if trainer.global_rank == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
