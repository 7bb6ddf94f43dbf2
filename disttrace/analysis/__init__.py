"""Analysis of run stores: diff (first divergence), tolerance (derived bounds), consistency (replicas that
must agree within one run) and sync (collective sequences across ranks). Reads only the run store, imports
no torch, and returns data: `views/` renders it."""
