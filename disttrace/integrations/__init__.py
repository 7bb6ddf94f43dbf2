"""Attach disttrace to training libraries' own loops: `hf` (transformers.Trainer), `lightning` (Lightning)."""

from disttrace.errors import BadInput


def evaluation_spec(eval_command, evaluation) -> dict | None:
    """attach(evaluation=) from a callback's eval_command and the rest of the [eval] keys."""
    if eval_command is None and evaluation is None:
        return None
    spec = dict(evaluation or {})
    if eval_command is not None:
        spec["command"] = list(eval_command)
    return spec


def resume_where_the_framework_did(run, checkpoint, step: int, framework: str) -> None:
    """Load disttrace's checkpoint after the framework restored its own, refusing one of another step: a
    replay must start from the state the framework resumed, or its first step is another experiment's."""
    saved = run.resume(checkpoint)
    if saved != step:
        raise BadInput(
            "DisttraceCallback(resume=)",
            f"{checkpoint} is the checkpoint of step {saved}, the {framework} resumed at step {step}",
        )
