"""torchtitan's trainer, run exactly as ``python -m torchtitan.train`` would, on CPU/gloo.

A test client, not part of disttrace: it never imports disttrace. torchtitan 0.3.0 assumes an
accelerator and a newer torch than the CPU wheel used here (2.13), so a few shims are applied
before its trainer runs; none of them changes the arithmetic of a training step:

- the device type is forced to ``cpu`` before torchtitan is imported (``torchtitan.tools.utils``
  reads ``torch._utils._get_available_device_type`` once, at import, and falls back to
  ``cuda``), so the process group is gloo and every tensor lives on the CPU;
- ``torch.cpu`` gets inert memory functions (``get_device_name``, ``get_device_properties``,
  ``reset_peak_memory_stats``, ``empty_cache``, ``memory_stats``) for torchtitan's device
  memory monitor, where torch lacks them;
- flex attention runs eagerly (torchtitan wraps it and ``create_block_mask`` in
  ``torch.compile``) with torch's "no backward on CPU" device check skipped;
- the process-group timeout setter that torchtitan calls after the first step
  (``torch.distributed.set_timeout``, newer than torch 2.13) is replaced by the same barrier and
  c10d's ``_set_pg_timeout``;
- FSDP's gradient reduce-scatter uses ``SUM`` (``set_force_sum_reduction_for_comms``) instead of
  ``PREMUL_SUM``, which gloo lacks; torchtitan already sets FSDP's divide factor to 1.0 and
  scales the loss by the global token count itself, so the sum is the same reduction.

With ``TITAN_BUG=local-clip`` a bug users report is planted in the training code: each rank clips by
the norm of its own gradient shards (the norm never reduced over the mesh), so under FSDP or TP the
ranks scale their shards by different coefficients; at dp=1 it computes the same as the fix.

With ``TITAN_LOSSES=PATH`` in the environment, rank 0 also appends each logged step's loss and
grad norm at full precision to PATH as JSON lines (an observation; nothing else changes).

The command line is torchtitan's own; on CPU/gloo pass ``--parallelism.spmd-backend
partial_dtensor`` (the default ``spmd_types`` backend is not exercised here). Example::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tests/scripts/titan/titan_train.py \\
        --module llama3 --config llama3_debugmodel --parallelism.spmd-backend partial_dtensor \\
        --parallelism.data-parallel-shard-degree 2 ...

See tests/scripts/titan/NOTES.md for the full commands.
"""

from __future__ import annotations

import os
import runpy
import types
from datetime import timedelta

import torch
import torch._utils


def _force_cpu_device() -> None:
    torch._utils._get_available_device_type = lambda: "cpu"


def _inert_cpu_memory_functions() -> None:
    import torch.cpu

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 1 << 34
    inert = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=total),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: {},
    }
    for name, fn in inert.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _eager_flex_attention() -> None:
    import torch.nn.attention.flex_attention as flex
    from torchtitan.models.common import attention

    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the eager path, no torch.compile
    flex._validate_device = lambda query, key, value: None  # "no backward on CPU"
    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask


def _pg_timeouts_for_this_torch() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torchtitan.distributed import utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        dist.barrier()
        groups = [
            mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ]
        for group in [*groups, None]:
            c10d._set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _fsdp_sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    original = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _plant_local_clip() -> None:
    """The bug: torchtitan's clip with the total norm taken from this rank's local shards only."""
    from torchtitan.distributed import utils as dist_utils

    def clip_grad_norm_(
        parameters,
        max_norm,
        norm_type=2.0,
        error_if_nonfinite=False,
        foreach=None,
        pp_mesh=None,
        ep_enabled=False,
    ):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        local = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for p in parameters
            if p.grad is not None
        ]
        total_norm = torch.nn.utils.get_total_norm(local, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
        return total_norm

    dist_utils.clip_grad_norm_ = clip_grad_norm_


def _losses_to_file(path: str) -> None:
    """Observation only: each logged step's loss and grad norm at full precision, one JSON line
    (torchtitan's own log line rounds the loss to 5 decimals)."""
    import json

    import torch.distributed as dist
    from torchtitan.components import metrics

    original = metrics.MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if not dist.is_initialized() or dist.get_rank() == 0:
            row = {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    metrics.MetricsProcessor.log = log


def main() -> None:
    _force_cpu_device()  # before anything imports torchtitan
    _inert_cpu_memory_functions()
    _eager_flex_attention()
    _pg_timeouts_for_this_torch()
    _fsdp_sum_reduction()
    if os.environ.get("TITAN_BUG") == "local-clip":
        _plant_local_clip()
    if os.environ.get("TITAN_LOSSES"):
        _losses_to_file(os.environ["TITAN_LOSSES"])
    # `python -m torchtitan.train ARGS`: the module run as __main__, sys.argv[1:] left as given
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
