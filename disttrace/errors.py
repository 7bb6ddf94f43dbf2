"""The exit-code contract in one place (docs/design.md, "Command line contract")."""

EXIT_OK = 0
EXIT_DIVERGED = 1  # a divergence was found, or a gate/check failed
EXIT_BAD_INPUT = (
    2  # unreadable/invalid manifest, incompatible runs, unknown fault, corrupt checkpoint
)
EXIT_JOB_FAILED = 3  # the distributed job itself failed (a rank died, a collective timed out)
# a partial diff (`diff --ranks` / `--steps`) that found no divergence in what it read: no verdict on the rest,
# so never 0; `diff --merge` of the partials gives the verdict (a partial that diverges exits 1)
EXIT_PARTIAL = 4
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)


def verdict_exit(ok: bool) -> int:
    """A reader's verdict as an exit code: equal / consistent / pass -> 0, else 1."""
    return EXIT_OK if ok else EXIT_DIVERGED


class DisttraceError(Exception):
    exit_code = EXIT_BAD_INPUT


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


class BadInput(DisttraceError):
    """Bad input: a one-line reason that names the file and, where there is one, the field."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, where: str, reason: str, field: str | None = None):
        # the message is one line whatever a file or a user put in a key or a value
        self.where = _one_line(str(where))
        self.field = _one_line(field) if field is not None else None
        self.reason = _one_line(str(reason))
        loc = f"{self.where}: {self.field}" if self.field else self.where
        super().__init__(f"{loc}: {self.reason}")


class JobFailed(DisttraceError):
    """The distributed job failed after writing what it could."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, reason: str, run_dir: str | None = None):
        self.run_dir = run_dir
        super().__init__(reason)
