"""A Lightning run that saves a checkpoint at every epoch's end (one optimizer step), for `disttrace replay` from
its checkpoint: the tiny regression module of lightning_train.py (strategy="ddp" on 2 CPU ranks under torchrun,
clipping), one step an epoch (8 samples, 4 a batch and a rank, no accumulation: docs/replay.md says why).
Each save writes Lightning's checkpoint (PL_OUT/step=K.ckpt) and disttrace's (DisttraceCallback(checkpoints=True)).

    torchrun --nproc-per-node 2 tests/scripts/lightning_replay.py OUT PL_OUT [PL_CHECKPOINT DISTTRACE_CHECKPOINT]

With the two checkpoints, the fit resumes Lightning's (ckpt_path=) and the callback disttrace's (resume=).
"""

import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_train import Tiny
from torch.utils.data import DataLoader, TensorDataset

from disttrace.integrations.lightning import DisttraceCallback


def main(out, pl_out, pl_ckpt=None, dt_ckpt=None):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g))
    callback = DisttraceCallback(out=out, name="lightning-replay", checkpoints=True, resume=dt_ckpt)
    saves = ModelCheckpoint(
        dirpath=pl_out,
        filename="{step}",
        every_n_epochs=1,
        save_top_k=-1,
        save_on_train_epoch_end=True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=1,
        gradient_clip_val=1.0,
        callbacks=[callback, saves],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # the loader's own generator: its iterators' base seeds are not drawn from torch's global one, whose state
    # disttrace's checkpoint holds (a resumed fit creates one iterator fewer before it)
    loader = DataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(0))
    trainer.fit(Tiny(), loader, ckpt_path=pl_ckpt)
    if trainer.global_rank == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
