"""The fault catalog: one registry entry per fault, each attached at a named hook point.

An entry states its name, hook point, parameters (with defaults), a one-line description and the first
divergence it must produce (`expect`). A fault fires exactly once, on its (step, rank), and logs the exact
coordinates to events.jsonl. The training loop knows none of them.

Proof that it fired: a fault that changes state passes `proof=(before, after)` to `fire` (a digest of the
raw bytes of what it names, or the scalar it changes), and the `fault_fired` event carries
`digest_before`, `digest_after` and `changed`. A spec that could change nothing (an unknown tensor, an
empty selection under the strategy, a no-op parameter) is refused before any process starts (exit 2).

`expect` uses the phases of docs/design.md, "Order"; special signatures: "resume:optimizer" (the recovered run diverges at
the resume step), "refused-at-load", "exit-3", "none" (numerics equal; a straggler is flagged).

The base class, its admission checks and the registry are `base.py`; the entries are one module a family
(`bits`, `batches`, `reduce`, `optimizer`, `checkpoints`, `job`, `layouts`, and `modules` for the faults inside
one module), all registered here.
"""

from __future__ import annotations

# the entries register as their modules are imported
from disttrace.run.faults import (  # noqa: F401
    batches,
    bits,
    checkpoints,
    job,
    layouts,
    modules,
    optimizer,
    reduce,
)
from disttrace.run.faults.base import (
    RECURRENCES,
    REGISTRY,
    AnyManifest,
    Capability,
    Fault,
    NoArgs,
    at,
    attached_capabilities,
    build,
    capabilities,
    catalog,
    get,
    register,
    state_digest,
    strategy_name,
    typed,
)
from disttrace.run.faults.bits import FAULTY_OPS, flip_bit, launch_slot
from disttrace.run.faults.targets import pick

# the catalog (`disttrace faults`, `get`'s list of known names) keeps one order of its own, whatever
# the modules' order
CATALOG_ORDER = (
    "bitflip-grad",
    "bitflip-param",
    "skip-allreduce",
    "grad-scale",
    "data-swap",
    "drop-microbatch",
    "stale-param",
    "lr-skew",
    "optimizer-reset",
    "corrupt-checkpoint",
    "kill-rank",
    "slow-rank",
    "collective-mismatch",
    "clip-local-norm",
    "clip-skip-replicated",
    "late-microbatch",
    "unsynced-param",
    "loss-scale",
    "bf16-reduce",
    "faulty-device",
    "ep-misroute",
    "ep-drop-expert",
    "cp-label-boundary",
)
_entries = {**{n: REGISTRY[n] for n in CATALOG_ORDER}, **REGISTRY}
REGISTRY.clear()
REGISTRY.update(_entries)

__all__ = [
    "CATALOG_ORDER",
    "FAULTY_OPS",
    "RECURRENCES",
    "REGISTRY",
    "AnyManifest",
    "Capability",
    "Fault",
    "NoArgs",
    "at",
    "attached_capabilities",
    "build",
    "capabilities",
    "catalog",
    "flip_bit",
    "get",
    "launch_slot",
    "pick",
    "register",
    "state_digest",
    "strategy_name",
    "typed",
]
