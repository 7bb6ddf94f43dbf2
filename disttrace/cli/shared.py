"""What every command shares: the app, the stderr console (`err`), the options, the error handling, and
USER_COMMAND (what followed `--`, set by `main`). The commands read `shared.err` and `shared.USER_COMMAND`
at call time (a test may replace the console); the package's __init__ registers the commands on the app.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import typer
from rich.text import Text

from disttrace.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    BadInput,
    DisttraceError,
    JobFailed,
)
from disttrace.fmt import visible
from disttrace.views.console import SafeConsole

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Reproducibility harness for distributed PyTorch training: freeze a manifest, run the reference, "
    "inject one fault, recover, diff to the first divergence, and gate the result.",
    epilog="Start: `disttrace run` (the embedded default manifest), then `disttrace lab --list`. "
    "Exit codes: 0 ok / equal / pass, 1 divergence or failed gate, 2 bad input (one line naming the file "
    "and field), 3 the distributed job failed, 4 a partial diff without divergence (no verdict). --json "
    "prints one JSON document on stdout; a run command's "
    "last stdout line is its run directory.",
)
# emoji off: a ":smile:" in a tensor name or a path prints as written
err = SafeConsole(
    stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False, emoji=False
)

ManifestArg = typer.Argument(
    None,
    help="manifest TOML (default: manifests/default.toml), or a lock `freeze -o` wrote (.json), run as frozen",
    show_default=False,
)
SetOpt = typer.Option(None, "--set", help="override a manifest key: section.key=value (repeatable)")
OutOpt = typer.Option(Path("runs"), "--out", help="runs root directory")
JsonOpt = typer.Option(False, "--json", help="print exactly one JSON document on stdout")
QuietOpt = typer.Option(
    False,
    "--quiet",
    "-q",
    help="no live progress on stderr (step, loss, s/step, ETA, "
    "checkpoints, faults, failed ranks, stalls)",
)


def emit_json(obj) -> None:
    """One document on stdout: a dict, or a typed result (its `to_json()`), written piece by piece."""
    from disttrace.jsondoc import write

    write(obj, sys.stdout)
    sys.stdout.flush()


def one_line(e: Exception) -> str:
    return str(e).replace("\r", "\\r").replace("\n", "\\n")


def handled(fn):
    """Turn our errors into the exit-code contract with a one-line message; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobFailed as e:
            err.print(Text("job failed: ", style="red") + Text(visible(str(e))), soft_wrap=True)
            if kwargs.get("json_"):
                emit_json({"run_dir": e.run_dir, "complete": False, "error": one_line(e)})
            elif e.run_dir:
                print(e.run_dir)
            raise typer.Exit(e.exit_code) from None
        # text from files and users: never markup, never two lines, made visible before rich sees it
        # (rich would expand a tab and drop a carriage return, so the line would not say what was raised)
        except DisttraceError as e:
            err.print(Text("error: ", style="red") + Text(visible(str(e))), soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except OSError as e:  # the disk filled up, or a path cannot be written: never a traceback
            import errno

            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            err.print(
                Text("error: ", style="red") + Text(visible(f"{e.filename or ''}: {e.strerror}")),
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_JOB_FAILED if full else EXIT_BAD_INPUT) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        # a bug of ours: one line, and never an exit code that reads as a verdict
        except Exception as e:
            err.print(
                Text("internal error: ", style="red") + Text(visible(f"{type(e).__name__}: {e}")),
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_JOB_FAILED) from None

    return wrapper


def _freeze(manifest: Path | None, sets: list[str] | None):
    from disttrace.config.freezing import freeze, read_lock

    if manifest is not None and manifest.suffix == ".json":
        if sets:
            raise BadInput(
                "--set", "a lock is run as frozen: freeze again with the override instead"
            )
        return read_lock(manifest)
    return freeze(manifest, sets or [])


def parse_params(params: list[str] | None) -> dict:
    out = {}
    for p in params or []:
        if "=" not in p:
            raise BadInput("--param", f"'{p}' is not of the form key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


USER_COMMAND: list[str] | None = (
    None  # what followed `--` on `disttrace run|inject|replay|zoom|diff ... -- CMD ARGS...`
)
