"""The training loop. It emits hook points and knows nothing of recorders, faults or strategies' insides."""

from __future__ import annotations

from disttrace.model.llama import aux_loss
from disttrace.run.job.hooks import Batch, Data, Forward, Loss, StepEnd, StepStart


def emit_module_outputs(model, bus) -> list:
    """Emit each block's output (and the final norm and logits) at the `forward` point: layer-by-layer
    state, the evidence a LLaMA-style comparison needs beyond a final loss."""
    watched = [(f"layers.{k}", m) for k, m in model.layers.items()]
    watched += [("norm", model.norm), ("output", model.output)]
    handles = []
    for index, (name, module) in enumerate(watched):
        if module is None:
            continue

        def hook(_mod, _inp, out, name=name, index=index):
            bus.emit(Forward(name=name, index=index, tensor=out))

        handles.append(module.register_forward_hook(hook))
    return handles


def read_batch(ctx, step: int, mb: int) -> Batch:
    """This rank's micro-batch, through the `data` point (a fault may hand it another rank's shard)."""
    ctx.bus.micro_batch = mb
    read = Data(
        Batch(**ctx.data.batch(step, mb, ctx.dp_rank)),
        fetch=lambda r: Batch(**ctx.data.batch(step, mb, r)),
    )
    return ctx.bus.emit(read).batch


def train(ctx) -> None:
    """ctx: a worker Context with manifest, strategy, data, bus, dp_rank, checkpointing."""
    m, strategy, bus = ctx.manifest, ctx.strategy, ctx.bus  # m: the typed Manifest
    steps = m.training.steps
    accum = m.training.grad_accum_steps
    interval = m.checkpoint.interval
    # the gate's replay re-executes a few steps from a checkpoint and stops after the last it checks
    last = min(steps, ctx.stop_after or steps)
    for step in range(ctx.start_step + 1, last + 1):  # steps are numbered from 1
        bus.step, bus.micro_batch = step, 0
        bus.emit(StepStart())
        strategy.zero_grad()
        if strategy.runs_whole_step:
            # a pipeline schedule owns the micro-batch loop (it interleaves stages' forwards and backwards):
            # hand it every micro-batch's data at once
            strategy.train_step([read_batch(ctx, step, mb) for mb in range(accum)])
        else:
            for mb in range(accum):
                last = mb == accum - 1
                batch = read_batch(ctx, step, mb)
                inputs, targets = batch.inputs.to(ctx.device), batch.targets.to(ctx.device)
                with strategy.micro_batch(last):
                    loss = strategy.loss(strategy.model(inputs), targets)
                    aux = aux_loss(strategy.plain, m.model.aux_loss_coef)
                    if aux is not None:  # a mixture's load-balancing term, per micro-batch
                        loss = loss + aux
                    loss = bus.emit(Loss(loss=loss, tokens=targets.numel())).loss
                    strategy.backward(loss / accum, last)
        strategy.step()
        if interval and (
            step % interval == 0 or step == steps
        ):  # the last step too: the gate evaluates it
            ctx.save_checkpoint(step)
        bus.emit(StepEnd(spans=strategy.spans))  # a strategy's own timing, if it keeps one
