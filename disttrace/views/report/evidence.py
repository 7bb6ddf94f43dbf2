"""What else each run recorded: the memory ledger against theory, the collective summary, the
checkpoints and the gate's verdict."""

from __future__ import annotations

from disttrace.fmt import fmt_number
from disttrace.store.documents import MemoryLine, ModelStateBytes
from disttrace.views.report.parts import (
    _R,
    NOT_RECORDED,
    _badge,
    _bytes,
    _err,
    _nr,
    _table,
    _td_num,
    e,
)


def _memory(rs: list[_R]) -> str:
    rows, notes, footnotes = [], [], []
    for r in rs:
        mem = r.evidence.memory
        if isinstance(mem, BaseException):
            notes.append(_err(f"{r.label}: memory ledger", mem))
            continue
        recs, torn = mem.last, mem.torn
        notes += [f'<p class="warn">{e(r.label)}: {e(t)}</p>' for t in torn]
        if not recs:
            rows.append(
                [r.tag_html(), f'<td colspan="9" class="nr">memory ledger {NOT_RECORDED}</td>']
            )
            continue
        rows += [_memory_row(r, rec, footnotes) for rec in recs]
    if not rows:
        return "".join(notes) or _nr("memory ledger not recorded in any run")
    head = (
        "run",
        "rank",
        "step",
        "params",
        "grads",
        "optimizer",
        "model state: measured / predicted",
        "ratio",
        "activations saved",
        "gap notes",
    )
    fn = "".join(f"<li>{e(g)}</li>" for g in footnotes)
    return (
        _table(head, rows, "wide")
        + (f'<ol class="footnotes">{fn}</ol>' if fn else "")
        + '<p class="muted small">last recorded step per rank; predicted: the ZeRO formula for this strategy '
        "(disttrace.plan.costs); ratio = measured / predicted model state. Hover a figure for exact bytes.</p>"
        + "".join(notes)
    )


def _memory_row(r: _R, rec: MemoryLine, footnotes: list[str]) -> list[str]:
    """One ledger line (a rank's last recorded step) as a table row; its gap notes join `footnotes`."""
    pred = rec.predicted or ModelStateBytes()
    ratio = rec.ratio_model_state
    if isinstance(ratio, (int, float)):
        kind = "ok" if abs(ratio - 1) <= 0.05 else "warn" if abs(ratio - 1) <= 0.25 else "bad"
        ratio_html = _badge(f"{ratio:.4f}", kind)
    else:
        ratio_html = '<span class="nr">-</span>'
    gap = [str(g) for g in rec.gap or []]
    marks = []
    for g in gap:
        if g not in footnotes:
            footnotes.append(g)
        marks.append(f'<sup class="fn">[{footnotes.index(g) + 1}]</sup>')
    return [
        r.tag_html(),
        _td_num(e(rec.rank)),
        _td_num(e(rec.step)),
        _td_num(e(_bytes(rec.params)), f"{rec.params} B · predicted {pred.params} B"),
        _td_num(e(_bytes(rec.grads)), f"{rec.grads} B · predicted {pred.grads} B"),
        _td_num(e(_bytes(rec.optimizer)), f"{rec.optimizer} B · predicted {pred.optimizer} B"),
        _td_num(
            f"<b>{e(_bytes(rec.model_state))}</b> / {e(_bytes(pred.total))}",
            f"{rec.model_state} B measured / {pred.total} B predicted",
        ),
        f'<td class="num">{ratio_html}</td>',
        _td_num(e(_bytes(rec.activations_saved))),
        " ".join(marks) or '<span class="muted">none</span>',
    ]


def _collectives(rs: list[_R]) -> str:
    rows, notes = [], []
    for r in rs:
        name = r.tag_html()
        res = r.evidence.sync
        if res is None:
            rows.append([name, f'<td colspan="4" class="nr">collective trace {NOT_RECORDED}</td>'])
            continue
        if isinstance(res, BaseException):
            rows.append([name, f'<td colspan="4">{_err("collective trace", res)}</td>'])
            continue
        groups = list(res.groups.items())
        if res.first_mismatch is None:
            status = _badge("in sync", "ok")
        else:
            msg = res.first_mismatch.message
            status = _badge("DESYNC", "bad") + f'<div class="bad small">{e(msg)}</div>'
        if not groups:
            rows.append([name, '<td colspan="3" class="nr">no process group recorded</td>', status])
        for k, (g, v) in enumerate(groups):
            rows.append(
                [
                    name if k == 0 else "",
                    f"<code>{e(g)}</code>",
                    _td_num(e(v.ops)),
                    _td_num(e(_bytes(v.bytes)), f"{v.bytes} B"),
                    status if k == 0 else "",
                ]
            )
        unfinished = res.unfinished
        if unfinished:
            u = unfinished[0]
            notes.append(
                f'<p class="warn">{e(r.label)}: {len(unfinished)} collective(s) issued but never finished, '
                f"first: rank {e(u.rank)} group {e(u.group)} seq {e(u.seq)} {e(u.op)}</p>"
            )
        for w in res.warnings:
            notes.append(f'<p class="warn">{e(r.label)}: {e(w)}</p>')
        for st in r.evidence.stragglers[:3]:
            notes.append(
                f'<p class="warn">{e(r.label)}: straggler: rank {e(st.rank)} at step {e(st.step)} '
                f"took {e(st.seconds)} s to reach its collective (others {e(st.others_median)} s)"
                "</p>"
            )
    head = ("run", "process group (ranks)", "ops", "bytes (first member)", "sync")
    return (
        _table(head, rows)
        + '<p class="muted small">every member of a group must issue the same sequence of '
        "(op, shapes, dtype); the first disagreement is named</p>" + "".join(notes)
    )


def _checkpoints(rs: list[_R]) -> str:
    rows = []
    for r in rs:
        name = r.tag_html()
        if isinstance(r.evidence.checkpoints, BaseException):
            rows.append(
                [name, f'<td colspan="4">{_err("checkpoints", r.evidence.checkpoints)}</td>']
            )
            continue
        cks = r.evidence.checkpoints.checkpoints
        resume = r.info.resume
        if resume is not None:
            name += (
                f'<div class="muted small">resumed from <code>{e(resume.checkpoint)}</code></div>'
            )
        if not cks:
            rows.append([name, f'<td colspan="4" class="nr">checkpoints {NOT_RECORDED}</td>'])
            continue
        for k, c in enumerate(cks):
            ok = c.verified
            rows.append(
                [
                    name if k == 0 else "",
                    f"<code>{e(c.checkpoint)}</code>",
                    _td_num(e(c.step if c.step is not None else "-")),
                    _badge("verified", "ok") if ok else _badge("BAD", "bad"),
                    e(c.detail) if ok else f'<span class="bad">{e(c.detail)}</span>',
                ]
            )
    return (
        _table(("run", "checkpoint", "step", "sha256", "detail"), rows)
        + '<p class="muted small">every file of every checkpoint is read and hashed against its INDEX.json</p>'
    )


def _gate(rs: list[_R]) -> str:
    out = []
    for r in rs:
        if not r.evidence.state.has_verdict:
            continue
        v = r.evidence.state.verdict
        out.append(f"<h3>{r.tag_html()} ")
        if v is None:
            out.append(f"</h3>{_nr('verdict.json could not be read')}")
            continue
        out.append((_badge("PASS", "ok") if v.passed else _badge("FAIL", "bad")) + "</h3>")
        if v.reference:
            out.append(f'<p class="muted">against reference <code>{e(v.reference)}</code></p>')
        else:
            out.append('<p class="muted">no reference given</p>')
        rows = []
        for c in v.checks:
            res = {True: _badge("pass", "ok"), False: _badge("FAIL", "bad")}.get(
                c.passed, _badge("n/a", "na")
            )
            rows.append([f"<code>{e(c.name)}</code>", res, e(c.reason)])
        out.append(_table(("check", "result", "reason"), rows))
        for fl in v.flags:
            out.append(f'<p class="warn">flag: {e(fl)}</p>')
        ev = v.eval  # the evaluator's document, as it wrote it
        if isinstance(ev, dict) and "eval_loss" in ev:
            out.append(
                f'<p class="muted">evaluation ({e(ev.get("process", "?"))}): eval loss '
                f"{e(fmt_number(ev.get('eval_loss'), '.6f'))}, token accuracy "
                f"{e(fmt_number(ev.get('token_accuracy'), '.4f'))}"
                f" on {e(ev.get('tokens'))} tokens of checkpoint {e(ev.get('checkpoint'))}</p>"
            )
    if not out:
        return _nr(
            "no gate verdict recorded (run `disttrace gate RUN --reference REF` to write one)"
        )
    return "".join(out)
