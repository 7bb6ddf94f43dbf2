"""A Hugging Face Trainer run (a tiny LlamaForCausalLM, 2 ranks on gloo under torchrun) whose callback names
the gate's evaluation (eval_command=), learning a fixed next-token rule so that a longer-trained model scores
lower on held-out sequences of it.

    torchrun --nproc-per-node 2 tests/scripts/hf_eval_train.py OUT HELDOUT.json [stale-final]

stale-final: the planted bug, the final checkpoint holds the model as it was after step 1 (a callback ahead
of disttrace's puts the step-1 weights back at the end of training).
"""

import copy
import os
import sys
import tempfile

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from disttrace.integrations.hf import DisttraceCallback

VOCAB, LENGTH = 32, 8
HERE = os.path.dirname(os.path.abspath(__file__))


def build_model():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


def rows(seed: int, n: int) -> list[dict]:
    """input_ids whose every next token is (5 * token + 3) % VOCAB: labels are the ids (the model shifts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [int(torch.randint(0, VOCAB, (1,), generator=g))]
        for _ in range(LENGTH - 1):
            ids.append((ids[-1] * 5 + 3) % VOCAB)
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def heldout() -> list[dict]:
    return rows(999_999, 32)


class StaleFinal(TrainerCallback):
    """The bug: the step-1 weights are what the run ends with, after every step was trained and recorded."""

    def __init__(self):
        self.after_step_1 = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.after_step_1 = copy.deepcopy(model.state_dict())

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.load_state_dict(self.after_step_1)


def main(out, data, variant=""):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=8,
        learning_rate=3e-2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows(0, 64))
    if variant == "stale-final":
        trainer.add_callback(StaleFinal())
    callback = DisttraceCallback(
        trainer,
        out=out,
        name="hf-eval",
        eval_command=["python", os.path.join(HERE, "hf_eval_score.py"), "{checkpoint}", "{data}"],
        evaluation={"data": data, "rtol": 0.01, "env": ["PYTHONPATH", "OMP_NUM_THREADS"]},
    )
    trainer.add_callback(callback)
    trainer.train()
    if trainer.args.process_index == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
