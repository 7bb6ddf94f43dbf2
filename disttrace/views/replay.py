"""A replay's attribution on a terminal (the decision itself is analysis/attribution.py's)."""

from __future__ import annotations

from disttrace.analysis.attribution import Against, ReplayResult

STYLE = {
    "persistent": "red",
    "transient": "yellow",
    "device": "magenta",
    "not-replayable": "red",
    "none": "green",
}


def _against(a: Against | None) -> str:
    if a is None:
        return "not compared"
    if a.equal:
        return "equal"
    where = f"differs, first at {a.first.line()}" if a.first else "differs"
    return where + (f" ({a.slot.line()})" if a.slot else "")


def render(result: ReplayResult, console) -> None:
    """Text objects throughout: paths and tensor names come from the run store and print as they are."""
    from rich.text import Text

    yes = {True: "yes", False: "no", None: "not reached"}
    source = (
        f"checkpoint of step {result.from_checkpoint}"
        if result.from_checkpoint
        else "the initial state"
    )
    console.print(
        Text("attribution: ", style="bold")
        + Text(result.attribution, style=STYLE.get(result.attribution, ""))
        + Text(f"  step {result.step} of {result.run}")
    )
    console.print(Text(f"  {result.reason}"), soft_wrap=True)
    shift = f", ranks rotated by {result.rank_shift} over the slots" if result.rank_shift else ""
    steps = result.replayed_steps
    span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    console.print(Text(f"  replayed steps {span} from the {source}{shift}", style="dim"))
    console.print(Text(f"  reproduces the stored step: {yes[result.reproduces]}"))
    console.print(Text(f"  matches the reference: {yes[result.matches_reference]}"))
    console.print(Text(f"  stored step vs reference: {_against(result.stored)}"), soft_wrap=True)
    console.print(
        Text(f"  replayed step vs reference: {_against(result.replayed)}"), soft_wrap=True
    )
    if result.first_difference is not None:
        console.print(
            Text(f"  first record that did not reproduce: {result.first_difference.line()}"),
            soft_wrap=True,
        )
    if result.slot is not None:
        console.print(Text(f"  the {result.slot.line()}", style="magenta"))
    console.print(Text(f"  reference: {result.reference}", style="dim"))
