"""The public name of the attach API (`import disttrace.api as disttrace`); it lives in disttrace.run.attach."""

from disttrace.run.attach import AttachedRun, attach  # noqa: F401
