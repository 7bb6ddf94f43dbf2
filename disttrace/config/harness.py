"""An attached run that trains a harness experiment, so that the two compare.

A script of one's own (DeepSpeed's engine, DDP, FSDP2 ...) may train exactly what the harness trains for a
frozen manifest: the harness's plain LLaMA (`model.llama.build_model(manifest.model, dtype, seed)`), its token
windows (`harness_windows(lock)` below), its optimiser. It says so by attaching with
`config=harness_config(lock)`: the experiment fields of the lock go into the attached manifest's config under
`harness_experiment`. Diff then holds an attached run and a harness run to that experiment, and never takes
the statement on trust where attach can see for itself (`claim_differences`):

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

if TYPE_CHECKING:
    from disttrace.data.windows import TokenData

CLAIM = "harness_experiment"
# the harness's AdamW (run/parallel/common.py) is torch.optim.AdamW with torch's eps; SGD is plain SGD
_ADAM_EPS = 1e-8
_OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}


def _fields() -> tuple[str, ...]:
    from disttrace.config.identity import EXPERIMENT_FIELDS

    return tuple(
        f for f in EXPERIMENT_FIELDS if f not in ("experiment.edition", "optimizer", "config")
    )


def harness_config(lock) -> dict:
    """attach's `config=` for a script that trains the experiment of `lock` (a lock's path, `Frozen`, or its
    dict): the lock's manifest id and experiment fields, and its step count."""
    from disttrace.config.identity import get_field
    from disttrace.config.manifest import Frozen, read_lock

    if isinstance(lock, (str, Path)):
        lock = read_lock(lock)
    if isinstance(lock, Frozen):
        lock = lock.model_dump()
    m = lock["manifest"]
    stated: dict[str, Any] = {}
    for f in _fields():
        section, _, key = f.partition(".")
        v = get_field(m, f)
        if key:
            stated.setdefault(section, {})[key] = v
        else:
            stated[section] = v
    return {CLAIM: {"manifest_id": lock["manifest_id"], **stated}, "steps": m["training"]["steps"]}


def model_tensors(model: dict) -> dict[str, list[int]]:
    """The harness model's parameter shapes by name, in registration order (model/llama.py), from the
    manifest's model section alone."""
    from disttrace.model.names import parameter_names

    dim, hidden, vocab = int(model["dim"]), int(model["ffn_hidden"]), int(model["vocab_size"])
    kv = int(model["n_kv_heads"]) * (dim // int(model["n_heads"]))
    block = {
        "attention_norm.weight": [dim],
        "attention.wq.weight": [dim, dim],
        "attention.wk.weight": [kv, dim],
        "attention.wv.weight": [kv, dim],
        "attention.wo.weight": [dim, dim],
        "ffn_norm.weight": [dim],
        "feed_forward.w1.weight": [hidden, dim],
        "feed_forward.w2.weight": [dim, hidden],
        "feed_forward.w3.weight": [hidden, dim],
    }
    out = {}
    for name in parameter_names(model):
        if name == "tok_embeddings.weight" or name == "output.weight":
            out[name] = [vocab, dim]
        elif name == "norm.weight":
            out[name] = [dim]
        else:
            out[name] = block[name.split(".", 2)[2]]
    return out


def claim_of(lock: dict) -> dict | None:
    """The harness experiment an attached lock states it trains, or None."""
    from disttrace.store.records import ATTACHED_SOURCES

    if lock.get("source") not in ATTACHED_SOURCES:
        return None
    config = (lock.get("manifest") or {}).get("config")
    claim = config.get(CLAIM) if isinstance(config, dict) else None
    return claim if isinstance(claim, dict) else None


def claim_differences(harness_lock: dict, attached_lock: dict) -> list[tuple[str, Any, Any]]:
    """(field, the harness's value, the attached run's) for every way the attached run is not the harness
    lock's experiment: its statement against the lock, what attach observed against the statement's
    experiment. Empty: the same experiment (the global batch is compared by the caller, as for any pair)."""
    from disttrace.config.identity import _experiment_leaves, get_field

    h = harness_lock.get("manifest") or {}
    a = attached_lock.get("manifest") or {}
    claim = claim_of(attached_lock) or {}
    diffs: list[tuple[str, Any, Any]] = []

    def compare(field: str, want: Any, got: Any) -> None:
        if want != got or type(want) is bool and type(got) is not bool:
            diffs.append((field, want, got))

    # what the script states, against the lock it is compared with
    for f in _fields():
        want, got = get_field(h, f), get_field(claim, f)
        if isinstance(want, dict) and isinstance(got, dict):
            lw, lg = _experiment_leaves(want, f), _experiment_leaves(got, f)
            for k in sorted(set(lw) | set(lg)):
                compare(k, lw.get(k), lg.get(k))
        else:
            compare(f, want, got)
    # what attach saw, against the harness's experiment
    compare("experiment.seed", get_field(h, "experiment.seed"), get_field(a, "experiment.seed"))
    compare("training.steps", get_field(h, "training.steps"), get_field(a, "training.steps"))
    want_tensors = model_tensors(h["model"]) if isinstance(h.get("model"), dict) else {}
    got_tensors = get_field(a, "model.tensors") or {}
    if list(want_tensors) != list(got_tensors):  # names and registration order (the record indices)
        missing = [n for n in want_tensors if n not in got_tensors]
        extra = [n for n in got_tensors if n not in want_tensors]
        name = (missing or extra or ["order"])[0]
        compare(
            f"model.tensors.{name}",
            want_tensors.get(name),
            (got_tensors.get(name) or {}).get("shape"),
        )
    for n, shape in want_tensors.items():
        if n in got_tensors:
            compare(f"model.tensors.{n}.shape", shape, (got_tensors[n] or {}).get("shape"))
    opt = get_field(h, "training.optimizer")
    compare("training.optimizer", _OPTIMIZERS.get(opt, opt), get_field(a, "training.optimizer"))
    groups = get_field(a, "optimizer.param_groups") or {}
    if not groups:
        compare("optimizer.param_groups", "one or more", groups)
    t = h.get("training") or {}
    for g, group in sorted(groups.items()):
        group = group if isinstance(group, dict) else {}
        want = {"lr": t.get("lr"), "weight_decay": t.get("weight_decay")}
        if opt == "adamw":
            want |= {
                "betas": [t.get("beta1"), t.get("beta2")],
                "eps": _ADAM_EPS,
                "amsgrad": False,
            }
        for key, value in want.items():
            compare(f"optimizer.param_groups.{g}.{key}", value, group.get(key))
        for key in ("maximize", "nesterov"):
            if key in group:
                compare(f"optimizer.param_groups.{g}.{key}", False, group.get(key))
        if opt == "sgd":
            for key in ("momentum", "dampening"):
                if key in group:
                    compare(f"optimizer.param_groups.{g}.{key}", 0, group.get(key))
    for key, value in sorted((a.get("config") or {}).items()):
        if key not in (CLAIM, "steps"):
            compare(f"config.{key}", None, value)
    seen: set[str] = set()  # one entry a field (the seed stated and the seed given to attach, say)
    return [d for d in diffs if not (d[0] in seen or seen.add(d[0]))]


def harness_windows(lock_path: str | Path) -> TokenData:
    """The token windows a harness run of a frozen manifest reads (the lock `disttrace freeze -o` writes),
    for a training script of one's own that trains the same experiment on the same data:
    `harness_windows(lock).batch(step, micro_batch, dp_rank)` is what the harness's rank `dp_rank` reads at
    that (step, micro-batch). The data and tokenizer files the lock resolved are hashed against the lock's
    sha256 first, so the windows are the frozen experiment's or nothing."""
    from disttrace.config.manifest import read_lock
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
