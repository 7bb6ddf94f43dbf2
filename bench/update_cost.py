"""What the update records cost the recorder (run/record/updates.py): a copy of each parameter before the optimizer
step and one pass over the copy and the parameter after it, against what the recorder already does with the
same parameters at that point (digesting them: run/record/digest.py's digest_many). Steps alternate between
the compiled pass (disttrace/native/updates.c) and torch's operations (the path without the C extension,
DISTTRACE_NATIVE=0), so both are measured in one run. In one process, CPU time of this thread, the median of
`--repeats` steps of each, so other jobs on the machine disturb it less than a step time.

    python bench/update_cost.py [--set model.dim=256 --set model.max_seq_len=128 ...] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from disttrace.config.freezing import apply_overrides, read_toml, validate
from disttrace.model.llama import build_model
from disttrace.run.job.hooks import param_refs
from disttrace.run.parallel.common import build_optimizer
from disttrace.run.record import updates as updates_module
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
    updates, digest = Updates(), []
    cost = {"C": [], "torch": []}
    numel = sum(p.numel() for _, _, p in named)
    for i in range(2 * args.repeats + 4):
        path = "C" if i % 2 else "torch"
        os.environ["DISTTRACE_NATIVE"] = "1" if path == "C" else "0"
        updates_module._kernel.cache_clear()
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
        cost[path].append((t1 - t0) + (t3 - t2))
        digest.append(t4 - t3)
    if updates_module._kernel() is None:
        sys.exit("update_cost: the C extension disttrace.native._updates is not built")
    c, plain = (statistics.median(cost[k][2:]) for k in ("C", "torch"))
    digest = statistics.median(digest[4:])
    print(
        f"{len(named)} parameters, {numel * 4 / 2**20:.1f} MiB: update records {c * 1e3:.2f} ms a step "
        f"({c / digest:.2f}x the parameters' digests, {digest * 1e3:.2f} ms); with torch's operations instead "
        f"of the C pass {plain * 1e3:.2f} ms (C: {c / plain:.2f}x of it)"
    )


if __name__ == "__main__":
    main()
