"""The reference's evaluation of hf_eval_train.py's model: the Llama model's own causal-LM loss on the
held-out rows, printed as the gate's metric line. CHECKPOINT may be the run's final disttrace checkpoint or
a Trainer output directory (save_pretrained's files): disttrace.api.load_checkpoint reads either.

    python tests/scripts/hf_eval_score.py CHECKPOINT HELDOUT.json
"""

import json
import sys

import torch
from hf_eval_train import build_model

import disttrace.api as dt


def main(checkpoint, data):
    torch.set_num_threads(1)
    model = build_model()
    dt.load_checkpoint(checkpoint, model)
    model.eval()
    ids = torch.tensor([r["input_ids"] for r in json.load(open(data))])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    dt.print_metric(eval_loss=float(loss), rows=len(ids))


if __name__ == "__main__":
    main(*sys.argv[1:3])
