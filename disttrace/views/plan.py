"""A plan (plan/layout.py) as rich tables: model states per ZeRO stage, activations, pipeline bubble, traffic."""

from __future__ import annotations

from disttrace.plan.costs import ACTIVATION_VARIANTS, GiB, MiB
from disttrace.plan.layout import Plan


def human_bytes(n: int | None) -> str:
    """Binary units: 1 GiB = 2^30 bytes (the ZeRO paper's GB are 10^9)."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def render_plan(result: Plan, console) -> None:
    """Print a plan as rich tables: model states per ZeRO stage, activations, pipeline bubble, traffic."""
    inp = result.inputs
    console.print(
        f"[bold]Plan[/bold] for {human_count(result.params)} parameters ({result.params:,}) on "
        f"dp={inp.dp} x tp={inp.tp} x pp={inp.pp} = {inp.world_size} devices, "
        f"{inp.precision} precision, {inp.optimizer}"
    )
    if inp.params_source not in (None, "given"):
        console.print(f"  parameter count {inp.params_source}")
    _model_states(result, console)
    _activations(result, console)
    _bubble(result, console)
    _traffic(result, console)


def _model_states(result: Plan, console) -> None:
    """Model states per device at each ZeRO stage, the selected one in bold."""
    from rich.table import Table

    selected = str(result.zero_stage)
    bpp = result.bytes_per_param
    t = Table(
        title="Model states per device (ZeRO, Rajbhandari et al. 2020)",
        caption=f"Psi per model-parallel rank = {result.params_per_model_parallel_rank:,}; "
        f"bytes/param: weights {bpp.weights}, grads {bpp.grads}, "
        f"optimizer K = {bpp.optimizer_K}. 1 GiB = 2^30 bytes (the paper's GB = 10^9).",
    )
    for col in ("ZeRO stage", "shards", "params", "grads", "optimizer", "total"):
        t.add_column(col, justify="right" if col not in ("ZeRO stage", "shards") else "left")
    shards = {
        "0": "nothing (DDP)",
        "1": "optimizer",
        "2": "optimizer + grads",
        "3": "optimizer + grads + params",
    }
    breakdown = result.model_state_breakdown_per_device
    for s, total in result.model_state_bytes_per_device.items():
        b = breakdown.get(s, {})
        mark = " <- selected" if s == selected else ""
        t.add_row(
            f"{s}{mark}",
            shards.get(s, ""),
            human_bytes(b.get("params")),
            human_bytes(b.get("grads")),
            human_bytes(b.get("optimizer")),
            human_bytes(total),
            style="bold" if s == selected else None,
        )
    console.print(t)
    if result.update_copy_bytes_per_device:
        console.print(
            f"recording: + {human_bytes(result.update_copy_bytes_per_device)} per device beside the model "
            "states, the update records' copy of the parameters (record.updates = false frees it)"
        )


def _activations(result: Plan, console) -> None:
    """Activation memory of each variant, per layer and (with a layer count) per device."""
    from rich.table import Table

    inp = result.inputs
    acts = result.activation_bytes_per_layer
    if acts is None:
        console.print("Activations: give the sequence length, hidden size and heads to plan them.")
    else:
        per_device = result.activation_bytes_per_device
        t = Table(
            title="Activations (Korthikanti et al. 2022, Table 2)",
            caption=f"s={inp.seq} b={inp.micro_batch} h={inp.hidden} a={inp.heads} t={inp.tp}"
            + (
                "; per device = per layer x layers per stage x micro-batches in flight "
                f"({inp.pp_schedule})"
                if per_device
                else ""
            ),
        )
        t.add_column("variant")
        t.add_column("what")
        t.add_column("formula")
        t.add_column("per layer", justify="right")
        if per_device:
            t.add_column("per device", justify="right")
        for k, v in acts.items():
            formula, what = ACTIVATION_VARIANTS.get(k, ("", ""))
            row = [k, what, formula, human_bytes(v)]
            if per_device:
                row.append(human_bytes(per_device.get(k)))
            t.add_row(*row)
        console.print(t)


def _bubble(result: Plan, console) -> None:
    """The pipeline bubble of GPipe and 1F1B."""
    from rich.table import Table

    inp = result.inputs
    bub = result.bubble_fraction
    t = Table(
        title=f"Pipeline bubble (p={inp.pp} stages, m={inp.micro_batches} micro-batches)",
        caption="(p-1)/m: bubble time over ideal compute time (GPipe, 1F1B/PipeDream-Flush, Megatron-LM); "
        "(p-1)/(m+p-1): over the whole step",
    )
    t.add_column("schedule")
    t.add_column("bubble / ideal compute", justify="right")
    t.add_column("bubble / whole step", justify="right")
    t.add_row("GPipe", f"{bub['gpipe']:.1%}", f"{bub['of_total_time']:.1%}")
    t.add_row("1F1B", f"{bub['1f1b']:.1%}", f"{bub['of_total_time']:.1%}")
    console.print(t)


def _traffic(result: Plan, console) -> None:
    """Data-parallel traffic per device per step at each ZeRO stage."""
    from rich.table import Table

    selected = str(result.zero_stage)
    comm = result.comm_bytes_per_device
    t = Table(
        title="Data-parallel traffic per device per step (ring collectives, ZeRO paper Section 7)"
    )
    t.add_column("layout")
    t.add_column("collectives")
    t.add_column("bytes sent", justify="right")
    what = {
        "0": "all-reduce grads (= DDP)",
        "1": "reduce-scatter grads + all-gather params",
        "2": "reduce-scatter grads + all-gather params",
        "3": "+ all-gather params again (1.5x DDP)",
    }
    for s in ("0", "1", "2", "3"):
        mark = " <- selected" if s == selected else ""
        t.add_row(
            f"ZeRO {s}{mark}",
            what[s],
            human_bytes(comm[s]),
            style="bold" if s == selected else None,
        )
    console.print(t)
    if result.update_copy_bytes_per_device:
        console.print(
            f"recording: + {human_bytes(result.update_copy_bytes_per_device)} per device beside the model "
            "states, the update records' copy of the parameters (record.updates = false frees it)"
        )
