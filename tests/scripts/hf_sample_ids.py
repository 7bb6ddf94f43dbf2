"""A Hugging Face Trainer run (2 ranks on gloo under torchrun) whose data carries its own index: every item has
an `idx` field, and the model logs, per training forward, the `idx` it was handed and the optimizer step it
belongs to (LOG/rank{R}.jsonl), the oracle for the sample ids disttrace records. 24 items, batch 4, accumulation
2: 3 batches per rank and epoch, so 4 steps span two epochs (windows of 2 and 1 micro-batches).

    torchrun --nproc-per-node 2 tests/scripts/hf_sample_ids.py OUT LOG [VARIANT]

VARIANT: "" (the Trainer's default SeedableRandomSampler), "sequential" (train_sampling_strategy),
"unseeded" (use_seedable_sampler=False: a RandomSampler whose generator accelerate synchronises at each epoch,
which cannot be read ahead: no ids must be recorded), or "twice" (a Trainer whose compute_loss runs the model
twice on each batch: two forwards per batch, which a count of forwards would pair with the wrong batches).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from disttrace.integrations.hf import DisttraceCallback


class Logged(LlamaForCausalLM):
    log: Path
    step = 0

    def forward(self, input_ids=None, labels=None, idx=None, **kwargs):
        if self.training and torch.is_grad_enabled():
            with open(self.log, "a") as f:
                f.write(json.dumps({"step": self.step, "idx": idx.tolist()}) + "\n")
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


class TwiceTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        first = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return (
            first + super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        ) / 2


class StepOfModel(TrainerCallback):
    """The optimizer step the next micro-batches belong to, told to the model at each accumulation window."""

    def __init__(self, model):
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        self.model.step = state.global_step + 1


def main(out, log, variant=""):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids, "idx": i}
        for i, ids in enumerate(torch.randint(0, 32, (24, 8), generator=g).tolist())
    ]
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = Logged(config)
    extra = {"train_sampling_strategy": "sequential"} if variant == "sequential" else {}
    if variant == "unseeded":
        extra["accelerator_config"] = {"use_seedable_sampler": False}
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        **extra,
    )
    trainer = (TwiceTrainer if variant == "twice" else Trainer)(
        model=model, args=args, train_dataset=data
    )
    model.log = Path(log) / f"rank{dist.get_rank()}.jsonl"
    callback = DisttraceCallback(trainer, out=out, name="hf-sample-ids")
    trainer.add_callback(StepOfModel(model))
    trainer.add_callback(callback)
    trainer.train()
    if trainer.args.process_index == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
