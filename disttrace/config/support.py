"""What a manifest may ask for that the harness does not run yet: refused at freeze time (and when a lock
is read), naming the field: layouts whose strategy has not landed, and switches that need another."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrace.config.manifest import Manifest


def _not_supported_yet(m: Manifest) -> tuple[str, str] | None:
    """(field, why) of the first feature this manifest asks for that the harness does not run, or None."""
    return _layout_not_supported(m) or _switch_not_supported(m)


def _layout_not_supported(m: Manifest) -> tuple[str, str] | None:
    p = m.parallelism
    moe = _moe_not_supported(m)
    if moe:
        return moe
    if p.tp > 1:
        md = m.model
        for name, value in (
            ("model.n_heads", md.n_heads),
            ("model.n_kv_heads", md.n_kv_heads),
            ("model.ffn_hidden", md.ffn_hidden),
            ("model.vocab_size", md.vocab_size),
        ):
            if value % p.tp:
                return (
                    name,
                    f"{value} is not divisible by parallelism.tp = {p.tp} (tensor parallel splits it)",
                )
    if p.pp > 1:
        if p.zero_stage or p.architecture != "allreduce":
            return "parallelism.pp", (
                "pipeline parallel with ZeRO or a parameter server is not supported; with "
                "dp > 1 the stages are sharded over dp with FSDP2 already"
            )
        if m.model.n_layers < p.pp:
            return (
                "parallelism.pp",
                f"{p.pp} stages need at least {p.pp} layers (model.n_layers = {m.model.n_layers})",
            )
        if p.pp_schedule == "1f1b" and m.training.grad_accum_steps < p.pp:
            return "training.grad_accum_steps", f"1F1B needs at least pp = {p.pp} micro-batches"
    if p.zero_stage > 0 and p.tp > 1:
        return (
            "parallelism.zero_stage",
            "ZeRO with tensor parallel: dp x tp shards over dp with FSDP2 already; use zero_stage = 0",
        )
    if p.architecture == "parameter-server" and (p.tp > 1 or p.pp > 1 or p.zero_stage > 0):
        return (
            "parallelism.architecture",
            "the parameter server is data parallel only (tp = pp = 1, zero_stage = 0)",
        )
    if p.architecture == "parameter-server" and m.training.max_grad_norm:
        return (
            "training.max_grad_norm",
            "the parameter server does not clip yet; drop training.max_grad_norm",
        )
    return None


def _moe_not_supported(m: Manifest) -> tuple[str, str] | None:
    """Expert and context parallel run on their own (over dp); their combinations are not built yet."""
    p, md = m.parallelism, m.model
    others = p.tp > 1 or p.pp > 1 or p.zero_stage > 0 or p.architecture != "allreduce"
    if md.n_experts and others:
        return "model.n_experts", (
            "a mixture of experts runs with dp and ep only (tp = pp = 1, zero_stage = 0, allreduce)"
        )
    if p.ep > 1:
        if not md.n_experts:
            return "parallelism.ep", "expert parallel needs experts (model.n_experts > 0)"
        if md.n_experts % p.ep:
            return "model.n_experts", (
                f"{md.n_experts} is not divisible by parallelism.ep = {p.ep} (each rank holds as many)"
            )
    if p.cp > 1:
        if others or p.ep > 1:
            return "parallelism.cp", (
                "context parallel runs with dp only (tp = pp = ep = 1, zero_stage = 0, allreduce)"
            )
        if md.max_seq_len % p.cp:
            return "parallelism.cp", (
                f"model.max_seq_len ({md.max_seq_len}) is not divisible by cp = {p.cp} (each rank "
                "holds an equal slice of the sequence)"
            )
        if md.n_experts and md.aux_loss_coef:
            return "model.aux_loss_coef", (
                "the load-balancing loss is taken over a rank's tokens; under context parallel that is "
                "a slice of the sequence, another loss than cp = 1's"
            )
    return None


def _switch_not_supported(m: Manifest) -> tuple[str, str] | None:
    p = m.parallelism
    if m.debug.live_check and not m.record.enabled:
        return (
            "record.enabled",
            "debug.live_check compares the recorder's digests: it needs record.enabled = true",
        )
    depth = m.record.depth
    if depth is not None and depth.step > m.training.steps:
        return (
            "record.depth.step",
            f"step {depth.step} is past the run's last step (training.steps = {m.training.steps})",
        )
    if depth is not None and p.pp > 1:
        return (
            "record.depth",
            "depth recording follows one micro-batch at a time; a pipeline schedule interleaves them "
            "(not supported yet)",
        )
    if p.architecture == "allreduce" and p.staleness:
        return "parallelism.staleness", "staleness applies to the parameter server only"
    return None
