"""Zero-code recording: `disttrace run -- CMD` records a training command that never calls
`disttrace.api.attach`, through torch's own process-wide hooks (docs/attach.md, "Zero-code recording").

`disttrace run|inject|replay|zoom -- CMD` puts `site/` first on the command's PYTHONPATH, so every
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
  no exception on its way out, seals the run; an uncaught exception leaves it incomplete, with why;
- checkpoints: the script's own DCP save right after a step also writes the run store's verified checkpoint
  of that step and marks the script's directory with the step (`disttrace-step.json`); the script's DCP
  load of a marked directory makes the run resume from that step (the recovered path, or a replay), as
  `run.resume` does.

A script that calls `attach` itself keeps its own run: discovery stands down once any run is active.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import weakref
from pathlib import Path

ZERO_CODE_ENV = "DISTTRACE_ZERO_CODE"  # "1": record the command without an attach call
# left in a checkpoint directory the script saved during a recorded run: the step it holds
CHECKPOINT_MARK = "disttrace-step.json"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")

_armed = False
_state: _Discovery | None = None


def arm() -> None:
    """Install the hooks once torch is imported (now, if it already is)."""
    global _armed
    if _armed:
        return
    _armed = True
    after_import("torch", _install)


def after_import(name: str, then) -> None:
    """Call `then()` right after module `name` finishes importing (now, if it has)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A post-import hook (Python has none of its own): it finds nothing itself, it only wraps the loader
    that the path finder returns for one module so that `then` runs once the module has executed."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then
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
        # modules whose parameters no optimizer holds: not asked again
        self.unrelated: weakref.WeakSet = weakref.WeakSet()
        self.run = None
        self.failed = False
        # the (step, micro-batch) whose loss was recorded, and the autograd nodes of the model's latest
        # training forward's outputs (what the loss must be computed from)
        self.loss_at: tuple[int, int] | None = None
        self.outputs: list = []
        self._wrap_optimizer_init()
        self._wrap_backward()
        self._wrap_destroy()
        # a marked checkpoint the script loaded before its first forward: the run resumes from it at attach
        self.pending_resume: tuple[Path, dict] | None = None
        after_import("torch.distributed.checkpoint", self._wrap_checkpoints)
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
                discovery.outputs = []
                if hasattr(root, "to_local"):  # a DTensor loss is recorded, not replaced
                    discovery.run.loss(root.to_local())
                else:
                    root = discovery.run.loss(root)
                    tensors = [root] if isinstance(tensors, (list, tuple)) else root
            return original(tensors, *args, **kwargs)

        autograd.backward = backward

    def _is_loss(self, t) -> bool:
        """A micro-batch's loss: one value computed from the model's output, the first such backward since
        that micro-batch's forward, not one autograd itself runs (reentrant activation checkpointing). A
        backward whose graph never reaches the output (torchtitan's chunked loss backpropagates each chunk
        into a detached copy of the hidden states first) is not the loss."""
        run = self.run
        if run._closed or run._paused or not self.torch.is_tensor(t) or t.numel() != 1:
            return False
        if self.torch._C._current_graph_task_id() != -1:
            return False
        if run._forwards < 1 or self.loss_at == (run.step, run._forwards - 1):
            return False
        return not self.outputs or _reaches(t.grad_fn, self.outputs)

    def _on_output(self, module, _args, output) -> None:
        """The autograd nodes of a training forward's output tensors (any nesting of tuples, lists, dicts
        and ModelOutput-like mappings)."""
        if not (module.training and self.torch.is_grad_enabled()):
            return
        if self.torch._C._current_graph_task_id() != -1:
            return
        nodes, stack = [], [output]
        while stack and len(nodes) < 64:
            value = stack.pop()
            if self.torch.is_tensor(value):
                if value.grad_fn is not None:
                    nodes.append(value.grad_fn)
            elif isinstance(value, dict) or hasattr(value, "values"):
                try:
                    stack.extend(value.values())
                except TypeError:
                    pass
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
        self.outputs = nodes

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

    def _wrap_checkpoints(self) -> None:
        """The script's own DCP saves and loads: a save after a step also writes the run store's verified
        checkpoint of that step and marks the script's directory with the step; a load of a marked
        directory makes the run resume from that step, as `run.resume` does."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

        discovery = self

        def saving(original):
            def save(state_dict, *args, **kwargs):
                out = original(state_dict, *args, **kwargs)
                discovery._saved(_checkpoint_dir(kwargs, "storage_writer"))
                return out

            return save

        def load(state_dict, *args, **kwargs):
            out = original_load(state_dict, *args, **kwargs)
            discovery._loaded(_checkpoint_dir(kwargs, "storage_reader"))
            return out

        original_load = state_dict_loader.load
        for name in ("save", "async_save"):
            original = getattr(state_dict_saver, name, None)
            if original is not None:
                wrapped = saving(original)
                for module in (dcp, state_dict_saver):
                    setattr(module, name, wrapped)
        for module in (dcp, state_dict_loader):
            module.load = load

    def _saved(self, path: Path | None) -> None:
        run = self.run
        if run is None or run._closed or run._paused or not run._stepped or path is None:
            return
        step = run.step
        run.checkpoint(step=step)  # the run store's own, verified copy: the recovery evidence
        if run.rank == 0 and path.is_dir():
            from disttrace.store.writers import write_json_atomic

            mark = {"manifest_id": run.manifest_id, "run": str(run.run_dir), "step": step}
            write_json_atomic(path / CHECKPOINT_MARK, mark)

    def _loaded(self, path: Path | None) -> None:
        if path is None or (self.run is not None and self.run._paused):
            return
        mark = _read_mark(path)
        if mark is None:
            return  # not a checkpoint a recorded run saved: an initial state, not a resume
        if self.run is None:
            self.pending_resume = (path, mark)
        else:
            self._resume(path, mark)

    def _resume(self, path: Path, mark: dict) -> None:
        from disttrace.errors import BadInput

        if mark["manifest_id"] != self.run.manifest_id:
            raise BadInput(
                path / CHECKPOINT_MARK,
                f"saved by a run of another experiment ({mark['manifest_id'][:12]}, this one is "
                f"{self.run.manifest_id[:12]}): a resume continues the run it came from",
                field="manifest_id",
            )
        self.run.resumed(path, mark["step"], Path(mark["run"]), with_optimizer=True)

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
        # the loss is what backward is called on from this module's output: this call's included
        self.output_hook = module.register_forward_hook(self._on_output)
        # the run's own forward pre-hook sits on the inner module: under a wrapper it runs within this
        # call; on the module itself it was added after this call read its hooks, so this forward is
        # counted here
        if self.pending_resume is not None:
            self._resume(*self.pending_resume)
        if self.run.inner is module:
            self.run._on_forward(module, args, kwargs)

    # ------------------------------------------------------------------ the end of the run
    def close(self) -> None:
        run = self.run
        if run is not None and not run._closed and not self.failed:
            self.output_hook.remove()
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


def _checkpoint_dir(kwargs: dict, storage: str) -> Path | None:
    """The directory a DCP save or load names (its checkpoint_id, or a filesystem storage's path)."""
    where = kwargs.get("checkpoint_id") or getattr(kwargs.get(storage), "path", None)
    try:
        return Path(where) if where is not None else None
    except TypeError:  # a storage that is no path (an object store's key)
        return None


def _read_mark(path: Path) -> dict | None:
    """The mark a recorded run left in a checkpoint directory it saved: a small JSON file of three typed
    fields, read without following a link; None where there is none or it is not that shape."""
    import orjson

    mark = path / CHECKPOINT_MARK
    try:
        if mark.is_symlink() or not mark.is_file() or mark.stat().st_size > 4096:
            return None
        doc = orjson.loads(mark.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    ok = (
        isinstance(doc, dict)
        and isinstance(doc.get("manifest_id"), str)
        and isinstance(doc.get("run"), str)
        and type(doc.get("step")) is int
        and doc["step"] >= 0
    )
    return doc if ok else None


def _reaches(root, targets: list, budget: int = 4096) -> bool:
    """Whether the autograd graph from `root` reaches one of the `targets` nodes, searched breadth first
    (the model's output lies a few nodes from its loss) and given up after `budget` nodes."""
    if root is None:
        return False
    wanted = set(map(id, targets))
    seen, frontier = {id(root)}, [root]
    while frontier and len(seen) <= budget:
        following = []
        for node in frontier:
            if id(node) in wanted:
                return True
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    following.append(child)
        frontier = following
    return False


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
    chosen = max(outer, key=lambda pair: pair[0])[1]
    # a container of one optimizer over the same parameters (torchtitan's OptimizersContainer of one
    # model part) steps it exactly once a step, and only the inner one holds the state and the
    # hyper-parameters: record that one
    held = _held_optimizers(chosen)
    if len(held) == 1 and _params(held[0]) == _params(chosen):
        return held[0]
    return chosen


def _params(opt) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def _held_optimizers(opt) -> list:
    """The optimizers one optimizer object refers to in its attributes, directly or in a list, tuple or
    dict (where containers keep them)."""
    import torch

    found = []
    for value in vars(opt).values():
        if isinstance(value, dict):
            value = list(value.values())
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, torch.optim.Optimizer) and v is not opt:
                found.append(v)
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
