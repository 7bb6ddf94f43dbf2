"""The run side: everything that executes inside (or launches) a distributed job and writes a run store.

launch -> worker (one per rank) -> loop, with a strategy from `parallel/` and observers (recorder,
collective trace, memory ledger, live check, faults) attached at the named hook points of `hooks.py`.
`attach/` gives a user's own script the same recorder. Nothing outside this package imports torch
at module level, so the readers run where torch is not installed.
"""
