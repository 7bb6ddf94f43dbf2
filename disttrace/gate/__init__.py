"""The independent evaluation gate: the verdict (which checks, which policy) and the evaluation, run as a
fresh single process on the final checkpoint."""
