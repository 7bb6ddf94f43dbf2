"""The gate's policy: the thresholds a candidate is judged by and which checks decide the verdict.

The policy belongs to the reference, never to the candidate: a run cannot loosen the tolerance it is judged
by (`--set eval.loss_rtol=0.9` on the candidate is reported and ignored). It comes from, in this order:
`--policy FILE` (TOML, the shape below), the reference run's frozen manifest (`eval.loss_rtol`), or the
defaults when there is neither.

    [eval]
    loss_rtol = 0.02            # eval loss within this relative difference of the reference's
    # the user's own evaluation (docs/gate.md, "Your own evaluation"); run by gate/usereval.py
    command = ["python", "eval.py", "{checkpoint}", "{data}"]
    metric = "eval_loss"        # the key of the JSON object on the command's last stdout line
    better = "lower"            # lower | higher | either (either: within the tolerance on both sides)
    rtol = 0.02                 # default loss_rtol; atol = 0.0
    timeout_s = 600
    env = ["PYTHONPATH"]        # the names passed through; otherwise only PATH
    data = "heldout.jsonl"      # relative to this file's directory (the command's working directory)
    data_sha256 = "..."         # checked before the command runs
    [equivalence]
    max_sensitivity = 1e-4      # an equal numeric diff must have held each phase to a bound at most this
    max_sensitivity_by_phase = { reduce = 2e-5 }   # per phase, in place of max_sensitivity there
    max_sensitivity_by_class = { attention = 1e-5 }  # per tensor class (or exp_avg_sq), at every phase
    [checks]
    required = ["checkpoint_integrity", "eval_metric"]   # default: every check; the others are advisory
    require_all = false         # true: a check that cannot apply (n/a) fails, as `gate --require-all`

No torch here: the gate's readers run on a laptop.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from disttrace.errors import BadInput

# every check the gate runs, in its order; a policy may name only these
CHECK_NAMES = (
    "store_integrity",
    "checkpoint_integrity",
    "collective_sync",
    "replica_consistency",
    "gradient_equivalence",
    "replay",
    "eval_metric",
    "complete",
)
DEFAULT_LOSS_RTOL = 0.02  # the manifest's own default (config/manifest.py, Eval.loss_rtol)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EvalPolicy(_Strict):
    loss_rtol: float = Field(default=DEFAULT_LOSS_RTOL, ge=0)
    # the user's own evaluation: absent (None) for the harness's built-in one
    command: list[str] | None = Field(
        default=None, description="argv; {checkpoint}, {data} and {run} are filled in"
    )
    metric: str = "eval_loss"
    better: Literal["lower", "higher", "either"] = "lower"
    rtol: float | None = Field(default=None, ge=0, description="default: loss_rtol")
    atol: float = Field(default=0.0, ge=0)
    timeout_s: float = Field(default=600.0, gt=0)
    env: list[str] = Field(default_factory=list, description="variables passed through")
    data: str | None = Field(default=None, description="the held-out data (file or directory)")
    data_sha256: str | None = None
    cwd: str | None = Field(default=None, description="the command's working directory")

    @field_validator("loss_rtol", "rtol", "atol", "timeout_s", mode="before")
    @classmethod
    def _finite(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v)  # TOML `1` is an int; a tolerance of 1 is meant
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("command")
    @classmethod
    def _argv(cls, v):
        if v is not None and (not v or not v[0]):
            raise ValueError("names no program")
        return v

    @field_validator("data_sha256")
    @classmethod
    def _sha(cls, v):
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("is not a sha256 (64 lowercase hex digits)")
        return v

    @field_validator("env")
    @classmethod
    def _names(cls, v):
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable's name")
        return v

    @model_validator(mode="after")
    def _data_fixed(self):
        if self.command is not None and (self.data is None or self.data_sha256 is None):
            raise ValueError(
                "an evaluation command needs its held-out data fixed: data and data_sha256 "
                "(disttrace.api.data_sha256(PATH) computes it)"
            )
        return self

    @property
    def tolerance(self) -> tuple[float, float]:
        """(rtol, atol) for the user's metric: rtol falls back to loss_rtol."""
        return (self.loss_rtol if self.rtol is None else self.rtol), self.atol


def _figures(v, names: tuple[str, ...], what: str):
    """A table of sensitivities by name: each name one of `names`, each figure a finite number >= 0."""
    if not isinstance(v, dict):
        return v
    out = {}
    for name, x in v.items():
        if name not in names:
            raise ValueError(f"unknown {what} '{name}'; the {what}s are: {', '.join(names)}")
        if isinstance(x, int) and not isinstance(x, bool):
            x = float(x)
        if not isinstance(x, float) or not math.isfinite(x) or x < 0:
            raise ValueError(f"{name}: {x!r} is not a sensitivity (a finite number >= 0)")
        out[name] = x
    return out


class EquivalencePolicy(_Strict):
    """What `gradient_equivalence` requires of a numeric diff's sensitivity (docs/gate.md, "How sharp an
    equivalence must be"): the largest bound a phase's records were held to, over the compared steps."""

    max_sensitivity: float | None = Field(
        default=None, ge=0, description="the largest bound any phase may have been held to"
    )
    max_sensitivity_by_phase: dict[str, float] = Field(
        default_factory=dict, description="per phase, in place of max_sensitivity"
    )
    max_sensitivity_by_class: dict[str, float] = Field(
        default_factory=dict,
        description="per tensor class (or exp_avg_sq), at every phase, besides the phase's figure",
    )

    @field_validator("max_sensitivity", mode="before")
    @classmethod
    def _finite(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("max_sensitivity_by_phase", mode="before")
    @classmethod
    def _phases(cls, v):
        from disttrace.store.records import PHASES

        return _figures(v, PHASES, "phase")

    @field_validator("max_sensitivity_by_class", mode="before")
    @classmethod
    def _classes(cls, v):
        from disttrace.model.names import CLASSES

        return _figures(v, (*CLASSES, "exp_avg_sq"), "class")

    def required(self, phase: str) -> float | None:
        """The largest bound the policy accepts at `phase` (None: no requirement)."""
        return self.max_sensitivity_by_phase.get(phase, self.max_sensitivity)


class ChecksPolicy(_Strict):
    required: list[str] | None = Field(
        default=None, description="checks that decide the verdict (default: all)"
    )
    require_all: bool = False

    @field_validator("required")
    @classmethod
    def _known(cls, v):
        if v is not None and not v:
            raise ValueError("names no check: a gate that nothing decides would pass every run")
        for name in v or []:
            if name not in CHECK_NAMES:
                raise ValueError(
                    f"unknown check '{name}'; the gate's checks are: {', '.join(CHECK_NAMES)}"
                )
        return v


class GatePolicy(_Strict):
    eval: EvalPolicy = EvalPolicy()
    equivalence: EquivalencePolicy = EquivalencePolicy()
    checks: ChecksPolicy = ChecksPolicy()

    def is_required(self, check: str) -> bool:
        return (
            self.checks.require_all or self.checks.required is None or check in self.checks.required
        )


def read_policy(path: Path) -> GatePolicy:
    """A policy TOML file, or BadInput naming the file and the field."""
    import tomllib

    from disttrace.config.freezing import read_text_file

    text = read_text_file(Path(path), "policy")
    try:
        doc = tomllib.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadInput(path, f"invalid TOML ({e})") from None
    try:
        return GatePolicy.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = {"extra_forbidden": "unknown key", "missing": "required key is missing"}.get(
            err["type"], err["msg"]
        )
        msg = msg.removeprefix("Value error, ")
        if err["type"] not in ("extra_forbidden", "missing", "value_error") and "input" in err:
            msg = f"{msg} (got {err['input']!r})"
        raise BadInput(path, msg, field=field) from None


USER_EVAL_KEYS = (
    "command",
    "metric",
    "better",
    "rtol",
    "atol",
    "timeout_s",
    "env",
    "data_sha256",
)  # what a manifest's [eval] may state of the user's evaluation; its data path and working directory
# are the machine's, in the lock's `resolved` (eval_data, eval_cwd), as the harness's data paths are


def from_manifest(manifest: dict, where: str | Path, resolved: dict | None = None) -> GatePolicy:
    """The policy a frozen manifest states (eval.loss_rtol, and the user's evaluation command when it names
    one); the manifest states no required checks."""
    ev = manifest.get("eval") if isinstance(manifest, dict) else None
    rtol = ev.get("loss_rtol", DEFAULT_LOSS_RTOL) if isinstance(ev, dict) else DEFAULT_LOSS_RTOL
    try:
        policy = GatePolicy(eval=EvalPolicy(loss_rtol=rtol))
    except ValidationError:
        raise BadInput(
            where, f"{rtol!r} is not a tolerance (a number >= 0)", field="manifest.eval.loss_rtol"
        ) from None
    if not isinstance(ev, dict) or ev.get("command") is None:
        return policy
    resolved = resolved if isinstance(resolved, dict) else {}
    stated = {k: ev[k] for k in USER_EVAL_KEYS if k in ev}
    stated.update(
        loss_rtol=policy.eval.loss_rtol,
        data=resolved.get("eval_data"),
        cwd=resolved.get("eval_cwd"),
    )
    try:
        return GatePolicy(eval=EvalPolicy.model_validate(stated))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(["manifest.eval", *(str(x) for x in err["loc"])])
        raise BadInput(where, err["msg"].removeprefix("Value error, "), field=field) from None


def resolve(
    reference_dir: Path | None,
    reference_manifest: dict | None,
    policy_file: Path | None,
    require_all: bool,
) -> tuple[GatePolicy, str]:
    """-> (policy, where it came from). A policy file wins over the reference's manifest; the candidate's
    manifest is never consulted here."""
    if policy_file is not None:
        policy, source = read_policy(policy_file), f"policy file {policy_file}"
        policy = _relative_to(policy, Path(policy_file).resolve().parent)
    elif reference_manifest is not None:
        from disttrace.store.jsonlines import read_json

        lock = Path(reference_dir) / "manifest.lock.json"
        resolved = read_json(lock).get("resolved")
        policy = from_manifest(reference_manifest, lock, resolved)
        source = f"reference manifest {lock}"
    else:
        policy, source = GatePolicy(), "default"
    if require_all:
        policy = policy.model_copy(
            update={"checks": policy.checks.model_copy(update={"require_all": True})}
        )
    return policy, source


def _relative_to(policy: GatePolicy, base: Path) -> GatePolicy:
    """A policy file's data and working directory are relative to the file's own directory."""
    ev = policy.eval
    if ev.command is None:
        return policy
    data = base / ev.data if ev.data is not None else None
    cwd = base / ev.cwd if ev.cwd is not None else base
    return policy.model_copy(
        update={"eval": ev.model_copy(update={"data": str(data), "cwd": str(cwd)})}
    )


def candidate_differences(policy: GatePolicy, candidate_manifest: dict) -> dict:
    """What the candidate's own manifest states differently from the policy in force (reported, ignored)."""
    ev = candidate_manifest.get("eval") if isinstance(candidate_manifest, dict) else None
    stated = ev.get("loss_rtol") if isinstance(ev, dict) else None
    if (
        isinstance(stated, (int, float))
        and not isinstance(stated, bool)
        and stated != policy.eval.loss_rtol
    ):
        return {"eval.loss_rtol": stated}
    return {}


def as_record(policy: GatePolicy, source: str, ignored: dict) -> dict:
    """verdict.json's `policy`: the policy in force (the policy-file shape), its source, what was ignored."""
    return {**policy.model_dump(), "source": source, "candidate_ignored": ignored}
