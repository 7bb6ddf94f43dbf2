"""The replica check, live: at the end of every step each rank digests, per rule of the strategy's replica
map, the records that must agree with its replicas; one all-gather of those digests (16 bytes per rule)
over the whole job lets every rank compare each replica group. The first inconsistent step stops the job
(exit 3) instead of finishing a wasted run. Opt-in (`debug.live_check = true`); its cost is one small
all-gather per step (bench/overhead.py). The post-mortem `disttrace check` reads the same map from the run
store and names the tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrace.analysis.replica_rules import rule_applies
from disttrace.run.record.digest import digest_of_digests
from disttrace.store.documents import ReplicaRule
from disttrace.store.events import LiveCheckFailed
from disttrace.store.writers import event


class InconsistentReplicas(RuntimeError):
    pass


class LiveCheck:
    ORDER = 89  # before the recorder (90) writes and clears the step's records

    def __init__(
        self,
        run_dir,
        recorder,
        rules: list[dict],  # the strategy's replica rules (documents.ReplicaRule's shape)
        groups: dict[str, list[list[int]]],
        rank: int,
        device=None,
    ):
        self.run_dir, self.recorder, self.rank = run_dir, recorder, rank
        self.rules = [ReplicaRule.model_validate(r) for r in rules]
        self.groups, self.device = groups, device

    def attach(self, bus) -> LiveCheck:
        bus.on("step_end", self._check, self.ORDER)
        return self

    def _check(self, bus, _payload):
        mine = torch.tensor(
            [
                list(
                    bytes.fromhex(
                        digest_of_digests(
                            [
                                r["digest"]
                                for r in self.recorder.step_records()
                                if rule_applies(rule, r)
                            ]
                        )
                    )
                )
                for rule in self.rules
            ],
            dtype=torch.uint8,
            device=self.device,
        )
        world = dist.get_world_size()
        everyone = torch.empty(
            (world * mine.shape[0], mine.shape[1]), dtype=torch.uint8, device=self.device
        )
        gather = (
            getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        )  # renamed in 2.13
        gather(everyone, mine)  # ranks' rows one after another along dim 0
        table = everyone.view(world, *mine.shape).cpu()
        for k, rule in enumerate(self.rules):
            for members in self.groups[rule.dim]:
                if len(members) < 2:
                    continue
                seen = [bytes(table[r, k].tolist()).hex() for r in members]
                bad = len(set(seen)) > 1 if rule.relation == "agree" else len(set(seen)) < len(seen)
                if not bad:
                    continue
                msg = (
                    f"live check: step {bus.step} {rule.phase} copies over {rule.dim} group {members} "
                    f"{'differ' if rule.relation == 'agree' else 'repeat'}"
                )
                if self.rank == min(members):
                    event(
                        self.run_dir,
                        LiveCheckFailed(
                            step=bus.step,
                            phase=rule.phase,
                            group=members,
                            digests={str(r): d for r, d in zip(members, seen)},
                        ),
                    )
                raise InconsistentReplicas(msg)
