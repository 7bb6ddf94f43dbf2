"""The collectives attach itself runs (every rank's view gathered, rank 0's decisions broadcast) and what it
reads of the process groups torch built: each a no-op without torch.distributed initialised."""

from __future__ import annotations


def initialized_dist():
    """torch.distributed when a process group is up, else None: every collective of attach is a no-op alone."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = initialized_dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _gather(obj) -> list:
    dist = initialized_dist()
    if dist is None:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    dist = initialized_dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _process_groups() -> list[dict]:
    """The process groups torch built that this rank is in (private c10d tables: best effort)."""
    dist = initialized_dist()
    if dist is None:
        return [{"name": "world", "ranks": [0], "backend": None}]
    try:
        from torch.distributed import distributed_c10d as c10d

        out = []
        for pg, ranks in c10d._world.pg_group_ranks.items():
            try:
                backend = str(dist.get_backend(pg))
            except (RuntimeError, ValueError):
                backend = None
            out.append(
                {
                    "name": c10d._world.pg_names.get(pg, ""),
                    "ranks": sorted(ranks),
                    "backend": backend,
                }
            )
        return out
    except (AttributeError, RuntimeError):
        return [
            {
                "name": "world",
                "ranks": list(range(dist.get_world_size())),
                "backend": dist.get_backend(),
            }
        ]


def _mesh_groups(mesh, dim: int) -> list[list[int]]:
    """The rank groups along one dimension of a DeviceMesh (same coordinates on every other dimension)."""
    ranks = mesh.mesh
    size = ranks.shape[dim]
    return sorted(ranks.movedim(dim, -1).reshape(-1, size).tolist())
