"""The gate's verdict on a terminal (the verdict itself is gate/verdict.py's)."""

from __future__ import annotations

from disttrace.store.documents import Verdict


def render(verdict: Verdict, console) -> None:
    """Text objects throughout: reasons quote tensor names, paths and messages from the run store, which
    must print as they are, never as rich markup."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"gate: {'PASS' if verdict.passed else 'FAIL'}  {verdict.run}"))
    t.add_column("check")
    t.add_column("result")
    t.add_column("reason")
    for c in verdict.checks:
        res = {
            True: Text("pass", style="green"),
            False: Text("FAIL", style="red"),
            None: Text("n/a", style="dim"),
        }[c.passed]
        if not c.required:
            res.append(" (advisory)", style="dim")
        t.add_row(Text(c.name), res, Text(c.reason))
    console.print(t)
    pol = verdict.policy  # the policy as recorded (gate/policy.py's as_record)
    if pol:
        req = pol["checks"]["required"]
        console.print(
            Text(
                f"policy: eval.loss_rtol {pol['eval']['loss_rtol']}, required "
                f"{'every check' if req is None else ', '.join(req) or 'none'}"
                f"{', n/a fails' if pol['checks']['require_all'] else ''} (from the {pol['source']})",
                style="dim",
            )
        )
    for f in verdict.flags:
        console.print(Text("flag", style="yellow") + Text(f": {f}"))
    a = verdict.attribution
    if a:
        slot = f", slot {a['slot']}" if a.get("slot") is not None else ""
        console.print(
            Text("attribution", style="bold")
            + Text(f": {a.get('attribution')}{slot} at step {a.get('step')} ({a.get('reason')})")
        )
