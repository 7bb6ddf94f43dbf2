"""A rounding-sized perturbation of the initial parameters, for `disttrace calibrate` (the TTrace way of
measuring run-to-run noise): before the first step every parameter element this rank holds is multiplied
by (1 + r * s), s = +-1 from a generator seeded by the parameter's index (so data-parallel replicas, and
tensor-parallel replicated weights, stay identical), r = `relative` (run.json "perturb")."""

from __future__ import annotations

import torch

from disttrace.store.documents import Perturb


def attach(bus, ctx, spec: Perturb) -> None:
    rel, seed = float(spec.relative), spec.seed
    done = []

    def perturb(b, p):
        if done:
            return
        done.append(True)
        with torch.no_grad():
            for i, (_, param) in enumerate(ctx.strategy.plain.named_parameters()):
                local = param.to_local() if hasattr(param, "to_local") else param
                g = torch.Generator().manual_seed(seed * 100_003 + i)
                s = torch.randint(0, 2, local.shape, generator=g).to(torch.float64) * 2 - 1
                local.copy_((local.double() * (1 + rel * s.to(local.device))).to(local.dtype))
        b.perturbed = True

    bus.on("step_start", perturb, order=5)
