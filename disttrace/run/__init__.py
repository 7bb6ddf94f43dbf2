"""The run side: everything that executes inside (or launches) a distributed job and writes a run store.

`job/`: launch -> worker (one per rank) -> loop, with a strategy from `parallel/` and observers from
`record/` (recorder, collective trace, memory ledger, live check) and `faults/` attached at the named hook
points of `job/hooks.py`. `attach/` gives a user's own script the same recorder, `zerocode/` gives it to a
script with no disttrace line, `deepspeed/` to a DeepSpeedEngine; `evaluation/` is the gate's independent
evaluation. Nothing outside this package imports torch at module level, so the readers run where torch is
not installed.
"""
