"""The replica check, live: at the end of every step each rank digests the records that must agree with
its replicas (the strategy's replica map), all-gathers that one digest over each replica group and
compares. The first inconsistent step stops the job (exit 3) instead of finishing a wasted run.
Opt-in (`debug.live_check = true`); its cost is one small all-gather per rule per step (bench/overhead.py).
The post-mortem `disttrace check` reads the same map from the run store and names the tensor."""

from __future__ import annotations

import fnmatch

import torch.distributed as dist

from .digest import digest_of_digests
from .store import event


class InconsistentReplicas(RuntimeError):
    pass


class LiveCheck:
    ORDER = 89  # before the recorder (90) writes and clears the step's records

    def __init__(self, run_dir, recorder, rules: list[dict], mesh, rank: int):
        self.run_dir, self.recorder, self.rules, self.rank = run_dir, recorder, rules, rank
        self.groups = {}
        for rule in rules:
            dim = rule["dim"]
            if dim not in self.groups:
                self.groups[dim] = None if dim == "world" else mesh.get_group(dim)

    def attach(self, bus) -> "LiveCheck":
        bus.on("step_end", self._check, self.ORDER)
        return self

    def _matches(self, rule, rec) -> bool:
        pats = rule.get("tensors", "*")
        pats = [pats] if isinstance(pats, str) else pats
        return (rec["phase"] == rule["phase"] and any(fnmatch.fnmatchcase(rec["tensor"], p) for p in pats)
                and not ("exclude" in rule and fnmatch.fnmatchcase(rec["tensor"], rule["exclude"])))

    def _check(self, bus, _payload):
        for rule in self.rules:
            group = self.groups[rule["dim"]]
            size = dist.get_world_size(group)
            if size < 2:
                continue
            mine = digest_of_digests([r["digest"] for r in self.recorder._buf if self._matches(rule, r)])
            gathered: list = [None] * size
            dist.all_gather_object(gathered, mine, group=group)
            bad = (len(set(gathered)) > 1) if rule["relation"] == "agree" else (len(set(gathered)) < size)
            if bad:
                ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
                msg = (f"live check: step {bus.step} {rule['phase']} copies over {rule['dim']} group {ranks} "
                       f"{'differ' if rule['relation'] == 'agree' else 'repeat'}: {dict(zip(ranks, gathered))}")
                if self.rank == min(ranks):
                    event(self.run_dir, "live_check_failed", step=bus.step, phase=rule["phase"], group=ranks,
                          digests={str(r): d for r, d in zip(ranks, gathered)})
                raise InconsistentReplicas(msg)
