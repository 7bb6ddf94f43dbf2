"""A Hugging Face Trainer run (a tiny LlamaForCausalLM built from its config, padded sequences, 2 ranks on
gloo under torchrun), recorded through disttrace.integrations.hf.

    torchrun --nproc-per-node 2 tests/scripts/hf_train.py OUT ACCUM BATCH [mean-per-micro-batch]

mean-per-micro-batch: the negative control. The Trainer is told the model takes no loss kwargs, so each
micro-batch's loss is the model's own mean over that micro-batch's tokens, divided by the accumulation count:
the normalisation that huggingface/transformers pull request 34191 replaced, which differs from the
step's token count on padded sequences.
skew-lr: rank 1's learning rate off by 1e-3 relative (the manifest, rank 0's, shows 1e-2): must diverge.
"""

import os
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from disttrace.integrations.hf import DisttraceCallback


def dataset(n=64, length=8, vocab=32):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g)
        keep = int(torch.randint(3, length + 1, (1,), generator=g))
        labels = ids.clone()
        labels[keep:] = -100  # padding: token counts differ between sequences
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def main(out, accum, batch, variant=""):
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
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        max_steps=3,
        learning_rate=1e-2 * (1 + 1e-3)
        if variant == "skew-lr" and os.environ.get("RANK") == "1"
        else 1e-2,
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
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    if variant == "mean-per-micro-batch":
        trainer.model_accepts_loss_kwargs = False
    callback = DisttraceCallback(trainer, out=out, name="hf-tiny-llama")
    trainer.add_callback(callback)
    trainer.train()
    if trainer.args.process_index == 0:
        print(callback.run_dir, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
