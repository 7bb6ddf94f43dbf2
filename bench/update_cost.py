"""What the update records cost the recorder (run/record/updates.py): a copy of each parameter before the optimizer
step and two passes over it after, against what the recorder already does with the same parameters at that
point (digesting them: run/record/digest.py's digest_many). In one process, CPU time of this thread, the median of
`--repeats` steps, so other jobs on the machine disturb it less than a step time.

    python bench/update_cost.py [--set model.dim=256 --set model.max_seq_len=128 ...] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from disttrace.config.freezing import apply_overrides, read_toml, validate
from disttrace.model.llama import build_model
from disttrace.run.job.hooks import param_refs
from disttrace.run.parallel.common import build_optimizer
from disttrace.run.record.digestmany import digest_many
from disttrace.run.record.updates import Updates


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    path = "manifests/default.toml"
    manifest = validate(apply_overrides(read_toml(path), args.set), path)
    torch.set_num_threads(1)
    model = build_model(manifest.model)
    named = param_refs(model)
    opt = build_optimizer(manifest, model.parameters())
    updates, cost, digest = Updates(), [], []
    numel = sum(p.numel() for _, _, p in named)
    for _ in range(args.repeats + 2):
        for _, _, p in named:
            p.grad = torch.randn_like(p)
        t0 = time.thread_time()
        updates.before(named)
        t1 = time.thread_time()
        opt.step()
        t2 = time.thread_time()
        recs = updates.after(named, opt)
        t3 = time.thread_time()
        digest_many([(p, None, None) for _, _, p in named])
        t4 = time.thread_time()
        assert len(recs) == len(named)
        cost.append((t1 - t0) + (t3 - t2))
        digest.append(t4 - t3)
    cost, digest = statistics.median(cost[2:]), statistics.median(digest[2:])
    print(
        f"{len(named)} parameters, {numel * 4 / 2**20:.1f} MiB: update records {cost * 1e3:.2f} ms a step, "
        f"the parameters' digests {digest * 1e3:.2f} ms ({cost / digest:.2f}x of them)"
    )


if __name__ == "__main__":
    main()
