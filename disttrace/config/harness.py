"""An attached run that trains a harness experiment, so that the two compare.

A script of one's own (DeepSpeed's engine, DDP, FSDP2 ...) may train exactly what the harness trains for a
frozen manifest: the harness's plain LLaMA (`model.llama.build_model(manifest.model, dtype, seed)`), its token
windows (`harness_windows(lock)` below), its optimiser. It says so by attaching with
`config=harness_config(lock)`: the experiment fields of the lock go into the attached manifest's config under
`harness_experiment`. Diff then holds an attached run and a harness run to that experiment, and never takes
the statement on trust where attach can see for itself (config/identity.py, `claim_differences`):

- the stated fields against the harness lock's, field by field (another lr, another seed, other data: named);
- what attach observed against the harness manifest: the seed given to attach, the steps, the model's
  parameter names and shapes (the harness model's are a function of `model`, model/names.py), the
  optimizer's class and every param group's hyper-parameters (lr, betas, eps, weight decay, amsgrad,
  maximize), any other key of the user's config (the harness has none: a difference);
- the global batch the attached run counted against the harness's stated one (as for any pair).

What attach cannot see (which windows the script read, which initial weights it built) is not stated away:
a script that reads other windows or builds another initialisation computes other gradients, and the
numeric diff diverges at step 1's `reduce`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrace.config.freezing import Frozen, read_lock
from disttrace.config.identity import CLAIM, claimed_fields, get_field

if TYPE_CHECKING:
    from disttrace.data.windows import TokenData


def harness_config(lock) -> dict:
    """attach's `config=` for a script that trains the experiment of `lock` (a lock's path, `Frozen`, or its
    dict): the lock's manifest id and experiment fields, and its step count."""
    if isinstance(lock, (str, Path)):
        lock = read_lock(lock)
    elif not isinstance(lock, Frozen):
        lock = Frozen.model_validate(lock)
    stated: dict[str, Any] = {}
    for f in claimed_fields():
        section, _, key = f.partition(".")
        v = get_field(lock.manifest, f)
        if key:
            stated.setdefault(section, {})[key] = v
        else:
            stated[section] = v
    return {
        CLAIM: {"manifest_id": lock.manifest_id, **stated},
        "steps": lock.model().training.steps,
    }


def harness_windows(lock_path: str | Path) -> TokenData:
    """The token windows a harness run of a frozen manifest reads (the lock `disttrace freeze -o` writes),
    for a training script of one's own that trains the same experiment on the same data:
    `harness_windows(lock).batch(step, micro_batch, dp_rank)` is what the harness's rank `dp_rank` reads at
    that (step, micro-batch). The data and tokenizer files the lock resolved are hashed against the lock's
    sha256 first, so the windows are the frozen experiment's or nothing."""
    from disttrace.data.windows import TokenData  # torch: only for a script that trains

    lock = read_lock(lock_path)
    data = TokenData(lock.manifest, lock.data_path, lock.tokenizer_path)
    stated = data.layout.tokenizer.sha256
    if data.tok.sha256 != stated:
        from disttrace.errors import BadInput

        raise BadInput(
            lock_path,
            f"the tokenizer at {lock.tokenizer_path} has sha256 {data.tok.sha256[:12]}..., "
            f"not the lock's {str(stated)[:12]}...",
            field="manifest.tokenizer.sha256",
        )
    return data
