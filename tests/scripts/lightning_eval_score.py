"""The evaluation of lightning_eval_train.py's module: mean squared error on the held-out samples, printed as
the gate's metric line. CHECKPOINT: the run's final disttrace checkpoint or Lightning's own .ckpt.

    python tests/scripts/lightning_eval_score.py CHECKPOINT HELDOUT.pt
"""

import sys

import torch
from lightning_eval_train import Regress

import disttrace.api as dt


def main(checkpoint, data):
    torch.set_num_threads(1)
    module = Regress()
    dt.load_checkpoint(checkpoint, module)
    module.eval()
    x, y = torch.load(data, weights_only=True)
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(module.net(x), y)
    dt.print_metric(eval_loss=float(mse))


if __name__ == "__main__":
    main(*sys.argv[1:3])
