"""The lab's result (lab/method.py) and the curriculum's list of labs (lab/curriculum.py) on a terminal."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from disttrace.analysis.lab import LabResult, PathOutcome
from disttrace.analysis.result import Divergence

__all__ = ["escape", "fmt_first", "markup_safe", "render", "render_labs"]


def markup_safe(v) -> str:
    """Progress lines are rich markup; paths and messages in them print as they are."""
    return escape(str(v))


def fmt_first(f: Divergence | None) -> str:
    if not f:
        return "none"
    text = f"step {f.step} mb {f.micro_batch} {f.phase} rank {f.rank}\n{f.tensor}"
    module = getattr(f, "module", None)  # a zoomed divergence (lab --zoom): where inside the step
    if module is not None:
        text += f"\nin {module or '(outside every module)'} ({f.direction})"
        if getattr(f, "op", None):
            text += f"\nop {f.op} #{f.op_index}"
    return text


def render(result: LabResult, console) -> None:
    """Text objects for everything read from runs (tensor names, phases, paths): never rich markup."""
    from rich.table import Table
    from rich.text import Text

    p, fault = result.paths, result.fault
    t = Table(title=Text(f"lab: {fault['name']} at step {fault['step']} rank {fault['rank']}"))
    t.add_column("")
    for name in ("reference", "fault", "recovered"):
        t.add_column(name)
    cols: list[PathOutcome | None] = [p.reference, p.fault, p.recovered]

    def loss(c: PathOutcome | None) -> str:
        return "-" if c is None or c.final_loss is None else f"{c.final_loss:.4f}"

    def g(c: PathOutcome | None):
        if c is None:
            return Text("-")
        if c.gate:
            return Text("PASS", style="green")
        return Text("FAIL", style="red") + Text(" " + ", ".join(c.gate_failed or []))

    t.add_row("run", *[Text(Path(c.run_dir).name) if c else "-" for c in cols])
    t.add_row("exit", *[str(c.exit or 0) if c else "-" for c in cols])
    t.add_row("final loss", *[loss(c) for c in cols])
    t.add_row(
        "first divergence",
        "(reference)",
        Text(fmt_first(p.fault.first_divergence)),
        Text(fmt_first(p.recovered.first_divergence)) if p.recovered else "-",
    )
    t.add_row("gate", *[g(c) for c in cols])
    console.print(t)
    s = result.expected_signature
    console.print(
        Text(f"expected signature ({s.expect}): ")
        + (Text("held", style="green") if s.held else Text("did not hold", style="red"))
        + Text(f" - {s.observed}")
    )
    pr = result.prediction
    if pr:
        console.print(
            Text("prediction: ")
            + (
                Text("held exactly", style="green")
                if pr.held
                else Text("missed", style="red") + Text(" (" + "; ".join(pr.missed) + ")")
            )
        )
    console.print(
        Text("attribution ")
        + (
            Text("ACCEPTED", style="green")
            + Text(
                ": the fault explains the divergence and the recovered path rejoins the reference"
            )
            if result.accepted
            else Text("NOT accepted", style="red")
        )
    )


def render_labs(labs: list[dict], console) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title="curriculum labs (manifests/labs/)")
    for col in ("topic", "lab", "status", "question", "fault"):
        t.add_column(col)
    for lab in labs:  # Text: what the lab files say prints as written, never as markup
        status = (
            Text("runnable", style="green")
            if lab["status"] == "runnable"
            else Text(str(lab["status"]), style="yellow") + Text(f": {lab.get('reason')}")
        )
        t.add_row(
            *[Text(str(lab.get(k, d))) for k, d in (("topic", "?"), ("lab", ""))],
            status,
            *[Text(str(lab.get(k) or "")) for k in ("question", "fault")],
        )
    console.print(t)
