"""Attach disttrace to training libraries' own loops: `hf` (transformers.Trainer), `lightning` (Lightning)."""


def evaluation_spec(eval_command, evaluation) -> dict | None:
    """attach(evaluation=) from a callback's eval_command and the rest of the [eval] keys."""
    if eval_command is None and evaluation is None:
        return None
    spec = dict(evaluation or {})
    if eval_command is not None:
        spec["command"] = list(eval_command)
    return spec
