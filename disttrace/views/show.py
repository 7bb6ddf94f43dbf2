"""`disttrace show`: what a run holds, read from the run store only."""

from __future__ import annotations

from pathlib import Path

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from disttrace.analysis.sync import check_sync, find_stragglers, predicted_dp_volume, wire_volume
from disttrace.errors import BadInput
from disttrace.store import checkpoints as checkpoint
from disttrace.store.records import FAILURE_EVENTS, Event
from disttrace.store.rundir import Run, iter_jsonl

VIEWS = ("summary", "checkpoints", "topology", "collectives", "memory", "events", "records")


def summary(run_dir: Path | str) -> dict:
    run = Run(run_dir)
    m = run.manifest
    counts, torn = {}, []
    for rank in run.ranks():
        idx = run.step_index(rank)
        counts[rank] = {
            "steps": len(idx.records),
            "records": sum(e["records"] for e in idx.records),
        }
        if idx.torn:
            torn.append(idx.torn)
    events = run.events().records
    info = run.info
    exp, par = m.get("experiment") or {}, m.get("parallelism") or {}
    times = run.step_times(0)  # rank 0's, kept whether the run recorded or not
    if times.torn:
        torn.append(times.torn)
    step_seconds = {e["step"]: e["seconds"] for e in times.records}
    return {
        "path": info.get("path"),
        "complete": run.complete,
        "manifest_id": run.manifest_id,
        "experiment": exp.get("name"),
        "edition": exp.get("edition"),
        "topology": {
            k: par.get(k, 1 if k != "zero_stage" else 0)
            for k in ("world_size", "dp", "tp", "pp", "zero_stage")
        },
        "fault": info.get("fault"),
        "resume": info.get("resume"),
        "loss": {str(k): v for k, v in run.losses().items()},
        "ranks": {str(k): v for k, v in counts.items()},
        "records": sum(c["records"] for c in counts.values()),  # trajectory records over all ranks
        "step_seconds": [step_seconds[k] for k in sorted(step_seconds)],  # rank 0, in step order
        "fault_fired": run.fault_events(),
        "failures": [e for e in events if e.get("event") in FAILURE_EVENTS],
        "stragglers": find_stragglers(run),
        "checkpoints": [p.name for p in run.checkpoint_dirs()],
        "warnings": torn,
    }


def failure_text(e: dict) -> str:
    """What one failure event (FAILURE_EVENTS) says, in a line: a live check names the step, the phase and
    the group whose copies differ; a failed rank or job its error or reason."""
    if e.get("event") == Event.LIVE_CHECK_FAILED:
        return f"step {e.get('step')}: {e.get('phase')} copies over group {e.get('group')} differ"
    return str(e.get("reason") or e.get("error"))


def render_summary(run_dir: Path | str, console: Console, brief: bool = False) -> dict:
    s = summary(run_dir)
    T = lambda v, style=None: Text(str(v), style=style or "")  # noqa: E731  text from files: never markup
    state = T("complete", "green") if s["complete"] else T("INCOMPLETE", "red")
    t = s["topology"]
    console.print(
        T(s["experiment"], "bold")
        + T(f" ({s['edition']})  path={s['path']}  ")
        + state
        + T(
            f"  id={s['manifest_id'][:12]}  world={t['world_size']} dp={t['dp']} tp={t['tp']} pp={t['pp']} "
            f"zero={t['zero_stage']}"
        )
    )
    if s["fault"]:
        f = s["fault"]
        fired = T("fired") if s["fault_fired"] else T("did not fire", "yellow")
        console.print(
            T(f"fault: {f['name']} at step {f['step']} rank {f['rank']} (")
            + fired
            + T(f"); expected first divergence: {f.get('expect')}")
        )
    if s["resume"]:
        console.print(T(f"resumed from {s['resume']['checkpoint']} (step {s['resume']['step']})"))
    if s["loss"]:
        console.print("loss: " + "  ".join(f"{k}:{v:.4f}" for k, v in s["loss"].items()))
    if s["step_seconds"]:
        secs = sorted(s["step_seconds"])
        console.print(
            f"step time (rank 0): median {secs[len(secs) // 2]:.3f} s over {len(secs)} steps; "
            f"{s['records']} trajectory records"
        )
    for f in s["failures"][:3]:
        console.print(T(f.get("event"), "red") + T(f": {failure_text(f)}"), soft_wrap=True)
    for st in s["stragglers"][:3]:
        console.print(
            T("straggler", "yellow")
            + T(
                f": rank {st['rank']} at step {st['step']} took {st['seconds']}s "
                f"to reach its collective (others: {st['others_median']}s)"
            )
        )
    for w in s["warnings"]:
        console.print(T("warning", "yellow") + T(f": {w}"))
    if not brief:
        tab = Table(title="records per rank")
        for col in ("rank", "steps", "records"):
            tab.add_column(col, justify="right")
        for r, c in s["ranks"].items():
            tab.add_row(Text(r), str(c["steps"]), str(c["records"]))
        console.print(tab)
        render_topology(Run(run_dir), console)
    return s


def checkpoints_view(run: Run) -> list[dict]:
    out = []
    for p in run.checkpoint_dirs():
        ok, reason = checkpoint.status(p, run.manifest_id)
        out.append(
            {
                "checkpoint": p.name,
                "step": int(p.name.split("-")[1]),
                "verified": ok,
                "detail": reason,
            }
        )
    partial = (
        sorted(p.name for p in (run.path / "checkpoints").glob("*.partial"))
        if (run.path / "checkpoints").is_dir()
        else []
    )
    for name in partial:
        out.append(
            {
                "checkpoint": name,
                "step": None,
                "verified": False,
                "detail": "partial write (never published)",
            }
        )
    return out


def render_topology(run: Run, console: Console) -> dict | None:
    topo = run.topology()
    if not topo:
        console.print("[yellow]no topology.json[/yellow]")
        return None
    tab = Table(title=Text(f"rank topology (mesh {topo['mesh_shape']})"))
    for col in ("rank", "host", "node", "local", *topo["mesh_dims"]):
        tab.add_column(Text(str(col)), justify="right")
    colours = ["cyan", "magenta", "green", "yellow", "blue", "red"]
    for r in topo["ranks"]:
        c = r["coords"]
        tab.add_row(
            *[Text(str(r[k])) for k in ("rank", "host", "node_rank", "local_rank")],
            *[Text(str(c[d]), style=colours[c[d] % len(colours)]) for d in topo["mesh_dims"]],
        )
    console.print(tab)
    console.print(mesh_picture(topo))
    for dim, groups in topo["groups"].items():
        if topo["mesh_shape"][dim] > 1:
            console.print(Text(f"{dim} groups: {groups}"))
    return topo


def mesh_picture(topo: dict) -> Text:
    """The mesh as a picture: one dp x tp grid of global ranks per pipeline stage, each rank coloured by its
    data-parallel coordinate (rows) - what crosses nodes is what spans rows or stages. A Text: the ranks'
    fields come from topology.json and are never markup."""
    colours = ["cyan", "magenta", "green", "yellow", "blue", "red"]
    shape = topo["mesh_shape"]
    by_coords = {
        (r["coords"]["pp"], r["coords"]["dp"], r["coords"]["tp"]): r for r in topo["ranks"]
    }
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
                cell = f"r{r['rank']}@n{r['node_rank']}" if r else "?"
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


def show(run_dir: Path | str, view: str, console: Console) -> dict:
    if view not in VIEWS:
        raise BadInput("VIEW", f"unknown view '{view}'; one of: {', '.join(VIEWS)}")
    run = Run(run_dir)
    if view == "summary":
        return render_summary(run_dir, console)
    if view == "checkpoints":
        rows = checkpoints_view(run)
        tab = _table(
            "recovery checkpoints",
            ("checkpoint", "verified", "detail"),
            [
                (
                    r["checkpoint"],
                    Text("yes", "green") if r["verified"] else Text("NO", "red"),
                    r["detail"],
                )
                for r in rows
            ],
        )
        console.print(tab if rows else "no checkpoints")
        return {"checkpoints": rows}
    if view == "topology":
        return render_topology(run, console) or {}
    if view == "records":
        return render_record_counts(run, console)
    if view == "collectives":
        res = check_sync(run)
        console.print(
            _table(
                "collectives per process group",
                ("group", "ops", "bytes (rank 0 of group)"),
                [(g, v["ops"], v["bytes"]) for g, v in res["groups"].items()],
            )
        )
        console.print(
            "[green]all groups in sync[/green]"
            if res["ok"]
            else f"[red]{escape(res['first_mismatch']['message'])}[/red]"
        )
        vol = wire_volume(run)
        pred = predicted_dp_volume(run.manifest)
        tab = Table(title="rank 0: tensor traffic per step, ring model (bytes sent per rank)")
        for col in ("step", "class", "calls", "buffer bytes", "ring bytes on the wire"):
            tab.add_column(col, justify="right")
        for step, classes in vol["steps"].items():
            for cls, row in classes.items():
                tab.add_row(
                    Text(str(step)),
                    Text(str(cls)),
                    Text(str(row["calls"])),
                    Text(str(row["bytes"])),
                    f"{row['ring_bytes']:.0f}",
                )
        console.print(tab)
        if pred is not None:
            console.print(
                f"plan (ZeRO paper ring volumes): {pred} bytes per rank per step for this strategy"
            )
            for step, classes in vol["steps"].items():
                if step == "0":
                    continue  # set-up (DDP's initial parameter broadcast)
                total = sum(r["ring_bytes"] for r in classes.values())
                console.print(
                    f"  step {step}: measured (trace, ring model) {total:.0f} / predicted {pred} = "
                    f"{total / pred:.3f}"
                    if pred
                    else ""
                )
            accum = run.manifest.get("training", {}).get("grad_accum_steps", 1)
            if run.manifest.get("parallelism", {}).get("zero_stage") == 3 and accum > 1:
                console.print(
                    f"  gap: ZeRO-3 gathers the parameters again for each of the {accum} micro-batches; "
                    "the paper's 3(n-1)/n Psi counts one forward and backward per step"
                )
        res["wire_volume"], res["predicted_bytes_per_step"] = vol, pred
        return res
    if view == "memory":
        rows = []
        for rank in run.ranks("memory"):
            rows += list(iter_jsonl(run.rank_path("memory", rank), []))
        tab = Table(title="memory ledger (bytes held locally: distinct storages, measured)")
        cols = (
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
        for col in cols:
            tab.add_column(col, justify="right")
        for r in rows:
            pred = r.get("predicted")
            cells = {**r, "predicted": pred.get("total") if isinstance(pred, dict) else pred}
            tab.add_row(*[Text(str(cells.get(c, "-"))) for c in cols])
        console.print(tab)
        last: dict = {}
        for r in rows:  # the gap of each rank's last step, named
            if isinstance(r, dict):
                last[r.get("rank")] = r
        for rank, r in sorted(last.items(), key=lambda kv: str(kv[0])):
            pred = r.get("predicted") if isinstance(r.get("predicted"), dict) else {}
            console.print(
                Text(
                    f"rank {rank} step {r.get('step')}: measured {r.get('measured_total')} B, "
                    f"predicted (ZeRO formula) {pred.get('total')} B"
                )
            )
            for g in r.get("gap_bytes") or []:
                if isinstance(g, dict):
                    why = f" ({g['why']})" if g.get("why") else ""
                    console.print(Text(f"  gap: {g.get('what')}: {g.get('bytes')} B{why}"))
        return {"memory": rows}
    ev = run.events()
    for e in ev.records:
        console.print(e)
    return {"events": ev.records}


def record_counts(run: Run) -> dict:
    """Trajectory records per rank and phase, read from the step index (no record is parsed)."""
    per_rank: dict[str, dict] = {}
    for rank in run.ranks():
        entries = run.step_index(rank).records
        per_rank[str(rank)] = {
            "records": sum(e["records"] for e in entries),
            "steps": len(entries),
            "bytes": sum(e["length"] for e in entries),
        }
    total = sum(v["records"] for v in per_rank.values())
    size = sum(v["bytes"] for v in per_rank.values())
    return {
        "records": total,
        "bytes": size,
        "bytes_per_record": round(size / total, 1) if total else None,
        "ranks": per_rank,
    }


def render_record_counts(run: Run, console: Console) -> dict:
    res = record_counts(run)
    tab = Table(
        title="trajectory records (export every one with `disttrace show RUN records --jsonl`)"
    )
    for col in ("rank", "steps", "records", "bytes"):
        tab.add_column(col, justify="right")
    for rank, v in res["ranks"].items():
        tab.add_row(rank, str(v["steps"]), str(v["records"]), str(v["bytes"]))
    console.print(tab)
    return res


def export_records(run: Run, out) -> int:
    """Every trajectory record of every rank as JSON lines on `out` (a binary stream), rank by rank in
    file order (which is the order key within a rank); each line validated as readers read it. Returns
    the count. The export for tools that want JSON: DuckDB, Polars, jq."""
    n = 0
    for rank in run.ranks():
        for rec in run.records(rank):
            out.write(orjson.dumps(rec) + b"\n")
            n += 1
    return n
