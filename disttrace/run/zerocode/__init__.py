"""Zero-code recording of a training command that never calls `disttrace.api.attach`: `recording` arms
torch's process-wide hooks, `site/sitecustomize.py` (put first on the command's PYTHONPATH) calls it in every
Python process the command starts."""
