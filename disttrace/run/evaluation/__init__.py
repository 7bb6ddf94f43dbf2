"""Evaluation outside the training job: `evaluate` is the gate's own fresh process that scores the final
checkpoint, `evalkit` what a user's evaluation script needs (public through `disttrace.api`)."""
