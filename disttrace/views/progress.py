"""Live progress of a job on stderr, from the run store as it grows (store/follow.py reads it).

On a terminal: a rich progress bar (step k/N, loss, s/step, ETA) with one line above it per checkpoint,
fault, failed rank and stall. On a pipe or in CI: one plain line every few seconds plus those event lines,
never a redrawn bar. The launcher runs it in a background thread (`LiveProgress`); `disttrace watch` runs
it in the foreground (`watch`). No torch here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from disttrace.errors import EXIT_JOB_FAILED, EXIT_OK
from disttrace.store.follow import Follower, Progress, writer_alive
from disttrace.store.records import FAILURE_EVENTS, Event

POLL_S = 0.5
PLAIN_EVERY_S = (
    5.0  # plain mode: at most one progress line this often (DISTTRACE_PROGRESS_EVERY overrides)
)


def plain_mode(console: Console) -> bool:
    """A bar only where a person watches a terminal: not on a pipe, not in CI, not on a dumb terminal."""
    return not console.is_terminal or bool(os.environ.get("CI")) or os.environ.get("TERM") == "dumb"


def plain_every() -> float:
    try:
        return max(0.0, float(os.environ.get("DISTTRACE_PROGRESS_EVERY", PLAIN_EVERY_S)))
    except ValueError:
        return PLAIN_EVERY_S


def _duration(s: float) -> str:
    s = int(round(s))
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
    )


def status_line(p: Progress) -> str:
    """`step 7/20 loss 5.4321 0.21 s/step eta 3s` (the fields known so far)."""
    parts = [f"step {p.done}/{p.total}"]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.step_s is not None:
        parts.append(f"{p.step_s:.2f} s/step")
    if p.complete:
        parts.append("complete")
    elif p.eta_s is not None:
        parts.append(f"eta {_duration(p.eta_s)}")
    return " ".join(parts)


class Display:
    """Renders successive Progress values: plain lines or a rich bar."""

    def __init__(
        self,
        console: Console,
        label: str | None = None,
        plain: bool | None = None,
        show_job_failed: bool = True,
    ):
        self.console = console
        self.prefix = f"{label}: " if label else ""
        self.plain = plain_mode(console) if plain is None else plain
        self.every = plain_every()
        self.show_job_failed = (
            show_job_failed  # the launcher reports its own failure once, after the bar
        )
        self._printed: tuple | None = None  # (step, complete) of the last plain line
        self._printed_at = 0.0
        self._bar = None
        self._task = None

    def _line(self, text: str, style: str | None = None) -> None:
        target = self._bar.console if self._bar is not None else self.console
        target.print(Text(self.prefix + text, style=style or ""), soft_wrap=True, highlight=False)

    def update(self, p: Progress, final: bool = False) -> None:
        for n in p.notices:
            if n.kind == Event.JOB_FAILED and not self.show_job_failed:
                continue
            # a full disk is said once, by the launcher's own last line (the rank, the file, the log):
            # each rank's line would repeat it
            if n.kind == Event.RANK_FAILED and not self.show_job_failed and n.disk_full:
                continue
            self._line(
                n.text,
                "red" if n.kind in FAILURE_EVENTS else "yellow" if n.kind == "fault" else None,
            )
        if p.stall is not None:
            self._line(p.stall.describe(), "yellow")
        line = status_line(p)
        if self.plain:
            now = time.monotonic()
            first = self._printed is None and p.done > p.start_step
            due = self._printed is not None and now - self._printed_at >= self.every
            # a line when a step was finished since the last one, at most every few seconds, and at the end
            key = (p.done, p.complete)
            if key != (self._printed or (p.start_step, False)) and (
                first or due or final or p.complete
            ):
                self.console.print(Text(self.prefix + line), soft_wrap=True, highlight=False)
                self._printed, self._printed_at = key, now
            return
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn(self.prefix + "step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=p.total, completed=p.done, info="")
        info = line.split(" ", 2)[2] if line.count(" ") >= 2 else ""
        self._bar.update(self._task, completed=p.done, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class LiveProgress:
    """`with LiveProgress(run_dir, console):` shows the job's progress from a background thread while the
    body (the launcher) runs; on exit, one last poll so the final line says N/N when the job completed."""

    def __init__(
        self,
        run_dir: Path | str,
        console: Console,
        label: str | None = None,
        enabled: bool = True,
        poll_s: float = POLL_S,
    ):
        self.run_dir, self.console, self.label, self.enabled, self.poll_s = (
            run_dir,
            console,
            label,
            enabled,
            poll_s,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> LiveProgress:
        if not self.enabled:
            return self
        try:
            self.follower = Follower(self.run_dir)
        except Exception as e:  # the display must never stop the job from starting
            self.console.print(Text(f"progress: not shown ({e})", style="dim"), soft_wrap=True)
            return self
        self.display = Display(self.console, self.label, show_job_failed=False)
        self._thread = threading.Thread(target=self._loop, name="disttrace-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self, final: bool = False) -> None:
        with self._lock:
            try:
                self.display.update(self.follower.poll(), final=final)
            except Exception as e:  # the display must never break the job it watches
                self.console.print(
                    Text(f"progress: {type(e).__name__}: {e}", style="dim"), soft_wrap=True
                )
                self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._tick()

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._tick(final=True)
        self.display.close()


def watch(
    run_dir: Path | str, console: Console, timeout_s: float | None = None, poll_s: float = POLL_S
) -> int:
    """Follow a run another process writes until it ends; returns its outcome as an exit code: 0 complete,
    3 failed (a rank failed, the launcher logged job_failed, its launcher is gone before COMPLETE, or
    nothing grew for timeout_s). Raises BadInput (exit 2) when run_dir is not a run."""
    follower = Follower(run_dir)
    if (
        timeout_s is None
    ):  # a hung collective ends the job within its timeout; past twice that, nobody writes
        timeout_s = 2 * float(follower.timeout_s or 60) + 60
    display = Display(console)
    try:
        while True:
            p = follower.poll()
            display.update(p, final=p.complete)
            if p.complete:
                return EXIT_OK
            if p.failed:
                return _settle(follower, display, poll_s)
            alive = writer_alive(follower.path)
            if alive is False:
                p = follower.poll()  # COMPLETE may have landed between the two looks
                display.update(p, final=True)
                if p.complete:
                    return EXIT_OK
                if not p.failed:
                    display._line(
                        "job failed: its launcher is gone and the run is not complete", "red"
                    )
                return EXIT_JOB_FAILED
            if follower.idle_s() > timeout_s:
                display.update(follower.poll(), final=True)
                display._line(
                    f"job failed: nothing was written to the run for {timeout_s:.0f} s "
                    f"(--timeout); the run is not complete",
                    "red",
                )
                return EXIT_JOB_FAILED
            time.sleep(poll_s)
    finally:
        display.close()


def _settle(follower: Follower, display: Display, poll_s: float, grace_s: float = 3.0) -> int:
    """A rank failed: give the launcher a moment to log why the job ended (job_failed), then report."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and writer_alive(follower.path):
        time.sleep(poll_s)
        display.update(follower.poll())
    display.update(follower.poll(), final=True)
    return EXIT_JOB_FAILED


class StepBar:
    """`with StepBar(console, "diff") as on_step:` a transient bar for a long read (diff over many steps),
    on a terminal only: on a pipe or in CI it shows nothing (a log needs no count of steps read)."""

    def __init__(self, console: Console, label: str):
        self.console, self.label = console, label
        self._bar = None

    def __enter__(self):
        if plain_mode(self.console):
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn(f"{self.label}: step"),
            BarColumn(),
            MofNCompleteColumn(),
            console=self.console,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._bar.start()
        task = self._bar.add_task("", total=None)
        return lambda done, total: self._bar.update(task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
