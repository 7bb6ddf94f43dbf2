"""disttrace command line. Human output goes to stderr (rich); stdout carries what pipelines consume:
the run directory as the last line of a run command, or exactly one JSON document with --json.

Exit codes: 0 ok/equal/pass, 1 divergence or failed gate, 2 bad input, 3 the distributed job failed,
4 a partial diff (some ranks or steps) that found no divergence: no verdict.

Here: `main` (which passes a user's command after `--` through whole) and the registration of the commands,
one module a group; what they share (the app, the stderr console, the options and error handling) is in
shared.py.
"""

from __future__ import annotations

import sys

from disttrace.cli import shared
from disttrace.errors import EXIT_BAD_INPUT, BadInput


def main():
    argv = sys.argv[1:]
    if (
        len(argv) > 1 and argv[0] in ("run", "inject", "replay", "zoom", "diff") and "--" in argv
    ):  # a user command, passed through whole
        cut = argv.index("--")
        shared.USER_COMMAND = argv[cut + 1 :]
        sys.argv = [sys.argv[0], *argv[:cut]]
    try:
        shared.app()
    except BadInput as e:  # raised outside a command (should not happen, but never a traceback)
        shared.err.print(f"error: {e}")
        sys.exit(EXIT_BAD_INPUT)


# the commands, one module a group, registered on shared.app as they are imported; `disttrace --help` lists
# them in that order, so in this order of the modules
from disttrace.cli import jobs, look, compare, verdicts, readers  # noqa: E402, F401, I001
