"""What torch sees of torchtitan's training step: titan_train.py's run with torch's process-wide
hooks installed, each rank writing what it saw to ``$TITAN_PROBE.rank<N>.json``.

Used to write NOTES.md; same command line as titan_train.py. Never imports disttrace.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_train  # noqa: E402

seen: dict = {
    "outermost_forwards": [],
    "optimizer_steps": [],
    "backward_calls": Counter(),
    "forward_calls": Counter(),
    "backward_roots": [],
    "clip_calls": Counter(),
    "destroy_process_group": 0,
}
_depth = {"forward": 0, "step": 0}


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{type(x).__name__}{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _install() -> None:
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    def pre(mod, args, kwargs=None):
        _depth["forward"] += 1
        seen["forward_calls"][type(mod).__name__] += 1
        if _depth["forward"] == 1 and len(seen["outermost_forwards"]) < 3:
            seen["outermost_forwards"].append(
                {
                    "class": f"{type(mod).__module__}.{type(mod).__qualname__}",
                    "mro": [c.__name__ for c in type(mod).__mro__[:6]],
                    "args": [_describe(a) for a in args],
                    "kwargs": {k: _describe(v) for k, v in (kwargs or {}).items()},
                    "grad_enabled": torch.is_grad_enabled(),
                }
            )

    def post(mod, args, *rest):
        _depth["forward"] -= 1

    nn_module.register_module_forward_pre_hook(pre)
    if os.environ.get("TITAN_PROBE_FULL_BACKWARD"):  # does a global full backward hook run here?
        seen["full_backward_hook_calls"] = Counter()

        def full_backward(mod, grad_input, grad_output):
            seen["full_backward_hook_calls"][type(mod).__name__] += 1

        nn_module.register_module_full_backward_hook(full_backward)
    nn_module.register_module_forward_hook(post, always_call=True)

    def step_pre(opt, args, kwargs):
        _depth["step"] += 1
        seen["optimizer_steps"].append(
            {
                "class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                "depth": _depth["step"],
                "n_param_groups": len(opt.param_groups),
                "group_keys": sorted(k for k in opt.param_groups[0] if k != "params"),
                "n_params": sum(len(g["params"]) for g in opt.param_groups),
                "n_state": len(opt.state),
                "inner": [type(o).__name__ for o in getattr(opt, "optimizers", [])],
                "grad_enabled": torch.is_grad_enabled(),
            }
        )

    def step_post(opt, args, kwargs):
        _depth["step"] -= 1

    optim_module.register_optimizer_step_pre_hook(step_pre)
    optim_module.register_optimizer_step_post_hook(step_post)

    tensor_backward = torch.Tensor.backward
    autograd_backward = torch.autograd.backward

    def t_backward(self, *a, **k):
        seen["backward_calls"]["Tensor.backward"] += 1
        seen["backward_root"] = _describe(self)
        if len(seen["backward_roots"]) < 9:  # one micro-batch's worth
            seen["backward_roots"].append(
                {
                    "root": _describe(self),
                    "grad_fn": type(self.grad_fn).__name__,
                    "placements": str(getattr(self, "placements", "")),
                    "value": float(self.detach().full_tensor())
                    if hasattr(self, "full_tensor")
                    else float(self.detach()),
                }
            )
        return tensor_backward(self, *a, **k)

    def a_backward(*a, **k):
        seen["backward_calls"]["torch.autograd.backward"] += 1
        return autograd_backward(*a, **k)

    torch.Tensor.backward = t_backward
    torch.autograd.backward = a_backward

    for name in ("get_total_norm", "clip_grads_with_norm_", "clip_grad_norm_"):
        original = getattr(torch.nn.utils, name)

        def counted(*a, _name=name, _original=original, **k):
            seen["clip_calls"][_name] += 1
            return _original(*a, **k)

        setattr(torch.nn.utils, name, counted)

    destroy = torch.distributed.destroy_process_group

    def counted_destroy(*a, **k):
        seen["destroy_process_group"] += 1
        _dump()
        return destroy(*a, **k)

    torch.distributed.destroy_process_group = counted_destroy

    from torchtitan import trainer

    original_train = trainer.Trainer.train

    def train(self):
        model = self.model_parts[0]
        params = list(model.named_parameters())
        seen["model_parts"] = len(self.model_parts)
        seen["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
        seen["model_mro"] = [c.__name__ for c in type(model).__mro__[:6]]
        seen["params"] = [
            {
                "name": n,
                "type": type(p).__name__,
                "placements": str(getattr(p, "placements", "")),
                "local_shape": list(p.to_local().shape) if hasattr(p, "to_local") else None,
                "shape": list(p.shape),
            }
            for n, p in params
        ]
        seen["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        opts = self.optimizers
        seen["optimizers"] = {
            "class": f"{type(opts).__module__}.{type(opts).__qualname__}",
            "is_optimizer": isinstance(opts, torch.optim.Optimizer),
            "mro": [c.__name__ for c in type(opts).__mro__],
            "inner": [type(o).__name__ for o in opts.optimizers],
            "inner_defaults": [{k: str(v) for k, v in o.defaults.items()} for o in opts.optimizers],
            "param_groups_keys": [sorted(g) for g in opts.param_groups],
            "state_type": type(opts.state).__name__,
            "step_hooked": getattr(type(opts).step, "hooked", None),
        }
        seen["loss_fn"] = f"{type(self.loss_fn).__module__}.{type(self.loss_fn).__qualname__}"
        return original_train(self)

    trainer.Trainer.train = train


def _dump() -> None:
    path = os.environ.get("TITAN_PROBE")
    if not path:
        return
    rank = os.environ.get("RANK", "0")
    out = {k: (dict(v) if isinstance(v, Counter) else v) for k, v in seen.items()}
    out["optimizer_steps_summary"] = Counter(
        f"{s['class']} depth={s['depth']}" for s in seen["optimizer_steps"]
    )
    Path(f"{path}.rank{rank}.json").write_text(json.dumps(out, indent=1, default=str))


def main() -> None:
    titan_train._force_cpu_device()
    titan_train._inert_cpu_memory_functions()
    titan_train._eager_flex_attention()
    titan_train._pg_timeouts_for_this_torch()
    titan_train._fsdp_sum_reduction()
    if os.environ.get("TITAN_LOSSES"):
        titan_train._losses_to_file(os.environ["TITAN_LOSSES"])
    _install()
    import runpy

    try:
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    finally:
        _dump()


if __name__ == "__main__":
    main()
