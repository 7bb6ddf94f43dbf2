"""Pipeline parallel with `torch.distributed.pipelining`: the model's layers are split into `pp` stages,
one per rank of the pp mesh dimension; a schedule (GPipe or 1F1B) runs `grad_accum_steps` micro-batches
through them, sending activations forward and gradients backward point-to-point.

Stages are built by hand from the plain model (deleting what the stage does not own: the embedding
outside the first stage, the norm and head outside the last), not traced: a traced 4-way split failed
here (docs/design.md, "Facts"). Parameter names stay those of the full model, so a stage's tensors compare with
the one-device run's. The bubble, (p-1)/m of ideal compute for both schedules, shows in `disttrace trace`.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from disttrace.config.manifest import Manifest
from disttrace.model.llama import lm_loss
from disttrace.run.job.hooks import Backward, Batch, Loss, Reduce, TensorRef, grads_of
from disttrace.run.parallel.common import (
    OPTIMIZER_BLOB_TEMPLATE,
    SCALARS_AGREE,
    TP_ACTIVATIONS_AGREE,
    Strategy,
    build_optimizer,
    load_optimizer_bytes,
    optimizer_bytes,
)
from disttrace.store.documents import ReplicaRule


def stage_layers(n_layers: int, pp: int, stage: int) -> list[str]:
    """Contiguous, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return [str(i) for i in range(start, start + base + (1 if stage < extra else 0))]


def build_stage_module(model, pp: int, stage: int):
    keep = set(stage_layers(len(model.layers), pp, stage))
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
    if stage < pp - 1:
        model.norm = None
        model.output = None
    return model


class PipelineParallel(Strategy):
    engine = "torch.distributed.pipelining"
    runs_whole_step = True  # the schedule interleaves the stages' micro-batches itself

    def __init__(self, manifest: Manifest, model, mesh, bus):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        par = manifest.parallelism
        self.pp, self.accum = par.pp, manifest.training.grad_accum_steps
        self.stage_index = mesh["pp"].get_local_rank()
        self.within_stage = (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank())
        self.name = f"pp-{par.pp_schedule}"
        self.bus = bus
        self.max_grad_norm = manifest.training.max_grad_norm
        self.group = self.norm_group = mesh.get_group("pp")
        full_index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.plain = self.model = build_stage_module(model, self.pp, self.stage_index)
        names = [n for n, _ in model.named_parameters()]
        # within a stage, the other dimensions as elsewhere: TP first, then FSDP2 over dp (torchtitan's order)
        self.dp, self.tp = par.dp, par.tp
        if self.tp > 1:
            from disttrace.run.parallel.tp import apply_tp

            apply_tp(model, mesh["tp"])
        if self.dp > 1:
            from disttrace.run.parallel.fsdp import apply_fsdp

            apply_fsdp(model, mesh["dp"], reshard_after_forward=True)
            self.engine += " + FSDP2 over dp"
        params = dict(model.named_parameters())
        self.named = [TensorRef(full_index[n], n, params[n]) for n in names]
        device = next(model.parameters()).device
        # stated shapes, not inferred: inference runs an extra forward (and loss) on placeholder data,
        # which the recorder would see as a real micro-batch
        cfg, mbs = manifest.model, manifest.training.micro_batch_size
        dtype = getattr(torch, manifest.training.dtype)
        # float activations carry gradients between stages: the metadata must say so
        hidden = torch.empty(
            mbs, cfg.max_seq_len, cfg.dim, dtype=dtype, device=device, requires_grad=True
        )
        tokens = torch.empty(mbs, cfg.max_seq_len, dtype=torch.long, device=device)
        logits = torch.empty(mbs, cfg.max_seq_len, cfg.vocab_size, dtype=dtype, device=device)
        self.stage = PipelineStage(
            model,
            self.stage_index,
            self.pp,
            device,
            group=self.group,
            input_args=(tokens if self.stage_index == 0 else hidden,),
            output_args=(logits if self.stage_index == self.pp - 1 else hidden,),
        )
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[par.pp_schedule]
        # scale_grads divides by the micro-batch count: the mean over micro-batches, as accumulation does
        self.schedule = schedule(
            self.stage, n_microbatches=self.accum, loss_fn=self._loss, scale_grads=True
        )
        self.optimizer = build_optimizer(manifest, model.parameters())
        self._forwards = self._losses = 0
        model.register_forward_pre_hook(self._count_forward)
        # per-micro-batch forward and backward spans of this stage: the timeline draws them, and the gaps
        # between them are the pipeline bubble
        self.spans: list[list] = []
        self._open: dict = {}
        model.register_forward_hook(lambda m, a, o: self._span_end("forward"))
        model.register_full_backward_pre_hook(lambda m, g: self._span_start("backward"))
        # the backward ends when every parameter of the stage has its gradient (a module backward hook fires
        # early on the first stage, whose token inputs need no gradient)
        torch.autograd.graph.register_multi_grad_hook(
            list(model.parameters()), lambda grads: self._span_end("backward"), mode="all"
        )

    def _span_start(self, kind: str) -> None:
        self._open[kind] = time.time()

    def _span_end(self, kind: str) -> None:
        if kind in self._open:
            n = sum(1 for s in self.spans if s[0].startswith(kind))
            self.spans.append([f"{kind} mb {n}", self._open.pop(kind), time.time()])

    def _count_forward(self, _module, _args):
        self.bus.micro_batch = self._forwards  # the schedule runs forwards in micro-batch order
        self._forwards += 1
        self._span_start("forward")

    def _loss(self, output, target):
        self.bus.micro_batch = self._losses
        self._losses += 1
        loss = lm_loss(output, target)
        return self.bus.emit(Loss(loss=loss, tokens=target.numel())).loss

    def replicas(self) -> list[ReplicaRule]:
        rules = [
            ReplicaRule(phase="data", dim="pp", relation="agree"),
            SCALARS_AGREE,
        ]  # every stage: same batch
        if self.dp > 1:
            rules.append(ReplicaRule(phase="data", dim="dp", relation="differ"))
        if (
            self.tp > 1
        ):  # a stage's tp group: one copy of its activations (the last stage's loss too)
            rules += [
                ReplicaRule(phase=p, dim="tp", relation="agree", tensors="*norm.weight*")
                for p in ("reduce", "clip", "optimizer")
            ] + TP_ACTIVATIONS_AGREE
        return rules

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()

    def train_step(self, batches: list[Batch]) -> None:
        """The schedule owns the micro-batch loop: forward, loss and backward of all micro-batches."""
        inputs = torch.cat([b.inputs for b in batches]).to(self.stage.device)
        targets = torch.cat([b.targets for b in batches]).to(self.stage.device)
        self._forwards = self._losses = 0
        self.spans = []
        first, last = self.stage_index == 0, self.stage_index == self.pp - 1
        args = (inputs,) if first else ()
        self.schedule.step(*args, target=targets if last else None)
        self.bus.micro_batch = self.accum - 1
        grads = grads_of(self.named)
        if (
            self.dp == 1 and self.tp == 1
        ):  # with FSDP2 over dp the gradients are already reduce-scattered
            self.bus.emit(Backward(grads=grads))  # this stage's accumulated gradients
        self.bus.emit(Reduce(grads=grads))  # the final gradient of this stage

    # the optimizer state of a stage belongs to that stage alone: saved and loaded under its own key. With
    # dp or tp inside the stage each rank holds its own shards of it, so the key names the rank's place in
    # the stage too: under one key DCP writes one rank's blob and every rank of the stage loads that one
    def _key(self) -> str:
        if self.dp == 1 and self.tp == 1:
            return (
                f"stage-{self.stage_index:03d}"  # the key checkpoints of plain pipelines always had
            )
        dp_rank, tp_rank = self.within_stage
        return f"stage-{self.stage_index:03d}-dp-{dp_rank:05d}-tp-{tp_rank:05d}"

    def state_dict(self, with_optimizer: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(self.model)}
        if with_optimizer:
            state["optim"] = {self._key(): optimizer_bytes(self.optimizer)}
        return state

    def empty_state(self, with_optimizer: bool) -> dict:
        state = self.state_dict(with_optimizer=False)
        if with_optimizer:
            state["optim"] = {self._key(): OPTIMIZER_BLOB_TEMPLATE}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            load_optimizer_bytes(self.optimizer, state["optim"][self._key()])

    def close(self):
        # gloo threads touching Python at interpreter exit aborted 30-40% of pipelining runs; freeing the
        # schedule and stage first removed it (docs/design.md, "Facts")
        del self.schedule, self.stage
        gc.collect()
