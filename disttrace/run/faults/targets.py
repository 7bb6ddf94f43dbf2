"""What the faults on a named tensor share: finding the tensor, checking it exists on the rank, the
parameters after the optimizer step (the parameter server's master copy)."""

from __future__ import annotations

from disttrace.config.manifest import Manifest
from disttrace.errors import BadInput
from disttrace.run.faults.base import AnyManifest, Fault
from disttrace.run.job.hooks import Point


def pick(grads, tensor: str):
    """Find the (index, name, tensor) entry named `tensor` (a name, or an index as text)."""
    for entry in grads:
        if entry[1] == tensor or str(entry[0]) == tensor:
            return entry
    return None


def _check_bit(args, manifest: AnyManifest):
    bits = 64 if manifest.training.dtype == "float64" else 32
    if not 0 <= args.bit < bits:
        raise BadInput("--param bit", f"bit {args.bit} does not exist in a {bits}-bit value")


def _check_tensor(cls, rank: int, args, manifest: Manifest) -> None:
    """The named tensor (a name, or an index as text, as `pick`) must be a parameter the rank holds."""
    from disttrace.model.names import parameter_names

    par = manifest.parallelism
    stage = 0
    if par.pp > 1:
        from disttrace.run.job.topology import coords_of, mesh_shape

        stage = coords_of(rank, mesh_shape(manifest)[0])["pp"]
    names = parameter_names(manifest.model.model_dump(), par.pp, stage)
    want = str(args.tensor)
    if want in names or (want.isdigit() and int(want) < len(names)):
        return
    where = f" (pipeline stage {stage} of rank {rank})" if par.pp > 1 else ""
    close = [n for n in names if want.split(".")[-1] in n][:3] or names[:3]
    raise BadInput(
        "--param tensor",
        f"'{cls.name}' names tensor '{want}', which is not a parameter of this "
        f"model{where}: it would change nothing; e.g. {', '.join(close)} (or an index 0..{len(names) - 1})",
    )


class _TensorFault(Fault):
    """A fault on one named parameter (or its gradient): the rank must hold it."""

    @classmethod
    def check_target(cls, rank, args, manifest):
        _check_tensor(cls, rank, args, manifest)


class _ParamFault(Fault):
    """A fault on the parameters after the optimizer step. Under the parameter server it acts on the server's
    master parameters before it hands them out (`server_update`), else the next pull would overwrite it."""

    def where(self, point: Point) -> Point:
        return Point.SERVER_UPDATE if point == Point.OPTIMIZER and self._on_server() else point

    def _on_server(self) -> bool:
        return self.manifest.parallelism.architecture == "parameter-server"

    def _target(self) -> str:
        return "master" if self._on_server() else "local"
