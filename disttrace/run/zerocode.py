"""Zero-code recording: `disttrace run -- CMD` records a training command that never calls
`disttrace.api.attach`, through torch's own process-wide hooks (docs/attach.md, "Zero-code recording").

`disttrace run|inject|replay|zoom -- CMD` puts `zerocode_site/` first on the command's PYTHONPATH, so every
Python process the command starts (torchrun's workers, `mp.spawn`'s children) runs its `sitecustomize`,
which calls `arm()` when the CLI prepared a run directory for it. Importing this module imports no torch: a
process that never imports torch (a shell tool the command runs) pays nothing, and one that does gets the
hooks the moment torch's own import completes, before the user's modules bind torch's names.

What a script would say to `attach` is found instead:
- the model: the first training forward (grad enabled, train mode, outside backward) of a module whose
  parameters an optimizer holds; its pre-hook runs before any inner module, so it is the outermost such
  call (a DDP wrapper, an FSDP2 root, the plain model);
- the optimizer: of the optimizers constructed so far, the one holding most of the model's parameters; an
  optimizer that holds another (torchtitan's OptimizersContainer, ZeroRedundancyOptimizer) is the one
  stepped, so its inner optimizers are not recorded a second time;
- the loss: the root of each micro-batch's first `torch.autograd.backward` (which `Tensor.backward` calls),
  when it is one value;
- the data: the outermost forward's first tensor input (as attach does without a loader);
- the end: `torch.distributed.destroy_process_group()` of the default group, or the interpreter's exit with
  no exception on its way out, seals the run; an uncaught exception leaves it incomplete, with why.

A script that calls `attach` itself keeps its own run: discovery stands down once any run is active.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import weakref

ZERO_CODE_ENV = "DISTTRACE_ZERO_CODE"  # "1": record the command without an attach call
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zerocode_site")

_armed = False
_state: _Discovery | None = None


def arm() -> None:
    """Install the hooks once torch is imported (now, if it already is)."""
    global _armed
    if _armed:
        return
    _armed = True
    if "torch" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorch())


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs `_install` right after the `torch` package finishes importing (a post-import hook: Python has
    none of its own). It finds nothing itself; it only wraps the loader the other finders return."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install()

        spec.loader.exec_module = exec_then_install
        return spec


def _install() -> None:
    global _state
    import torch

    _state = _Discovery(torch)


class _Discovery:
    """The process-wide hooks: optimizers as they are built, the first training forward of their model, the
    loss at backward, the run's end."""

    def __init__(self, torch):
        from torch.nn.modules.module import register_module_forward_pre_hook

        from disttrace.run.attach.points import patch_clip

        self.torch = torch
        self.optimizers: list[weakref.ref] = []
        self.unrelated: weakref.WeakSet = (
            weakref.WeakSet()
        )  # modules whose parameters no optimizer holds
        self.run = None
        self.failed = False
        self.loss_at: tuple[int, int] | None = (
            None  # the (step, micro-batch) whose loss was recorded
        )
        self._wrap_optimizer_init()
        self._wrap_backward()
        self._wrap_destroy()
        # clipping is dispatched to the active run from the moment torch is imported, so a module that binds
        # torch.nn.utils.clip_grad_norm_ (or its two halves) by name reaches it too
        patch_clip(True)
        self.forward_hook = register_module_forward_pre_hook(self._on_forward)
        import atexit

        atexit.register(self._at_exit)
        previous = sys.excepthook

        def excepthook(kind, exc, tb):
            self._failed(exc)
            previous(kind, exc, tb)

        sys.excepthook = excepthook

    # ------------------------------------------------------------------ what torch is asked to do
    def _wrap_optimizer_init(self) -> None:
        optimizer = self.torch.optim.Optimizer
        original = optimizer.__init__
        built = self.optimizers

        def __init__(opt, *args, **kwargs):
            original(opt, *args, **kwargs)
            built.append(weakref.ref(opt))

        optimizer.__init__ = __init__

    def _wrap_backward(self) -> None:
        autograd = self.torch.autograd
        original = autograd.backward
        discovery = self

        def backward(tensors, *args, **kwargs):
            root = (
                tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
            )
            if discovery.run is not None and discovery._is_loss(root):
                discovery.loss_at = (discovery.run.step, discovery.run._forwards - 1)
                root = discovery.run.loss(root)
                tensors = [root] if isinstance(tensors, (list, tuple)) else root
            return original(tensors, *args, **kwargs)

        autograd.backward = backward

    def _is_loss(self, t) -> bool:
        """A micro-batch's loss: one value, the first backward since that micro-batch's forward, not a
        backward that autograd itself runs (reentrant activation checkpointing)."""
        run = self.run
        if run._closed or run._paused or not self.torch.is_tensor(t) or t.numel() != 1:
            return False
        if self.torch._C._current_graph_task_id() != -1:
            return False
        return run._forwards >= 1 and self.loss_at != (run.step, run._forwards - 1)

    def _wrap_destroy(self) -> None:
        dist = self.torch.distributed
        if not dist.is_available():
            return
        original = dist.destroy_process_group
        discovery = self

        def destroy_process_group(group=None):
            if group is None or group is dist.group.WORLD:
                discovery.close()  # the seal's gather needs the group this call ends
            return original(group)

        dist.destroy_process_group = destroy_process_group

    # ------------------------------------------------------------------ finding the model and optimizer
    def _on_forward(self, module, args):
        if self.run is not None or self.failed or not self.optimizers:
            return None
        torch = self.torch
        if not (module.training and torch.is_grad_enabled()):
            return None
        if torch._C._current_graph_task_id() != -1 or module in self.unrelated:
            return None
        from disttrace.run.attach.points import active_runs

        if active_runs():  # the script attached itself: its settings stand
            self.forward_hook.remove()
            return None
        held = {id(p) for p in module.parameters()}
        optimizer = _stepped_optimizer(self._live_optimizers(), held)
        if optimizer is None:
            self.unrelated.add(module)
            return None
        self.forward_hook.remove()
        self._attach(module, optimizer, args, _caller_kwargs())
        return None

    def _live_optimizers(self) -> list:
        live = [o for o in (r() for r in self.optimizers) if o is not None]
        self.optimizers[:] = [weakref.ref(o) for o in live]
        return live

    def _attach(self, module, optimizer, args, kwargs) -> None:
        from disttrace.run.attach.start import attach_discovered

        try:
            self.run = attach_discovered(module, optimizer)
        except BaseException:
            self.failed = True
            raise
        # the run's own forward pre-hook sits on the inner module: under a wrapper it runs within this
        # call; on the module itself it was added after this call read its hooks, so this forward is
        # counted here
        if self.run.inner is module:
            self.run._on_forward(module, args, kwargs)

    # ------------------------------------------------------------------ the end of the run
    def close(self) -> None:
        run = self.run
        if run is not None and not run._closed and not self.failed:
            run.close()

    def _failed(self, exc: BaseException) -> None:
        if self.run is not None and not self.run._closed and not self.failed:
            self.failed = True
            self.run.__exit__(type(exc), exc, exc.__traceback__)

    def _at_exit(self) -> None:
        if self.run is None or self.run._closed or self.failed:
            return
        dist = self.torch.distributed
        world = self.run.typed.parallelism.world_size
        if dist.is_available() and not dist.is_initialized() and world > 1:
            return  # the group is gone: the seal cannot be gathered, the run stays incomplete
        self.close()


def _stepped_optimizer(optimizers: list, held: set[int]):
    """The optimizer that steps the module's parameters: of those holding any, the one holding most; an
    optimizer found inside another's attributes (a container stepping it) gives way to its container."""
    scored = []
    for opt in optimizers:
        n = sum(1 for g in opt.param_groups for p in g["params"] if id(p) in held)
        if n:
            scored.append((n, opt))
    if not scored:
        return None
    inner = {id(o) for _, opt in scored for o in _held_optimizers(opt)}
    outer = [(n, opt) for n, opt in scored if id(opt) not in inner] or scored
    return max(outer, key=lambda pair: pair[0])[1]


def _held_optimizers(opt) -> list:
    """The optimizers one optimizer object refers to in its attributes, directly or in a list, tuple or
    dict (where containers keep them)."""
    import torch

    found = []
    for value in vars(opt).values():
        items = value.values() if isinstance(value, dict) else value
        if isinstance(items, (list, tuple)) or isinstance(value, dict):
            found += [v for v in items if isinstance(v, torch.optim.Optimizer) and v is not opt]
        elif isinstance(value, torch.optim.Optimizer) and value is not opt:
            found.append(value)
    return found


def _caller_kwargs() -> dict:
    """The keyword arguments of the forward call a global pre-hook sees (torch hands such hooks only the
    positional ones): `Module._call_impl`'s frame holds them. Empty where the frame does not."""
    try:
        frame = sys._getframe(2)
        for _ in range(3):
            kwargs = frame.f_locals.get("kwargs")
            if isinstance(kwargs, dict):
                return kwargs
            frame = frame.f_back
    except (AttributeError, ValueError):
        pass
    return {}
