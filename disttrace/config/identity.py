"""What makes two manifests one experiment: the fields that define what is computed (diff and the gate
refuse a pair that differs in them) and those of its topology (compared numerically), read from the stored
JSON of each side; an attached run's lock states what it observed, not a default, and may state the harness
experiment it trains (config/harness.py writes that statement; `claim_differences` holds the run to it)."""

from __future__ import annotations

from typing import Any

from disttrace.model.names import parameter_names
from disttrace.store.records import ATTACHED_SOURCES

# Fields that make two manifests different experiments (diff refuses them) vs a different topology of
# one experiment (diff compares them numerically).
EXPERIMENT_FIELDS = (
    "experiment.edition",
    "experiment.seed",
    "data.sha256",
    "data.eval_percent",
    "data.split_salt",
    "tokenizer.sha256",
    "model",
    "training.steps",
    "training.lr",
    "training.optimizer",
    "training.weight_decay",
    "training.beta1",
    "training.beta2",
    "optimizer",
    "config",  # attached runs (disttrace.api): the optimizer's hyper-parameters, the user's config
)


TOPOLOGY_FIELDS = (
    "parallelism",
    "training.micro_batch_size",
    "training.grad_accum_steps",
    "training.dtype",
)


def get_field(manifest: dict, dotted: str) -> Any:
    cur: Any = manifest
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def global_batch(manifest: dict) -> int:
    """Samples per optimizer step as the tolerance's reduction size reads it (a missing factor taken as 1:
    a bound must have a number). Experiment identity never uses this: see known_global_batch."""
    p, t = manifest.get("parallelism", {}), manifest.get("training", {})
    return (
        int(p.get("dp", 1)) * int(t.get("micro_batch_size", 1)) * int(t.get("grad_accum_steps", 1))
    )


def harness_manifest(manifest: dict) -> bool:
    """Whether the harness's trainer froze this manifest (it names its data); an attached run's states what
    attach saw of a script, and no data section."""
    return manifest.get("data") is not None


def known_global_batch(manifest: dict, observed: dict | None = None) -> tuple[int | None, str]:
    """(samples per optimizer step summed over the world, where that number comes from), or (None, why not).

    A harness manifest states it (dp x micro-batch x accumulation, every factor required at freeze). An
    attached run counts it (`observed`, written at close: each data replica's first recorded step's batches,
    run.batch's or the forward's first tensor's leading dimension); failing that, the user's config when it
    states both the micro-batch size and the accumulation count. Never a factor defaulted to 1."""
    p, t = manifest.get("parallelism", {}) or {}, manifest.get("training", {}) or {}
    if harness_manifest(manifest):  # frozen with every factor
        return global_batch(manifest), "stated"
    obs = observed if isinstance(observed, dict) else {}
    if _count(obs.get("global_batch")):
        return obs["global_batch"], "observed"
    factors = (p.get("dp"), t.get("micro_batch_size"), t.get("grad_accum_steps"))
    if all(_count(f) for f in factors):
        return factors[0] * factors[1] * factors[2], "stated"
    why = str(obs.get("why") or "")[:200] or (
        "the run recorded no batch it could count"
        if observed is not None
        else "the run did not finish (its observed batch is written at close)"
    )
    return None, why


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_UNSET = object()


def _experiment_leaves(section: Any, prefix: str) -> dict[str, Any]:
    if isinstance(section, dict) and section:
        out: dict[str, Any] = {}
        for k, v in section.items():
            out.update(_experiment_leaves(v, f"{prefix}.{k}"))
        return out
    return {prefix: section}


def _unknown(field: str, value: Any) -> bool:
    """Nobody stated it: absent, or None where None means "not given" (an optimizer's None, as torch's
    foreach=None, is a setting and compared)."""
    return value is _UNSET or (value is None and not field.startswith("optimizer."))


def experiment_differences(
    lock_a: dict, lock_b: dict
) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """(the experiment fields two runs' locks state differently, the fields one of them does not know).

    Between two attached runs (disttrace.api), a field one side does not know (an absent config key, a
    training setting attach could not see, a global batch never counted) is not compared: refusing it would
    call two equivalent experiments different. Every field both state is compared, so two different
    experiments are still refused. A harness manifest is frozen with every field; a harness run and an
    attached one are held to every field either states (different kinds of manifest never pass by
    knowing little)."""
    ma, mb = lock_a.get("manifest") or {}, lock_b.get("manifest") or {}
    lenient = _attached(lock_a) and _attached(lock_b)
    diffs: list[tuple[str, Any, Any]] = []
    unknown: list[str] = []

    def side(x, y) -> str:
        return "A and B" if _unknown("", x) and _unknown("", y) else "A" if _unknown("", x) else "B"

    claimed = _claimed_pair(lock_a, lock_b)
    if claimed is not None:  # an attached run stating the harness experiment it trains: held to it
        diffs += claimed
    for f in (x for x in EXPERIMENT_FIELDS if x != "experiment.edition" and claimed is None):
        va, vb = get_field(ma, f), get_field(mb, f)
        if va is None and vb is None:
            continue
        if va is None or vb is None:  # a whole section one side lacks
            if lenient:
                unknown.append(f"{f} ({side(va, vb)})")
            else:
                diffs.append((f, va, vb))
            continue
        la, lb = _experiment_leaves(va, f), _experiment_leaves(vb, f)
        for k in sorted(set(la) | set(lb)):
            x, y = la.get(k, _UNSET), lb.get(k, _UNSET)
            if lenient and (_unknown(k, x) or _unknown(k, y)):
                if not (_unknown(k, x) and _unknown(k, y)):
                    unknown.append(f"{k} ({side(x, y)})")
                continue
            x, y = (None if v is _UNSET else v for v in (x, y))
            if x != y:
                diffs.append((k, x, y))
    known = [
        known_global_batch(m, lk.get("observed") if _attached(lk) else None)
        for m, lk in ((ma, lock_a), (mb, lock_b))
    ]
    (ga, _), (gb, _) = known
    if ga is not None and gb is not None:
        if ga != gb:
            diffs.append(("global_batch", ga, gb))
    else:
        why = "; ".join(f"{s}: {w}" for s, (g, w) in zip("AB", known) if g is None)
        unknown.append(f"global_batch ({why})")
    return diffs, unknown


def _claimed_pair(lock_a: dict, lock_b: dict) -> list[tuple[str, Any, Any]] | None:
    """A harness lock and an attached one that states a harness experiment (claim_of below): the
    fields in which they are not one experiment, as (field, A's, B's); None for any other pair."""
    if not _attached(lock_a) and claim_of(lock_b) is not None:
        return claim_differences(lock_a, lock_b)
    if not _attached(lock_b) and claim_of(lock_a) is not None:
        return [(f, y, x) for f, x, y in claim_differences(lock_b, lock_a)]
    return None


def observed_topology_differences(lock_a: dict, lock_b: dict) -> list[tuple[str, Any, Any]]:
    """How two attached runs split their batch as they counted it (each rank's micro-batches and samples in
    its first step): a script states no accumulation count, yet 2 x 3 and 1 x 6 are two topologies."""
    if not (_attached(lock_a) and _attached(lock_b)):
        return []
    oa, ob = lock_a.get("observed"), lock_b.get("observed")
    if not (isinstance(oa, dict) and isinstance(ob, dict)):
        return []
    return [
        (f"observed.{k}", oa.get(k), ob.get(k))
        for k in ("micro_batches", "samples")
        if oa.get(k) != ob.get(k)
    ]


def unknown_line(unknown: list[str]) -> str | None:
    """The one line diff prints for the experiment fields it did not compare."""
    if not unknown:
        return None
    return "not compared, unknown to one side: " + ", ".join(unknown)


def _attached(lock: dict) -> bool:
    return lock.get("source") in ATTACHED_SOURCES


# ---- an attached run that states the harness experiment it trains (config/harness.py writes the statement)

CLAIM = "harness_experiment"
# the harness's AdamW (run/parallel/common.py) is torch.optim.AdamW with torch's eps; SGD is plain SGD
_ADAM_EPS = 1e-8
_OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}


def claimed_fields() -> tuple[str, ...]:
    """The experiment fields an attached run states when it claims a harness experiment."""
    return tuple(
        f for f in EXPERIMENT_FIELDS if f not in ("experiment.edition", "optimizer", "config")
    )


def model_tensors(model: dict) -> dict[str, list[int]]:
    """The harness model's parameter shapes by name, in registration order (model/llama.py), from the
    manifest's model section alone."""
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
    if lock.get("source") not in ATTACHED_SOURCES:
        return None
    config = (lock.get("manifest") or {}).get("config")
    claim = config.get(CLAIM) if isinstance(config, dict) else None
    return claim if isinstance(claim, dict) else None


def claim_differences(harness_lock: dict, attached_lock: dict) -> list[tuple[str, Any, Any]]:
    """(field, the harness's value, the attached run's) for every way the attached run is not the harness
    lock's experiment: its statement against the lock, what attach observed against the statement's
    experiment. Empty: the same experiment (the global batch is compared by the caller, as for any pair)."""
    h = harness_lock.get("manifest") or {}
    a = attached_lock.get("manifest") or {}
    claim = claim_of(attached_lock) or {}
    diffs: list[tuple[str, Any, Any]] = []

    def compare(field: str, want: Any, got: Any) -> None:
        if want != got or type(want) is bool and type(got) is not bool:
            diffs.append((field, want, got))

    # what the script states, against the lock it is compared with
    for f in claimed_fields():
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
