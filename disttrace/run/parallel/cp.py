"""Context parallel: every sequence split over the `cp` ranks of a group, attention over the whole sequence by
gathering keys and values.

torch's own `context_parallel` (torch.distributed.tensor.experimental) shards SDPA through DTensor and has no
sharding rule for the CPU flash kernel (torch 2.13: `aten._scaled_dot_product_flash_attention_for_cpu ...
does not have a sharding strategy registered`), so this is the plain all-gather form, which runs on gloo and
NCCL alike: rank r of a cp group computes positions [r S/cp, (r+1) S/cp) of every sequence; each attention
gathers the group's keys and values (their gradients summed back to their owners in backward) and masks
causally by global position. The slices are contiguous, not load-balanced: the last rank attends to the
most keys.

From outside the model: a wrapper slices the tokens, the RoPE tables are offset to the slice's positions,
each Attention's `attend` is replaced. The loss is this slice's summed cross entropy, all-reduced over the
group and divided by the whole micro-batch's tokens: every cp rank holds the whole sequence's loss, cp = 1's
up to the order of one sum. Its backward gives each rank cp times its share, and DDP over dp x cp divides
by dp cp: the gradient of the mean over dp. The slice's labels are the `context` point.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import Context
from disttrace.run.parallel.common import SCALARS_AGREE, build_optimizer
from disttrace.run.parallel.ddp import DataParallel, apply_ddp
from disttrace.store.documents import ReplicaRule


class _AllGather(torch.autograd.Function):
    """Concatenate the group's tensors along `dim`; backward: the gathered gradient summed over the group
    (every rank's attention used every key), this rank's slice kept."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.n = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.n, dim=ctx.dim)[ctx.rank].contiguous(), None, None


class _AllReduce(torch.autograd.Function):
    """A sum over the group; its gradient is the group's sum of the gradients (each rank's loss is the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def cp_attention(group, start: int):
    """Causal attention for queries at global positions [start, start + s) over the group's gathered keys."""

    def attend(q, k, v):
        k = _AllGather.apply(k, 2, group)
        v = _AllGather.apply(v, 2, group)
        rows = torch.arange(start, start + q.shape[2], device=q.device)
        mask = rows[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


class _Slice(nn.Module):
    """What forward runs on: this rank's slice of the tokens through the plain (DDP-wrapped) model."""

    def __init__(self, inner, owner):
        super().__init__()
        self.inner, self.owner = inner, owner

    def forward(self, tokens):
        self.owner.tokens = tokens
        return self.inner(tokens[:, self.owner.start : self.owner.end])


class ContextParallel(DataParallel):
    name = "cp"
    engine = "DistributedDataParallel + all-gather context parallel"

    def __init__(self, manifest: Manifest, model, mesh, bus):
        par = manifest.parallelism
        self.plain, self.bus, self.dp, self.cp = model, bus, par.dp, par.cp
        self.max_grad_norm = manifest.training.max_grad_norm
        from disttrace.run.job.hooks import param_refs

        self.named = param_refs(model)
        self.cp_group = mesh.get_group("cp")
        size = manifest.model.max_seq_len // par.cp
        self.start = mesh.get_local_rank("cp") * size
        self.end = self.start + size
        self.tokens = None
        # RoPE at the slice's positions: the model reads its tables from position 0
        model.rope_cos = model.rope_cos[self.start :].clone()
        model.rope_sin = model.rope_sin[self.start :].clone()
        attend = cp_attention(self.cp_group, self.start)
        for layer in model.layers.values():
            layer.attention.attend = attend
        self._shard_outputs(model, manifest.model.max_seq_len)
        self.group = dist.group.WORLD  # dp x cp (tp = pp = 1): the ranks that average gradients
        self._buckets: dict[int, int] = {}
        names = {id(p): (i, n) for i, n, p in self.named}
        ddp = apply_ddp(
            model, self.group, bus, names, manifest.debug.ddp_bucket_cap_mb, self._buckets
        )
        self.ddp = ddp
        self.model = _Slice(ddp, self)
        self.optimizer = build_optimizer(manifest, model.parameters())

    def _shard_outputs(self, model, seq: int) -> None:
        """The recorded block outputs and logits are this rank's slice of the sequence: say where it sits,
        before the recorder's hook reads it, so diff compares the logical tensor."""
        start = self.start

        def place(_mod, _inp, out):
            shape = list(out.shape)
            out._disttrace_shard = {
                "shard": {
                    "offset": [0, start] + [0] * (len(shape) - 2),
                    "logical_shape": [shape[0], seq, *shape[2:]],
                }
            }

        for m in [*model.layers.values(), model.norm, model.output]:
            m.register_forward_hook(place, prepend=True)

    def replicas(self) -> list[ReplicaRule]:
        """A cp group reads one batch and holds one loss; DDP over dp x cp makes every parameter, reduced
        gradient and optimizer state one across the world."""
        rules = [
            ReplicaRule(phase="data", dim="cp", relation="agree"),
            ReplicaRule(phase="loss", dim="cp", relation="agree"),
        ]
        rules += [
            ReplicaRule(phase=phase, dim="world", relation="agree")
            for phase in ("reduce", "clip", "optimizer")
        ]
        if self.dp > 1:
            rules.append(ReplicaRule(phase="data", dim="dp", relation="differ"))
        rules.append(SCALARS_AGREE)
        return rules

    def micro_batch(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def loss(self, logits, targets):
        p = self.bus.emit(
            Context(inputs=self.tokens, targets=targets, start=self.start, end=self.end)
        )
        mine = p.targets[:, self.start : self.end]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), mine.reshape(-1), reduction="sum"
        )
        return _AllReduce.apply(total, self.cp_group) / targets.numel()

    # checkpoint state is the DDP model's (DCP strips DDP's prefix, not the slicing wrapper's): the same keys
    # as any other layout's
    @contextlib.contextmanager
    def _ddp_as_model(self):
        wrapper, self.model = self.model, self.ddp
        try:
            yield
        finally:
            self.model = wrapper

    def state_dict(self, with_optimizer: bool = True) -> dict:
        with self._ddp_as_model():
            return super().state_dict(with_optimizer)

    def empty_state(self, with_optimizer: bool) -> dict:
        with self._ddp_as_model():
            return super().empty_state(with_optimizer)

    def load_state_dict(self, state: dict) -> None:
        with self._ddp_as_model():
            super().load_state_dict(state)
