"""The public name of the attach API (`import disttrace.api as disttrace`); it lives in disttrace.run.attach.
An evaluation script's helpers (load a checkpoint, print the metric line) live in disttrace.run.evaluation.evalkit."""

from disttrace.run.attach import AttachedRun, attach  # noqa: F401
from disttrace.run.evaluation.evalkit import data_sha256, load_checkpoint, print_metric  # noqa: F401
