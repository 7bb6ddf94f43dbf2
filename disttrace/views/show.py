"""`disttrace show`: what a run holds (analysis/facts.py gathers it from the run store), on a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from disttrace.analysis.facts import (
    CheckpointFacts,
    CollectiveFacts,
    EventFacts,
    MemoryFacts,
    RecordCounts,
    RunSummary,
    TopologyFacts,
    failure_text,
)
from disttrace.store.documents import MemoryLine, Topology

COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red"]


def render_summary(s: RunSummary, console: Console, topology: TopologyFacts | None = None) -> None:
    """The run in a few lines; with `topology` (not a run command's brief summary) also the records per
    rank and the rank topology."""
    T = lambda v, style=None: Text(str(v), style=style or "")  # noqa: E731  text from files: never markup
    state = T("complete", "green") if s.complete else T("INCOMPLETE", "red")
    t = s.topology
    console.print(
        T(s.experiment, "bold")
        + T(f" ({s.edition})  path={s.path}  ")
        + state
        + T(
            f"  id={(s.manifest_id or '')[:12]}  world={t['world_size']} dp={t['dp']} tp={t['tp']} "
            f"pp={t['pp']} zero={t['zero_stage']}"
            + "".join(f" {k}={t[k]}" for k in ("ep", "cp") if k in t)
        )
    )
    if s.recorded == "zero-code":
        console.print(
            T("recorded zero-code: ", "bold")
            + T(
                "no attach call; the model, optimizer, loss (the backward's root) and data (the forward's "
            )
            + T("first tensor) were found through torch's hooks")
        )
    if s.fault:
        f = s.fault
        fired = T("fired") if s.fault_fired else T("did not fire", "yellow")
        console.print(
            T(f"fault: {f.name} at step {f.step} rank {f.rank} (")
            + fired
            + T(f"); expected first divergence: {f.expect}")
        )
    if s.resume:
        console.print(T(f"resumed from {s.resume.checkpoint} (step {s.resume.step})"))
    if s.loss:
        console.print("loss: " + "  ".join(f"{k}:{v:.4f}" for k, v in s.loss.items()))
    if s.step_seconds:
        secs = sorted(s.step_seconds)
        console.print(
            f"step time (rank 0): median {secs[len(secs) // 2]:.3f} s over {len(secs)} steps; "
            f"{s.records} trajectory records"
        )
    for f in s.failures[:3]:
        console.print(T(f.event, "red") + T(f": {failure_text(f)}"), soft_wrap=True)
    for st in s.stragglers[:3]:
        console.print(
            T("straggler", "yellow")
            + T(
                f": rank {st.rank} at step {st.step} took {st.seconds}s "
                f"to reach its collective (others: {st.others_median}s)"
            )
        )
    for w in s.warnings:
        console.print(T("warning", "yellow") + T(f": {w}"))
    if topology is not None:
        tab = Table(title="records per rank")
        for col in ("rank", "steps", "records"):
            tab.add_column(col, justify="right")
        for r, c in s.ranks.items():
            tab.add_row(Text(r), str(c.steps), str(c.records))
        console.print(tab)
        render_topology(topology, console)


def render_topology(facts: TopologyFacts, console: Console) -> None:
    topo = facts.topology
    if topo is None or not topo.as_read():  # an empty document holds no topology either
        console.print("[yellow]no topology.json[/yellow]")
        return
    tab = Table(title=Text(f"rank topology (mesh {topo.mesh_shape})"))
    for col in ("rank", "host", "node", "local", *topo.mesh_dims):
        tab.add_column(Text(str(col)), justify="right")
    for r in topo.ranks:
        c = r.coords
        tab.add_row(
            *[Text(str(v)) for v in (r.rank, r.host, r.node_rank, r.local_rank)],
            *[Text(str(c[d]), style=COLOURS[c[d] % len(COLOURS)]) for d in topo.mesh_dims],
        )
    console.print(tab)
    console.print(mesh_picture(topo))
    for dim, groups in topo.groups.items():
        if topo.mesh_shape[dim] > 1:
            console.print(Text(f"{dim} groups: {groups}"))


def mesh_picture(topo: Topology) -> Text:
    """The mesh as a picture: one dp x tp grid of global ranks per pipeline stage, each rank coloured by its
    data-parallel coordinate (rows) - what crosses nodes is what spans rows or stages. A Text: the ranks'
    fields come from topology.json and are never markup."""
    colours = ["cyan", "magenta", "green", "yellow", "blue", "red"]
    # a dimension the mesh does not name has size 1 (documents.Topology holds the sizes to the ranks listed)
    shape = {k: topo.mesh_shape.get(k, 1) for k in ("pp", "dp", "tp")}
    by_coords = {tuple(r.coords.get(k, 0) for k in ("pp", "dp", "tp")): r for r in topo.ranks}
    out = Text()
    for pp in range(shape["pp"]):
        if pp:
            out.append("\n")
        out.append(f"stage pp={pp}", style="bold")
        out.append("".join(f"  tp={t:<3}" for t in range(shape["tp"])))
        for dp in range(shape["dp"]):
            out.append(f"\n  dp={dp:<3}   ")
            for i, tp in enumerate(range(shape["tp"])):
                r = by_coords.get((pp, dp, tp))
                cell = f"r{r.rank}@n{r.node_rank}" if r else "?"
                out.append((" " if i else "") + f"{cell:<8}", style=colours[dp % len(colours)])
    return out


def _table(title: str, columns, rows, justify: str = "left") -> Table:
    """A rich table whose cells are run-store data: each is a Text (never markup), unless already one."""
    tab = Table(title=title)
    for col in columns:
        tab.add_column(col, justify=justify)
    for row in rows:
        tab.add_row(*[c if isinstance(c, Text) else Text(str(c)) for c in row])
    return tab


def render_checkpoints(facts: CheckpointFacts, console: Console) -> None:
    rows = [
        (c.checkpoint, Text("yes", "green") if c.verified else Text("NO", "red"), c.detail)
        for c in facts.checkpoints
    ]
    tab = _table("recovery checkpoints", ("checkpoint", "verified", "detail"), rows)
    console.print(tab if rows else "no checkpoints")


def render_collectives(facts: CollectiveFacts, console: Console) -> None:
    sync = facts.sync
    console.print(
        _table(
            "collectives per process group",
            ("group", "ops", "bytes (rank 0 of group)"),
            [(g, v.ops, v.bytes) for g, v in sync.groups.items()],
        )
    )
    console.print(
        "[green]all groups in sync[/green]"
        if sync.first_mismatch is None
        else f"[red]{escape(sync.first_mismatch.message)}[/red]"
    )
    tab = Table(title="rank 0: tensor traffic per step, ring model (bytes sent per rank)")
    for col in ("step", "class", "calls", "buffer bytes", "ring bytes on the wire"):
        tab.add_column(col, justify="right")
    for step, classes in facts.wire_volume.steps.items():
        for cls, row in classes.items():
            tab.add_row(
                Text(str(step)),
                Text(str(cls)),
                Text(str(row.calls)),
                Text(str(row.bytes)),
                f"{row.ring_bytes:.0f}",
            )
    console.print(tab)
    pred = facts.predicted_bytes_per_step
    if pred is None:
        return
    console.print(
        f"plan (ZeRO paper ring volumes): {pred} bytes per rank per step for this strategy"
    )
    for step, total, ratio in facts.measured_over_predicted():
        console.print(
            f"  step {step}: measured (trace, ring model) {total:.0f} / predicted {pred} = {ratio:.3f}"
            if ratio is not None
            else ""
        )
    if facts.zero3_regathers:
        console.print(
            f"  gap: ZeRO-3 gathers the parameters again for each of the {facts.zero3_regathers} "
            "micro-batches; the paper's 3(n-1)/n Psi counts one forward and backward per step"
        )


MEMORY_COLUMNS = (
    "step",
    "rank",
    "params",
    "grads",
    "optimizer",
    "model_state",
    "engine",
    "buffers",
    "measured_total",
    "predicted",
    "ratio_total",
    "activations_saved",
    "resident",
)


def render_memory(facts: MemoryFacts, console: Console) -> None:
    tab = Table(title="memory ledger (bytes held locally: distinct storages, measured)")
    for col in MEMORY_COLUMNS:
        tab.add_column(col, justify="right")
    for r in facts.memory:
        tab.add_row(*[Text(str(_memory_cell(r, c))) for c in MEMORY_COLUMNS])
    console.print(tab)
    for rank, r in facts.last_per_rank():  # the gap of each rank's last step, named
        total = r.predicted.total if r.predicted is not None else None
        console.print(
            Text(
                f"rank {rank} step {r.step}: measured {r.measured_total} B, "
                f"predicted (ZeRO formula) {total} B"
            )
        )
        for g in r.gap_bytes or []:
            why = f" ({g.why})" if g.why else ""
            console.print(Text(f"  gap: {g.what}: {g.bytes} B{why}"))


def _memory_cell(r: MemoryLine, column: str):
    """One cell of the ledger's table: "-" where the line leaves the field out; predicted: its total."""
    if column == "predicted":
        return r.predicted.total if r.predicted is not None else None
    return getattr(r, column) if column in r.model_fields_set else "-"


def render_record_counts(res: RecordCounts, console: Console) -> None:
    tab = Table(
        title="trajectory records (export every one with `disttrace show RUN records --jsonl`)"
    )
    for col in ("rank", "steps", "records", "bytes"):
        tab.add_column(col, justify="right")
    for rank, v in res.ranks.items():
        tab.add_row(rank, str(v.steps), str(v.records), str(v.bytes))
    console.print(tab)


def render_events(facts: EventFacts, console: Console) -> None:
    for e in facts.events:
        console.print(e.as_read())


def render(facts, console: Console, topology: Topology | None = None) -> None:
    """Any `show` view's facts (analysis/facts.py's `gather`); `topology`: the run's, for the summary."""
    if isinstance(facts, RunSummary):
        render_summary(facts, console, TopologyFacts(topology))
    elif isinstance(facts, CheckpointFacts):
        render_checkpoints(facts, console)
    elif isinstance(facts, TopologyFacts):
        render_topology(facts, console)
    elif isinstance(facts, RecordCounts):
        render_record_counts(facts, console)
    elif isinstance(facts, CollectiveFacts):
        render_collectives(facts, console)
    elif isinstance(facts, MemoryFacts):
        render_memory(facts, console)
    else:
        render_events(facts, console)
