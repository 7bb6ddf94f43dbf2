"""Pieces every strategy shares: the optimizer, and the (index, name, tensor) lists the hook points carry."""

from __future__ import annotations

import torch

from disttrace.config.manifest import Manifest
from disttrace.model.llama import lm_loss
from disttrace.run.job.hooks import (
    BeforeClip,
    BeforeOptimizer,
    Clip,
    Optimizer,
    TensorRef,
    grads_of,
)
from disttrace.store.documents import ReplicaRule


def optimizer_class_and_kwargs(manifest: Manifest):
    t = manifest.training
    if t.optimizer == "sgd":
        return torch.optim.SGD, {"lr": t.lr, "weight_decay": t.weight_decay, "foreach": False}
    return torch.optim.AdamW, {
        "lr": t.lr,
        "betas": (t.beta1, t.beta2),
        "weight_decay": t.weight_decay,
        "foreach": False,
    }


def build_optimizer(manifest: Manifest, params):
    cls, kwargs = optimizer_class_and_kwargs(manifest)
    return cls(params, **kwargs)


def optimizer_state_list(optimizer, named: list[tuple[int, str, torch.Tensor]]):
    """Optimizer state this rank holds, as (index, 'param:key', tensor): index = param index * 4 + key slot.
    Under ZeRO-1 only the owner of a parameter's partition holds its state."""
    local = getattr(
        optimizer, "optim", optimizer
    )  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    out = []
    for index, name, p in named:
        st = local.state.get(p, {})
        for slot, key in enumerate(
            sorted(k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1)
        ):
            out.append(TensorRef(index * 4 + slot, f"{name}:{key}", st[key]))
    return out


def optimizer_bytes(optimizer) -> bytes:
    """An optimizer's state as one opaque blob, for state that is private to a rank (a ZeRO-1 partition,
    a pipeline stage): DCP stores it under that rank's own key and hands it back to the same rank.
    Plain `bytes` (not a BytesIO, whose pickle only a full unpickler reads): the checkpoint's own pickle of
    it, and the torch.save inside, both load with weights_only=True (a run store may come from elsewhere)."""
    import io

    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    return buf.getvalue()


OPTIMIZER_BLOB_TEMPLATE = b""  # what a load template holds where a blob will be read


def load_optimizer_bytes(optimizer, blob) -> None:
    import io

    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(
            f"optimizer blob is {type(blob).__name__}, not bytes (a checkpoint of an older format?)"
        )
    optimizer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


SCALAR_INDEX = 1_000_000  # scalars sort after every tensor of their phase
# the global gradient norm, the clip coefficient and the learning rate: one value for the whole job
SCALARS_AGREE = ReplicaRule(
    phase="clip",
    dim="world",
    relation="agree",
    tensors=["grad_norm", "clip_coef", "lr"],
)

# Without sequence parallelism the activations the loop records are replicated over tp: a block's output
# (its wo and w2 are row-wise, reduced to Replicate, and the residual stream adds replicated terms) and the
# final norm's; so is the loss, computed from the logits gathered to Replicate. The recorded `output` is not:
# the loop's hook runs before the style's gather (registered first) and sees this rank's vocabulary shard.
# A tp rank whose copy differs shows the bug at the forward, or loss, that first carries it.
TP_ACTIVATIONS_AGREE = [
    ReplicaRule(phase="forward", dim="tp", relation="agree", exclude="output"),
    ReplicaRule(phase="loss", dim="tp", relation="agree"),
]


def global_norm(grads) -> torch.Tensor:
    """The L2 norm of all gradients of the job. DTensor gradients on one mesh are normed together (torch
    reduces the shards); gradients on different meshes (dp x tp: norm weights on dp, matmuls on dp x tp) and
    plain tensors are combined by their squares."""
    by_mesh: dict = {}
    plain = []
    for g in grads:
        (by_mesh.setdefault(id(g.device_mesh), []) if hasattr(g, "device_mesh") else plain).append(
            g
        )
    parts = []
    for group in by_mesh.values():
        parts.append(
            torch.nn.utils.get_total_norm(
                group, 2.0, error_if_nonfinite=False, foreach=False
            ).full_tensor()
        )
    if plain:
        parts.append(
            torch.nn.utils.get_total_norm(plain, 2.0, error_if_nonfinite=False, foreach=False)
        )
    if len(parts) == 1:
        return parts[0]
    return torch.stack([x.to(parts[0].dtype) for x in parts]).pow(2).sum().sqrt()


def clip_gradients(bus, named, optimizer, max_norm: float | None, norm_group=None) -> None:
    """The `clip` phase, between reduce and optimizer: the global gradient norm, the clip coefficient and
    the learning rate, which every rank must agree on, and the gradients after clipping.

    `before_clip` lets a fault change the norm a rank clips with or the tensors it clips. The global norm
    of sharded gradients (DTensor) is reduced over their mesh by torch; `norm_group` adds a reduction over
    a group whose ranks hold different tensors (pipeline stages)."""
    import torch.distributed as dist

    norm = global_norm([p.grad for _, _, p in named if p.grad is not None])
    if norm_group is not None:
        sq = norm.detach().pow(2)
        dist.all_reduce(sq, group=norm_group)
        norm = sq.sqrt()
    p = bus.emit(BeforeClip(norm=norm, named=named, skip=set(), max_norm=max_norm))
    norm = p.norm
    coef = torch.ones((), dtype=norm.dtype, device=norm.device)
    if max_norm is not None:
        coef = torch.clamp(
            max_norm / (norm + 1e-6), max=1.0
        )  # torch's clip_grads_with_norm_ formula
        factor = float(coef)  # a plain number: DTensor grads on different meshes all take it
        for i, _, param in named:
            if param.grad is not None and i not in p.skip:
                param.grad.mul_(factor)
    lr = (
        torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)
        if optimizer.param_groups
        else None
    )
    scalars = [
        TensorRef(SCALAR_INDEX, "grad_norm", norm.detach()),
        TensorRef(SCALAR_INDEX + 1, "clip_coef", coef.detach()),
    ]
    if lr is not None:
        scalars.append(TensorRef(SCALAR_INDEX + 2, "lr", lr))
    bus.emit(
        Clip(
            grads=grads_of(named, present_only=True) if max_norm is not None else [],
            scalars=scalars,
        )
    )


class Strategy:
    """The interface between the training loop and a parallel layout (docs/design.md, "Strategies").

    Every strategy sets, in its constructor:
      `model`      what the loop calls forward on (the wrapped model, a pipeline stage)
      `plain`      the unwrapped model (its logical parameter count feeds the memory ledger)
      `named`      [(index, name, param)]: the parameters this rank updates, index = registration order
      `optimizer`, `bus`, `max_grad_norm`
    and implements `replicas()`, `micro_batch(last)` and `backward(loss, last)`. What it may declare or
    override instead of being probed for:
      `runs_whole_step`  True when the strategy owns the micro-batch loop (a pipeline schedule
                         interleaves stages): the loop then calls `train_step(batches)` once per step
      `engine_facts()`   what the engine reports of itself, logged when it changes ({} = nothing)
      `loss()`           the loss of what `model` returned (a sequence slice's, completed over its group)
      `groups()`         rank groups its replica rules name beyond the mesh's dimensions
      `spans`            the strategy's own timing of the last step (pipeline forward/backward spans)
      `close()`          release what the engine holds before the process group goes away
    The clip and optimizer phases and checkpoint state through DCP's state-dict helpers (which know DDP,
    FSDP2 and DTensor alike) are shared here; strategies override what differs.
    """

    name: str = "strategy"  # short, for messages
    engine: str = ""  # the torch.distributed engine doing the work, for env.json and `show`
    norm_group = (
        None  # a group whose ranks hold different parameters (pipeline stages): the norm spans it
    )
    runs_whole_step: bool = False
    spans: list | None = None

    # ---- what every strategy implements

    def replicas(self) -> list[ReplicaRule]:
        """Which copies must agree across which mesh dimension, per phase (the replica map, replicas.json)."""
        raise NotImplementedError

    def micro_batch(self, last: bool):
        """A context for one micro-batch: accumulate locally (not last) or synchronise (last)."""
        raise NotImplementedError

    def backward(self, loss, last: bool) -> None:
        """Backward of one micro-batch; emits `backward` (local gradients) and, on the last, `reduce`."""
        raise NotImplementedError

    def train_step(self, batches: list[dict]) -> None:
        """Only for `runs_whole_step` strategies: forward and backward of all micro-batches of a step."""
        raise NotImplementedError(f"{type(self).__name__} does not run whole steps")

    # ---- optional capabilities, with their neutral defaults

    def engine_facts(self) -> dict:
        return {}

    def loss(self, logits, targets):
        """The micro-batch's language-model loss from what `model` returned (context parallel: a slice of
        the sequence, whose loss it completes over the group)."""
        return lm_loss(logits, targets)

    def groups(self) -> dict[str, list[list[int]]]:
        """Rank groups the replica rules name beyond the mesh's dimensions (expert parallel's)."""
        return {}

    def close(self) -> None:
        pass

    def step(self):
        clip_gradients(self.bus, self.named, self.optimizer, self.max_grad_norm, self.norm_group)
        self.bus.emit(BeforeOptimizer(optimizer=self.optimizer, params=self.named))
        self.optimizer.step()
        self.bus.emit(
            Optimizer(
                params=self.named,
                state=optimizer_state_list(self.optimizer, self.named),
                optimizer=self.optimizer,
            )
        )

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, with_optimizer: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not with_optimizer:
            return {"model": get_model_state_dict(self.model)}
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def empty_state(self, with_optimizer: bool) -> dict:
        """A template with the checkpoint's structure, which DCP fills in place on load."""
        return self.state_dict(with_optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if "optim" in state:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:  # a checkpoint saved without optimizer state: the optimizer starts fresh (and diff will say so)
            set_model_state_dict(self.model, state["model"])
