"""Rank topology: rank -> node, local rank, mesh coordinates, and the process groups each rank is in.

Every rank derives the whole table on its own; the tables are gathered and must agree, because a rank that
believes in another layout would put its collectives in the wrong groups without any error.
"""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel

from disttrace.config.manifest import Manifest
from disttrace.store.documents import Groups, Topology, TopologyRank

MESH_DIMS = (
    "pp",
    "dp",
    "tp",
)  # outermost first: tp innermost keeps its heavy traffic within a node


# with context parallel the sequence's slices sit between dp and tp (torchtitan's order): a cp group
# exchanges keys and values every layer, more often than dp reduces
CP_MESH_DIMS = ("pp", "dp", "cp", "tp")


def mesh_shape(manifest: Manifest) -> tuple[tuple[int, ...], tuple[str, ...]]:
    p = manifest.parallelism
    if getattr(p, "cp", 1) > 1:  # only then: every other layout keeps the topology it always wrote
        return (p.pp, p.dp, p.cp, p.tp), CP_MESH_DIMS
    return (p.pp, p.dp, p.tp), MESH_DIMS  # MESH_DIMS's order


def coords_of(
    rank: int, shape: tuple[int, ...], dims: tuple[str, ...] = MESH_DIMS
) -> dict[str, int]:
    out, rest = {}, rank
    for dim, size in zip(reversed(dims), reversed(shape)):
        out[dim] = rest % size
        rest //= size
    return {d: out[d] for d in dims}


def groups_of(manifest: Manifest) -> dict[str, list[list[int]]]:
    """For each mesh dimension, the list of rank groups along it (same coordinates on every other dim)."""
    shape, dims = mesh_shape(manifest)
    world = 1
    for s in shape:
        world *= s
    groups: dict[str, list[list[int]]] = {}
    for _i, d in enumerate(dims):
        seen: dict[tuple, list[int]] = {}
        for r in range(world):
            c = coords_of(r, shape, dims)
            key = tuple(c[x] for x in dims if x != d)
            seen.setdefault(key, []).append(r)
        groups[d] = sorted(seen.values())
    return groups


class RankView(BaseModel):
    """What one rank derives of the layout on its own. All-gathered as its dict (`model_dump()`, the
    fields in this order), validated again on arrival; every rank's must agree."""

    rank: int
    host: str
    node_rank: int
    local_rank: int
    pid: int
    coords: dict[str, int]
    mesh_shape: dict[str, int]
    groups: Groups

    def place(self) -> TopologyRank:
        """Its line of topology.json."""
        return TopologyRank(
            rank=self.rank,
            host=self.host,
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            pid=self.pid,
            coords=self.coords,
        )


def local_view(manifest: Manifest, rank: int) -> RankView:
    shape, dims = mesh_shape(manifest)
    return RankView(
        rank=rank,
        host=socket.gethostname(),
        node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        pid=os.getpid(),
        coords=coords_of(rank, shape, dims),
        mesh_shape=dict(zip(dims, shape)),
        groups=groups_of(manifest),
    )


def merge(views: list[RankView]) -> Topology:
    """Check every rank's view agrees on the mesh and the groups; return the topology (topology.json).
    Raises RuntimeError naming the disagreeing ranks."""
    ref = views[0]
    bad = [v.rank for v in views if v.groups != ref.groups or v.mesh_shape != ref.mesh_shape]
    if bad:
        raise RuntimeError(
            f"rank topology disagrees: ranks {bad} see a different mesh or groups than rank 0"
        )
    for i, v in enumerate(views):
        if v.rank != i:
            raise RuntimeError(f"rank {v.rank} answered in slot {i}")
    return Topology(
        world_size=len(views),
        mesh_dims=list(ref.mesh_shape),
        mesh_shape=ref.mesh_shape,
        groups=ref.groups,
        ranks=[v.place() for v in views],
    )
