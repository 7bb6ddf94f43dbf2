"""The gate's policy: the thresholds a candidate is judged by and which checks decide the verdict.

The policy belongs to the reference, never to the candidate: a run cannot loosen the tolerance it is judged
by (`--set eval.loss_rtol=0.9` on the candidate is reported and ignored). It comes from, in this order:
`--policy FILE` (TOML, the shape below), the reference run's frozen manifest (`eval.loss_rtol`), or the
defaults when there is neither.

    [eval]
    loss_rtol = 0.02            # eval loss within this relative difference of the reference's
    [checks]
    required = ["checkpoint_integrity", "eval_metric"]   # default: every check; the others are advisory
    require_all = false         # true: a check that cannot apply (n/a) fails, as `gate --require-all`

No torch here: the gate's readers run on a laptop.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from disttrace.errors import BadInput

# every check the gate runs, in its order; a policy may name only these
CHECK_NAMES = (
    "store_integrity",
    "checkpoint_integrity",
    "collective_sync",
    "replica_consistency",
    "gradient_equivalence",
    "eval_metric",
    "complete",
)
DEFAULT_LOSS_RTOL = 0.02  # the manifest's own default (config/manifest.py, Eval.loss_rtol)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EvalPolicy(_Strict):
    loss_rtol: float = Field(default=DEFAULT_LOSS_RTOL, ge=0)

    @field_validator("loss_rtol", mode="before")
    @classmethod
    def _finite(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v)  # TOML `1` is an int; a tolerance of 1 is meant
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


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
    checks: ChecksPolicy = ChecksPolicy()

    def is_required(self, check: str) -> bool:
        return (
            self.checks.require_all or self.checks.required is None or check in self.checks.required
        )


def read_policy(path: Path) -> GatePolicy:
    """A policy TOML file, or BadInput naming the file and the field."""
    import tomllib

    from disttrace.config.manifest import read_text_file

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


def from_manifest(manifest: dict, where: str | Path) -> GatePolicy:
    """The policy a frozen manifest states (today: eval.loss_rtol); the manifest states no required checks."""
    ev = manifest.get("eval") if isinstance(manifest, dict) else None
    rtol = ev.get("loss_rtol", DEFAULT_LOSS_RTOL) if isinstance(ev, dict) else DEFAULT_LOSS_RTOL
    try:
        return GatePolicy(eval=EvalPolicy(loss_rtol=rtol))
    except ValidationError:
        raise BadInput(
            where, f"{rtol!r} is not a tolerance (a number >= 0)", field="manifest.eval.loss_rtol"
        ) from None


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
    elif reference_manifest is not None:
        lock = Path(reference_dir) / "manifest.lock.json"
        policy, source = from_manifest(reference_manifest, lock), f"reference manifest {lock}"
    else:
        policy, source = GatePolicy(), "default"
    if require_all:
        policy = policy.model_copy(
            update={"checks": policy.checks.model_copy(update={"require_all": True})}
        )
    return policy, source


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
