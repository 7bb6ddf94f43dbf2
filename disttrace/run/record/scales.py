"""The magnitudes behind each gradient record: what a rounding or propagated error of a gradient is
bounded by when the gradient itself cancels (analysis/tolerance.py, "Magnitudes").

A parameter's gradient is a sum over tokens of products of what its module saw: a linear layer's
``dW = dY^T X``, an RMSNorm's ``dw_j = sum_t dy_tj * xhat_tj``, an embedding's ``dE = onehot^T dY``. Each is
a bilinear form in the module's input ``X`` and output gradient ``dY``; elementwise ``|dW| <= |dY|^T |X|``,
and ``|| |dY|^T |X| ||_F <= ||X||_F ||dY||_F`` (Cauchy-Schwarz per element, then the Frobenius norm of a
rank-one bound). A relative error ``eps`` in X and dY thus moves dW by at most ``~2 eps ||X|| ||dY||``
however much the sum over tokens cancels. This observer records ``m = ||X||_F ||dY||_F`` per parameter and
micro-batch (an embedding's ``||X||`` is the square root of its token count: one-hot rows; an RMSNorm's
weight multiplies ``x / rms(x)``, whose Frobenius norm is at most the square root of its size; a bias's
gradient sums dY over the positions it is broadcast to, so its ``||X||`` is the square root of their count), accumulated
over the step's micro-batches the way the gradient accumulates, and writes at each `backward` and `reduce`
record the value it had then, with the step's clip scalars (the global norm and the coefficient, which the
bound of what a coefficient below 1 scales needs): one frame per step in ``trajectory/rank-N.scales.bin``
(store/scales.py; sealed with the rank's other files). Diff sums a reduced gradient's magnitudes over the ranks that contributed to it.

Cost: one sum of squares over each module's input (shared inputs counted once) and output gradient per
micro-batch, on the tensors' device, in float32; no collective. A DTensor contributes its local part (the
local shard's gradient is bounded by the local magnitudes). On an accelerator the step's figures reach
the host in one copy at the step's end.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from disttrace.run.record.recorder import no_dispatch_modes
from disttrace.store import scales
from disttrace.store.rundir import rank_file


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sq(t):
    import torch

    t = _local(t).detach()
    # float32 or wider: the figure scales a bound, its own rounding is irrelevant (float64 stays float64)
    wide = t.dtype if t.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(t, dtype=wide) ** 2


class Magnitudes:
    """Observer: per parameter index, the step's accumulated ``||X|| ||dY||`` (see the module docstring)."""

    ORDER = 91  # after the recorder (90): reads nothing it writes, but runs after faults like it

    def __init__(self, run_dir: Path, rank: int, model, every: int = 1):
        self.rank, self.every = rank, every
        self.path = Path(run_dir) / rank_file("trajectory", rank, scales.SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._acc: dict[int, object] = {}  # index -> 0-d tensor (device)
        self._snap: list[tuple[str, int, dict]] = []  # (phase, micro-batch, {index: tensor})
        self._clip: dict[str, object] = {}  # the step's grad_norm and clip_coef (0-d tensors)
        self._last_in: tuple | None = None
        self._handles = []
        self._on = True
        index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        for module in model.modules():
            own = [
                (index[id(p)], p.numel() if n.endswith("bias") else 0)
                for n, p in module.named_parameters(recurse=False)
                if id(p) in index
            ]
            if own:
                self._handles.append(module.register_forward_hook(self._forward(own, module)))

    def _forward(self, own: list[tuple[int, int]], module):
        """`own`: (index, 0) for a parameter that multiplies the module's input, (index, its size) for a
        bias: a bias's gradient sums the output gradient over the positions it is broadcast to, so its X is
        a vector of ones over them (``||X|| = sqrt(numel(dY) / numel(bias))``)."""
        import torch

        embedding = isinstance(module, torch.nn.Embedding)
        # an RMSNorm's weight multiplies x / rms(x), whose rows have RMS <= 1: ||x_hat|| <= sqrt(numel)
        counted = embedding or (not isinstance(module, torch.nn.Linear) and hasattr(module, "eps"))

        def hook(_mod, inputs, out):
            if self._on and torch.is_grad_enabled() and getattr(out, "requires_grad", False):
                self._input(own, counted, inputs[0] if inputs else None, out)

        return hook

    def _input(self, own: list[tuple[int, int]], counted: bool, x, out) -> None:
        """A module's forward: ||X||^2 now (its input is gone by the backward), dY's when it arrives."""
        import torch

        with no_dispatch_modes():
            if counted or x is None or not torch.is_floating_point(_local(x)):
                sx = torch.tensor(float(_local(x).numel()) if x is not None else 0.0)
            elif self._last_in is not None and self._last_in[0] is x:
                sx = self._last_in[1]  # q, k, v projections read one input: counted once
            else:
                sx = _sq(x)
                self._last_in = (x, sx)
        out.register_hook(functools.partial(self._grad, own, sx))

    def _grad(self, own: list[tuple[int, int]], sx, g) -> None:
        """The module's output gradient: each of its parameters' ``||X|| ||dY||`` added to the step's."""
        with no_dispatch_modes():
            sg = _sq(g)
            m = (sx.to(sg.device) * sg).sqrt()
            for i, bias in own:
                mi = m if not bias else (sg * (g.numel() / bias)).sqrt()
                prev = self._acc.get(i)
                self._acc[i] = mi if prev is None else prev + mi

    def attach(self, bus) -> Magnitudes:
        bus.on("step_start", self._step_start, self.ORDER)
        bus.on("backward", self._phase("backward"), self.ORDER)
        bus.on("reduce", self._phase("reduce"), self.ORDER)
        bus.on("clip", self._clip_scalars, self.ORDER)
        bus.on("step_end", self._step_end, self.ORDER)
        return self

    def _step_start(self, bus, p):
        self._on = bus.step % self.every == 0
        self._acc, self._snap, self._last_in, self._clip = {}, [], None, {}

    def _clip_scalars(self, bus, p):
        if self._on:
            self._clip = {n: t for _, n, t in p.scalars if n in ("grad_norm", "clip_coef")}

    def _phase(self, phase: str):
        def handler(bus, p):
            if not self._on:
                return
            snap = {int(i): self._acc[int(i)] for i, _, _ in p.grads if int(i) in self._acc}
            self._snap.append((phase, int(bus.micro_batch), snap))

        return handler

    def _step_end(self, bus, p):
        if not self._on:
            return
        import torch

        flat = [t.detach() for _, _, snap in self._snap for t in snap.values()]
        values = torch.stack(flat).cpu().numpy() if flat else np.empty(0, np.float32)
        groups, at = [], 0
        for ph, mb, snap in self._snap:
            v = values[at : at + len(snap)]
            keep = np.isfinite(v)
            groups.append((ph, mb, np.fromiter(snap, np.int64, len(snap))[keep], v[keep]))
            at += len(snap)
        clip = None
        if self._clip:  # as the recorder's `clip` records give them: a non-finite one is nan
            got = {n: float(_local(t).detach().double().cpu()) for n, t in self._clip.items()}
            norm, coef = got.get("grad_norm", math.nan), got.get("clip_coef", 1.0)
            clip = tuple(v if math.isfinite(v) else math.nan for v in (norm, coef))
        self._f.write(scales.encode(int(bus.step), groups, clip))
        self._f.flush()
        self._acc, self._snap, self._last_in, self._clip = {}, [], None, {}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._f.close()
