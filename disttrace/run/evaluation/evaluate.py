"""The gate's independent evaluation, run as a fresh single process (`python -m disttrace.run.evaluation.evaluate RUN`):
not the training job, no process group. It verifies and consolidates the run's final checkpoint into the
plain model, and scores the held-out split the manifest fixed before training."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import orjson

from disttrace.config.freezing import verified_data
from disttrace.errors import BadInput, DisttraceError
from disttrace.store import checkpoints as checkpoint
from disttrace.store.checkpoints import final_checkpoint
from disttrace.store.rundir import Run
from disttrace.store.writers import write_json_atomic


def model_shape(source: Run):
    """The model `source`'s manifest describes, as the harness's `Model` (what the evaluation builds: the
    job validated the same section); BadInput naming the lock and the field otherwise."""
    from pydantic import ValidationError

    from disttrace.config.manifest import Model

    try:
        return Model.model_validate(source.manifest_doc.get("model"))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(["model", *map(str, err["loc"])])
        raise BadInput(source.path / "manifest.lock.json", err["msg"], field=field) from None


def evaluate(run_dir: Path, data_dir: Path | None = None) -> dict:
    """Score `run_dir`'s final checkpoint on the held-out split of `data_dir`'s manifest (the reference:
    its data, split and eval batches, hash-checked), or of the run's own manifest without one."""
    import torch

    from disttrace.data.windows import TokenData
    from disttrace.model.llama import build_model, lm_loss

    torch.set_num_threads(1)
    run = Run(run_dir)
    source = Run(data_dir) if data_dir is not None else run
    m = (
        source.manifest
    )  # what is scored, and how: never the candidate's word when a reference is given
    ckpt = final_checkpoint(run)
    index = checkpoint.verify(ckpt, run.manifest_id)
    data_path, tok_path = verified_data(source)
    data = TokenData(source.manifest_doc, data_path, tok_path)
    if data.split_report.get("eval_in_train", 1) != 0:
        raise BadInput(data_path, "an eval document is also in the training split")
    # the stored weights' dtype is the run's (a topology field); the model's shape is the experiment's
    dtype = getattr(torch, run.manifest.training.dtype)
    model = build_model(model_shape(source), dtype, seed=0)  # weights come from the checkpoint
    state = {"model": model.state_dict()}
    from disttrace.run.job import safeload

    safeload.load(
        state, ckpt, no_dist=True
    )  # consolidates every shard; nothing of the checkpoint's code runs
    model.load_state_dict(state["model"])
    model.eval()
    total_loss, tokens, correct = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in data.eval_batches(m.eval.batch_size, m.eval.max_batches):
            logits = model(inputs)
            total_loss += float(lm_loss(logits, targets)) * targets.numel()
            correct += int((logits.argmax(-1) == targets).sum())
            tokens += targets.numel()
    if tokens == 0:
        raise BadInput(data_path, "the held-out split has no full sequence to score")
    loss = total_loss / tokens
    return {
        "checkpoint": ckpt.name,
        "checkpoint_step": index["step"],
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 700)),
        "token_accuracy": correct / tokens,
        "tokens": tokens,
        "split": {
            "eval_sha256": data.split_report["eval_sha256"],
            "train_sha256": data.split_report["train_sha256"],
            "n_eval_docs": data.split_report["n_eval"],
            "eval_in_train": data.split_report["eval_in_train"],
        },
        "process": "fresh single process, no process group",
        "data_from": str(source.path),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    data_dir = Path(argv[1]) if len(argv) > 1 else None
    try:
        result = evaluate(run_dir, data_dir)
    except DisttraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    write_json_atomic(run_dir / "eval.json", result)
    print(orjson.dumps(result).decode())  # the gate reads this line, not the file in the run store
    return 0


if __name__ == "__main__":
    sys.exit(main())
