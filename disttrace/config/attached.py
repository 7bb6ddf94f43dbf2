"""The manifest an attached run writes (`run/attach/`, public `disttrace.api`): not a harness experiment
but what attach sees of the user's script (the model's tensors, the optimizer and its hyper-parameters, the
world and the engine) plus the user's own config.

Its sections share the harness manifest's names where they mean the same thing (`parallelism.dp`,
`training.grad_accum_steps`, ...), so the fault checks read either through attribute access. It never
refuses what a user's script legitimately holds (any seed, an optimizer's own kind of hyper-parameter), and
`document()` gives back, byte for byte, the dict attach hashes into the manifest id (an int stays an int).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, JsonValue

from disttrace.config.manifest import Checkpoint, Section

# a number for torch's optimizers; whatever JSON value another optimizer keeps under that name, as it is
Hyper = JsonValue | None


class AttachedExperiment(Section):
    name: str = Field(description="the name given to attach, or the script's")
    edition: str = Field(description="protocol version label, as for a harness manifest")
    seed: int = Field(description="the seed given to attach, or the default generator's")
    description: str = Field(default="", description="free text for people")


class AttachedMesh(Section):
    dims: dict[str, int] = Field(description="each mesh dimension's size, by name")
    replicate: list[str] = Field(description="dimensions some parameter is replicated over")
    shard: list[str] = Field(description="dimensions some parameter is sharded over")


class AttachedParallelism(Section):
    dp: int = Field(ge=1, description="DDP's (DeepSpeed's) group size; the world without DDP")
    tp: int = Field(
        default=1,
        ge=1,
        description="the tensor-parallel group's size: mesh dimensions beside dp a DTensor is sharded over",
    )
    pp: int = Field(default=1, ge=1, description="pipeline stages (attach sees none: 1)")
    zero_stage: int = Field(
        default=0, ge=0, le=3, description="3 under FSDP2, DeepSpeed's ZeRO stage, else 0"
    )
    world_size: int = Field(ge=1, description="the process group's size")
    architecture: Literal["allreduce", "parameter-server"] = Field(
        default="allreduce", description="always allreduce for an attached run"
    )
    engine: Literal["plain", "DDP", "FSDP2", "DTensor", "DeepSpeed"] = Field(
        description="what wraps the model, as attach recognised it"
    )
    mesh: AttachedMesh | None = Field(
        default=None, description="the DTensor parameters' device mesh, when there is one"
    )


class TensorShape(Section):
    shape: list[int] = Field(description="the parameter's logical shape")
    dtype: str = Field(description="the parameter's dtype")


class AttachedModel(Section):
    model_config = ConfigDict(populate_by_name=True)

    class_name: str = Field(alias="class", description="the module's class, qualified name")
    parameters: int = Field(ge=0, description="element count over every parameter")
    tensors: dict[str, TensorShape] = Field(
        description="every parameter's shape and dtype, by name"
    )


class AttachedOptimizer(Section):
    type: str = Field(description="module.QualifiedName of the torch optimizer")
    param_groups: dict[str, dict[str, Any]] = Field(
        description="each group's settings, by group index"
    )


class AttachedTraining(Section):
    optimizer: str = Field(description="the optimizer's class name (AdamW, SGD, ...)")
    dtype: str = Field(description="the parameters' dtype, or 'mixed'")
    lr: Hyper = Field(
        default=None, description="the first param group's lr, as the optimizer keeps it"
    )
    weight_decay: Hyper = Field(default=None, description="the first param group's weight_decay")
    beta1: Hyper = Field(default=None, description="the first param group's betas[0]")
    beta2: Hyper = Field(default=None, description="the first param group's betas[1]")
    grad_accum_steps: int | None = Field(
        default=None, description="from the user's config, if it says"
    )
    micro_batch_size: int | None = Field(
        default=None, description="from the user's config, if it says"
    )
    steps: int | None = Field(default=None, description="from the user's config, if it says")
    max_grad_norm: float | None = Field(
        default=None,
        description="never written by attach; the stand-in "
        "manifest attach checks a fault against sets it",
    )


class AttachedRecord(Section):
    every: int = Field(default=1, ge=1, description="digest every k-th step (steps k, 2k, ...)")
    forward: bool = Field(
        default=False, description="record the named modules' outputs at the forward point"
    )
    forward_modules: list[str] = Field(
        default_factory=list, description="module paths whose outputs are recorded"
    )
    source: Literal["zero-code"] | None = Field(
        default=None,
        description="zero-code: the command never called attach; the model, optimizer, loss and data "
        "were found through torch's process-wide hooks (docs/attach.md)",
    )


class AttachedEval(Section):
    """The evaluation the gate runs on the final checkpoint when this run is the reference (gate/policy.py's
    [eval]); its data path and working directory are the machine's, in the lock's `resolved`."""

    command: list[str] = Field(description="argv; {checkpoint}, {data} and {run} are filled in")
    metric: str = Field(
        default="eval_loss",
        description="the key of the JSON object on the command's last stdout line",
    )
    better: Literal["lower", "higher", "either"] = Field(
        default="lower", description="lower, higher, or either (within the tolerance on both sides)"
    )
    rtol: float | None = Field(
        default=None,
        description="relative tolerance against the reference's metric (unset: the policy's loss_rtol)",
    )
    atol: float = Field(
        default=0.0, description="absolute tolerance against the reference's metric"
    )
    timeout_s: float = Field(
        default=600.0, description="the evaluation process is killed after this"
    )
    env: list[str] = Field(
        default_factory=list,
        description="environment variables passed through (otherwise only PATH)",
    )
    data_sha256: str = Field(description="the evaluation data's sha256, checked before it runs")


class AttachedManifest(Section):
    """What an attached run states about itself: what attach saw, plus the user's config."""

    experiment: AttachedExperiment = Field(description="name, edition, seed")
    parallelism: AttachedParallelism = Field(description="the layout attach inferred")
    model: AttachedModel = Field(description="the attached module and its parameters")
    optimizer: AttachedOptimizer = Field(description="the torch optimizer and its groups")
    training: AttachedTraining = Field(description="the harness's training names attach can fill")
    config: dict[str, Any] = Field(
        default_factory=dict, description="the user's config, as given (JSON-able)"
    )
    record: AttachedRecord | None = Field(default=None, description="what the recorder writes")
    eval: AttachedEval | None = Field(
        default=None, description="the gate's evaluation, when attach was given one"
    )
    checkpoint: Checkpoint | None = Field(
        default=None, description="never written by attach; see max_grad_norm"
    )

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    def document(self) -> dict:
        """The stored JSON shape: only the fields that were given (no defaults added), by their stored names."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)
