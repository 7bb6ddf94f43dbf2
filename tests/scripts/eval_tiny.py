"""The reference's evaluation of eval_train.py's model: the mean cross-entropy of the next-token rule on
the held-out sequences, printed as the gate's metric line (docs/gate.md's template, filled in).

    python tests/scripts/eval_tiny.py CHECKPOINT HELDOUT.json
"""

import json
import sys

import torch
import torch.nn.functional as F
from eval_train import VOCAB, TinyLM, rule

import disttrace.api as dt


def main(checkpoint, data):
    torch.set_num_threads(1)
    model = TinyLM()
    loaded = dt.load_checkpoint(checkpoint, model)
    model.eval()
    tokens = torch.tensor(json.load(open(data)))
    with torch.no_grad():
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), rule(tokens).reshape(-1))
    dt.print_metric(eval_loss=float(loss), tokens=tokens.numel(), step=loaded.get("step"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
