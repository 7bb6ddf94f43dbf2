"""A Hugging Face Trainer run that saves a checkpoint every step, for `disttrace replay` from its checkpoint:
a tiny LlamaForCausalLM (2 ranks on gloo under torchrun), one optimizer step an epoch (8 sequences, 4 a rank),
so every checkpoint is at an epoch's end and the Trainer resumes it without skipping batches. Each save
writes the Trainer's checkpoint (HF_OUT/checkpoint-K) and disttrace's (DisttraceCallback(checkpoints=True)).

    torchrun --nproc-per-node 2 tests/scripts/hf_replay.py OUT HF_OUT [HF_CHECKPOINT DISTTRACE_CHECKPOINT]

With the two checkpoints, the Trainer resumes its own (trainer.train(resume_from_checkpoint=)) and the
callback disttrace's (resume=), which must be of the same step. The learning rate is constant: attach reads
the optimizer's param groups into the manifest, and after the Trainer's resume a decaying schedule's lr is
the one at the checkpoint's step, another manifest than the run's (docs/replay.md).
"""

import sys

import torch
from hf_train import dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from disttrace.integrations.hf import DisttraceCallback


def main(out, hf_out, hf_ckpt=None, dt_ckpt=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=hf_out,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        lr_scheduler_type="constant",  # see docs/replay.md: a scheduled lr is read into the manifest at attach
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_strategy="no",
        save_strategy="steps",
        save_steps=1,
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset(n=8))
    callback = DisttraceCallback(
        trainer, out=out, name="hf-replay", checkpoints=True, resume=dt_ckpt
    )
    trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=hf_ckpt)
    if trainer.args.process_index == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
